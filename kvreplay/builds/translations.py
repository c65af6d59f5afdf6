"""API translations: how to replay a recorded call on a build that lacks its method.

sglang's allocator API grew between releases: the segment frees, ``free_page_ids``
and ``clear_full_to_swa_mapping`` arrived in the 0.5.20 series, free groups on SWA
pools after 0.5.12. A trace recorded on a newer release replays on an older build
through this one table: each entry rewrites the call into methods the build has,
with the same effect on which slots are held. The replay reports the call as
translated; a method with no entry, or whose entry needs methods the build also
lacks, is an ``unsupported`` divergence.

Strict mode compares nested sub-allocator calls, which a translation changes (a
segment free becomes a set-shaped one), so replay translated traces in ``remap``
mode to compare only what the caller can tell apart."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Translation:
    method: str  # the recorded method
    needs: tuple[str, ...]  # methods the build must have (``.name``: an attribute it must keep)
    since: str  # sglang release that introduced the recorded method
    note: str
    call: Callable[[Any, dict[str, Any]], Any]


def _cat(segments: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    parts = [t.reshape(-1) for t, _ in segments]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _page_tokens(pool: Any, page_ids: torch.Tensor) -> torch.Tensor:
    # One slot per page: the older free() takes slots and frees their pages.
    return page_ids.reshape(-1).to(torch.int64) * int(getattr(pool, "page_size", 1) or 1)


def _write_mapping(pool: Any, full: torch.Tensor, swa: torch.Tensor) -> None:
    if full.numel():
        mapping = pool.full_to_swa_index_mapping
        mapping[full.to(torch.int64)] = swa.to(mapping.dtype)


TABLE: dict[str, list[Translation]] = {}
for _t in [
    Translation("free_segment", ("free",), "0.5.20", "a kv-row segment freed as a set of slots",
                lambda p, a: p.free(a["free_index"])),
    Translation("free_swa_segment", ("free_swa",), "0.5.20", "SWA peers of a segment freed as a set",
                lambda p, a: p.free_swa(a["free_index"])),
    Translation("free_full_segment", ("free_full",), "0.5.20", "full slots of a segment freed as a set",
                lambda p, a: p.free_full(a["free_index"])),
    Translation("free_segments", ("free_segment",), "0.5.20", "one free_segment per segment",
                lambda p, a: [p.free_segment(t, start_pos=s) for t, s in a["segments"]] and None),
    Translation("free_segments", ("free",), "0.5.20", "all segments freed as one set of slots",
                lambda p, a: p.free(_cat(a["segments"]))),
    Translation("free_full_segments", ("free_full",), "0.5.20", "all segments' full slots freed as one set",
                lambda p, a: p.free_full(_cat(a["segments"]))),
    # Before free_full (0.5.19): the caller frees full slots whose SWA peers are already
    # released (free_full's own precondition), so free() releases the same slots: its
    # SWA half skips unmapped tokens.
    Translation("free_full_segments", ("free",), "0.5.20", "full slots with released SWA peers freed by free()",
                lambda p, a: p.free(_cat(a["segments"]))),
    Translation("free_full_segment", ("free",), "0.5.20", "full slots with released SWA peers freed by free()",
                lambda p, a: p.free(a["free_index"])),
    Translation("free_full", ("free",), "0.5.19", "full slots with released SWA peers freed by free()",
                lambda p, a: p.free(a["free_index"])),
    Translation("free_page_ids", ("free",), "0.5.20", "pages freed through one slot of each",
                lambda p, a: p.free(_page_tokens(p, a.get("page_ids", a.get("free_index"))))),
    Translation("clear_full_to_swa_mapping", ("set_full_to_swa_mapping",), "0.5.20", "mapping set to 0",
                lambda p, a: p.set_full_to_swa_mapping(a["full_indices"], torch.zeros_like(a["full_indices"]))),
    # Before 0.5.12 the caller wrote the mapping tensor itself (every SWA allocator
    # since 0.5.1 keeps it as full_to_swa_index_mapping): the same write.
    Translation("set_full_to_swa_mapping", (".full_to_swa_index_mapping",), "0.5.12",
                "the mapping tensor written directly",
                lambda p, a: _write_mapping(p, a["full_indices"], a["swa_indices"])),
    Translation("clear_full_to_swa_mapping", (".full_to_swa_index_mapping",), "0.5.20",
                "the mapping tensor zeroed directly",
                lambda p, a: _write_mapping(p, a["full_indices"], torch.zeros_like(a["full_indices"]))),
    Translation("available_size", ("full_available_size", "swa_available_size"), "0.5.11",
                "the smaller of the sub-pools' counts, as later SWA pools answer",
                lambda p, a: min(p.full_available_size(), p.swa_available_size())),
    Translation("free_group_begin", (), "0.5.13", "no free groups: frees take effect at once",
                lambda p, a: None),
    Translation("free_group_end", (), "0.5.13", "no free groups: frees take effect at once",
                lambda p, a: None),
]:
    TABLE.setdefault(_t.method, []).append(_t)


# Arguments later releases added as host copies of another argument (0.5.3 gave
# alloc_extend and alloc_decode their ``*_cpu`` twins). A build whose method lacks
# one is given the call without it: the device tensor carries the same values.
HOST_COPIES = {"alloc_extend": ("prefix_lens_cpu", "seq_lens_cpu"), "alloc_decode": ("seq_lens_cpu",),
               "alloc_extend_swa_tail": ("prefix_lens_cpu", "seq_lens_cpu")}
_fits: dict[tuple[type, str], frozenset[str]] = {}


def dropped_args(pool: Any, method: str, fn: Callable[..., Any]) -> frozenset[str]:
    """The host copies ``method`` is recorded with that ``fn`` (the build's) does not take."""
    key = (type(pool), method)
    if method not in HOST_COPIES:
        return frozenset()
    if key not in _fits:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or not params
        _fits[key] = frozenset() if open_ended else frozenset(a for a in HOST_COPIES[method] if a not in params)
    return _fits[key]


# Reads some releases declare but leave abstract (SWA pools before 0.5.11 raise
# NotImplementedError from available_size): they are side-effect free, so one
# probe tells.
_READS = frozenset({"available_size"})
_abstract: dict[tuple[type, str], bool] = {}


def abstract(pool: Any, method: str, fn: Callable[..., Any]) -> bool:
    """Does the build declare this read without implementing it?"""
    if method not in _READS:
        return False
    key = (type(pool), method)
    if key not in _abstract:
        try:
            fn()
            _abstract[key] = False
        except NotImplementedError:
            _abstract[key] = True
        except Exception:  # any other failure is the build's own, reported at the call
            _abstract[key] = False
    return _abstract[key]


def _has(pool: Any, name: str) -> bool:
    """A method the build has, or (``.name``) an attribute it keeps."""
    if name.startswith("."):
        return getattr(pool, name[1:], None) is not None
    return callable(getattr(pool, name, None))


def translate(pool: Any, method: str) -> Translation | None:
    """The first translation of ``method`` whose needs the build meets, or None."""
    for t in TABLE.get(method, []):
        if all(_has(pool, n) for n in t.needs):
            return t
    return None
