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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Translation:
    method: str  # the recorded method
    needs: tuple[str, ...]  # methods the build must have
    since: str  # sglang release that introduced the recorded method
    note: str
    call: Callable[[Any, dict[str, Any]], Any]


def _cat(segments: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    parts = [t.reshape(-1) for t, _ in segments]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _page_tokens(pool: Any, page_ids: torch.Tensor) -> torch.Tensor:
    # One slot per page: the older free() takes slots and frees their pages.
    return page_ids.reshape(-1).to(torch.int64) * int(getattr(pool, "page_size", 1) or 1)


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
    Translation("free_page_ids", ("free",), "0.5.20", "pages freed through one slot of each",
                lambda p, a: p.free(_page_tokens(p, a.get("page_ids", a.get("free_index"))))),
    Translation("clear_full_to_swa_mapping", ("set_full_to_swa_mapping",), "0.5.20", "mapping set to 0",
                lambda p, a: p.set_full_to_swa_mapping(a["full_indices"], torch.zeros_like(a["full_indices"]))),
    Translation("free_group_begin", (), "0.5.13", "no free groups: frees take effect at once",
                lambda p, a: None),
    Translation("free_group_end", (), "0.5.13", "no free groups: frees take effect at once",
                lambda p, a: None),
]:
    TABLE.setdefault(_t.method, []).append(_t)


def _has(pool: Any, name: str) -> bool:
    return callable(getattr(pool, name, None))


def translate(pool: Any, method: str) -> Translation | None:
    """The first translation of ``method`` whose needs the build meets, or None."""
    for t in TABLE.get(method, []):
        if all(_has(pool, n) for n in t.needs):
            return t
    return None
