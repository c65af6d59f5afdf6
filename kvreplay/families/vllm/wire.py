"""vLLM's KV-cache manager as a pool family: the wire its calls are recorded in, and
the installed vLLM's manager as a build.

vLLM's scheduler hands its ``KVCacheManager`` Request objects and gets
``KVCacheBlocks`` back; neither fits a trace row. A ``ManagerWire`` stands between
them. Each manager call becomes a call of the same name on the wire (``free`` is
``free_request``) whose arguments are plain values: the request as its id, the counts
the manager reads of it and the block hashes the wire has not sent for it before;
blocks as ids, per KV-cache group. Its result is block ids. The BlockPool calls the
manager makes (get_new_blocks, free_blocks, touch) go through a ``BlockWire`` the
same way, so a recording shows them as nested rows.

Recording attaches a wire to a live manager (``attach``): the manager's methods are
replaced on the instance by shims that call the wire, which the recorder has patched,
and the wire calls the original with the caller's own objects. A replay builds a
fresh manager behind a wire (``InstalledManager``) and rebuilds each request from
what the rows carry. The builtin family (``families/vllm/pool.py``) speaks the same wire
with no vLLM at all. Everything here imports vLLM lazily."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvreplay.errors import BuildUnloadable, BuildUnsupported
from kvreplay.families.vllm.block_wire import (
    EMPTY,
    HASH_ARGS,
    REQUEST_ARGS,
    RequestBook,
    blocks_by_id,
    groups_in,
    groups_out,
    hashes_out,
)
from kvreplay.families.vllm.vocabulary import (
    MAMBA_MODES,
    STATE_WINDOW,
    VLLM_BLOCK_METHODS,
    VLLM_MANAGER_METHODS,
    VLLM_MANAGER_NAMES,
    Group,
    vllm_groups,
)

MANAGER_CLASS = "vllm.v1.core.kv_cache_manager:KVCacheManager"
ENGINE = "vllm"

# -- the wire -------------------------------------------------------------------------------
def real_ids(blocks: Sequence[Any]) -> tuple[int, ...]:
    """The ids of ``blocks`` that are not the pool's null block."""
    return tuple(b.block_id for b in blocks if not getattr(b, "is_null", False))


class BlockWire:
    """The block pool's state-changing calls in wire form (blocks by id)."""

    def __init__(self, owner: ManagerWire) -> None:
        self._owner = owner
        # (method, block ids) of each call in order while a replay listens: the blocks
        # get_new_blocks handed out, or those a free or touch named
        self.log: list[tuple[str, Any]] | None = None

    def get_new_blocks(self, num_blocks: int) -> tuple[int, ...]:
        out = self._owner._pass("get_new_blocks", num_blocks)
        return tuple(b.block_id for b in out)

    def free_blocks(self, block_ids: tuple[int, ...]) -> None:
        self._owner._pass("free_blocks", block_ids)

    def touch(self, block_ids: tuple[int, ...]) -> None:
        self._owner._pass("touch", block_ids)


class ManagerWire:
    """A KVCacheManager (and its BlockPool) spoken to in wire form.

    ``manager`` is vLLM's (or anything with its methods and a ``block_pool``). With
    ``live`` the wire serves a running engine: the caller's objects reach the
    original methods; otherwise requests are stand-ins rebuilt from the arguments."""

    # the requests the scheduler looked up: its queue, which no pool bounds
    growth_exempt = ("_book",)

    engine = ENGINE

    def __init__(self, manager: Any, ctor_args: dict[str, Any], *, live: bool = False,
                 status: Callable[[str], Any] = str) -> None:
        self.manager = manager
        self.pool = manager.block_pool
        self.ctor_args = ctor_args
        self.recorded_class = f"{type(manager).__module__}:{type(manager).__qualname__}"
        self.live = live
        self.wire_blocks = BlockWire(self)
        self._sent: dict[str, int] = {}  # live: block hashes already on the wire, per request
        self._book = RequestBook(status)  # replay: requests by id
        self._real: Any = None  # live: the call in progress (original, args, kwargs)
        self._block_real: dict[str, Callable[..., Any]] = {}
        self._block_args: Any = None
        self._block_options: dict[str, Any] = {}  # a block-pool call's options besides its blocks
        self._originals = {name: getattr(manager, VLLM_MANAGER_NAMES.get(name, name)) for name in VLLM_MANAGER_METHODS
                           if callable(getattr(manager, VLLM_MANAGER_NAMES.get(name, name), None))}
        # Each method's parameters: a release older than the recording may lack some (fit_arguments).
        self._params = {name: inspect.signature(fn).parameters for name, fn in self._originals.items()}
        # Methods handed a Request (the others take plain values, a request id among them).
        self._takes_request = {name for name, params in self._params.items() if "request" in params}
        for name in VLLM_BLOCK_METHODS:
            original = getattr(self.pool, name)
            self._block_real[name] = original
            setattr(self.pool, name, self._block_shim(name, original))
        for name in self._originals:  # a method this manager lacks stays absent: the replay says unsupported
            setattr(self, name, self._wire_method(name))

    # the counter a trace row carries: free blocks
    def available_size(self) -> int:
        return int(self.pool.get_num_free_blocks())

    # -- what the checker reads -----------------------------------------------------------
    def held_blocks(self, request_id: str) -> list[int]:
        """The request's block table, every KV-cache group's, as the manager keeps it."""
        managers = self.manager.coordinator.single_type_managers
        return [b.block_id for m in managers for b in m.req_to_blocks.get(request_id, ())]

    def _pruned_groups(self) -> list[Any]:
        # the groups that let go of a request's leading blocks: sliding windows, and Mamba
        # groups that keep only the state of the last computed token
        return [m for m in self.manager.coordinator.single_type_managers
                if getattr(m.kv_cache_spec, "sliding_window", None) or type(m.kv_cache_spec).__name__ == "MambaSpec"]

    def windows(self) -> tuple[tuple[int, int], ...]:
        """(window, block size) of each KV-cache group that lets go of leading blocks, in
        the manager's order; a Mamba group's window is STATE_WINDOW."""
        return tuple((int(getattr(m.kv_cache_spec, "sliding_window", None) or STATE_WINDOW),
                      int(m.kv_cache_spec.block_size)) for m in self._pruned_groups())

    def window_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's block table in each group of ``windows``, the null block as -1: a
        window's pruning shows as its leading entries turning to -1."""
        return tuple(tuple(-1 if getattr(b, "is_null", False) else b.block_id
                           for b in m.req_to_blocks.get(request_id, ()))
                     for m in self._pruned_groups())

    def cached_blocks(self) -> Iterable[tuple[Any, list[int]]]:
        """(hash key, block ids) of every entry in the prefix cache."""
        cache = self.pool.cached_block_hash_to_block
        dups = getattr(cache, "_dup_ids", {})
        for key, v in cache._cache.items():
            if isinstance(v, int):  # 0.34 on: a block id, with a key's other blocks kept apart
                yield key, (list(dups[key]) if key in dups else [v])
            else:  # before: a block, or a dict of them by id
                yield key, ([v.block_id] if hasattr(v, "block_id") else list(v))

    # -- block pool ---------------------------------------------------------------------
    def _block_shim(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        wire = self.wire_blocks

        def shim(arg: Any, **options: Any) -> Any:
            # 0.23's free_blocks(prepend=True) queues a window's uncached blocks at the head:
            # the wire names the blocks freed, and the release's own call gets the option back
            self._block_options = options
            if name == "get_new_blocks":
                self._block_args = None
                return self._logged(name, getattr(wire, name)(int(arg)))
            blocks = list(arg) if not isinstance(arg, list) else arg
            self._block_args = blocks
            # The null block (a sliding window's placeholder for blocks it let go) is never
            # queued or handed out: releases differ only in whether a free lists it (0.33
            # stopped), so the wire leaves it out and a free means the same on every release.
            ids = real_ids(blocks)
            if not ids:  # a free of placeholders only (0.24 makes them): no block changes
                return original(blocks, **options)
            getattr(wire, name)(ids)
            if wire.log is not None:  # a free or touch shows as the blocks it named
                wire.log.append((name, ids))
            return None

        shim.__wrapped__ = original  # type: ignore[attr-defined]
        return shim

    def _logged(self, name: str, result: Any) -> Any:
        out = self._block_result
        if self.wire_blocks.log is not None:
            self.wire_blocks.log.append((name, tuple(b.block_id for b in out)))
        return out

    def _pass(self, name: str, arg: Any) -> Any:
        """A BlockWire call reaching the real block pool."""
        original = self._block_real[name]
        if name == "get_new_blocks":
            self._block_result = original(arg)
            return self._block_result
        blocks, options = self._block_args, self._block_options
        self._block_args, self._block_options = None, {}
        if blocks is None or real_ids(blocks) != tuple(arg):
            blocks, options = blocks_by_id(self.pool, arg), {}  # a replayed top-level block call
        original(blocks, **options)
        return None

    # -- manager ------------------------------------------------------------------------
    def _wire_method(self, name: str) -> Callable[..., Any]:
        def method(**wire: Any) -> Any:
            return self._call(name, wire)

        method.__name__ = name
        return method

    def _call(self, name: str, wire: dict[str, Any]) -> Any:
        original = self._originals.get(name)
        if original is None:
            raise AttributeError(f"this manager has no {VLLM_MANAGER_NAMES.get(name, name)}")
        if self._real is not None:
            fn, args, kwargs = self._real
            self._real = None
            result = fn(*args, **kwargs)
            self._live_result = result
        else:
            if name == "new_step_starts":
                self._drain_step()
            args = self._arguments(name, wire)
            result = None if self._checks_first(name, wire) and not self._fits(args) else original(**args)
        if name == "free_request":
            self._sent.pop(wire.get("request_id"), None)
            self._book.forget(wire.get("request_id"))
        return result_out(name, result, self.manager)

    def _drain_step(self) -> None:
        """What vLLM's scheduler takes from the manager once a step (blocks to zero, the
        copies of partial-block hits), taken here in replay where no scheduler runs: left
        in place, those lists would grow with every step the trace replays."""
        for take in ("take_new_block_ids", "take_kv_cache_block_copies"):
            fn = getattr(self.manager, take, None)
            if callable(fn):
                fn()

    def _checks_first(self, name: str, wire: dict[str, Any]) -> bool:
        """Before 0.21 the whole-sequence admission check was the manager's own method,
        ``can_fit_full_sequence``, which the scheduler called first: a call that asks
        allocate_slots for it asks that method first on such a release."""
        return (name == "allocate_slots" and bool(wire.get("full_sequence_must_fit"))
                and "full_sequence_must_fit" not in self._params[name]
                and callable(getattr(self.manager, "can_fit_full_sequence", None)))

    def _fits(self, args: dict[str, Any]) -> bool:
        """can_fit_full_sequence on a replayed allocate_slots' arguments (a refusal answers
        None, as allocate_slots answers one from 0.21 on)."""
        gate = self.manager.can_fit_full_sequence
        params = inspect.signature(gate).parameters
        return bool(gate(**{k: v for k, v in args.items() if k in params}))

    def _arguments(self, name: str, wire: dict[str, Any]) -> dict[str, Any]:
        """The real call's arguments from a replayed row's."""
        if name in self._takes_request:
            args = {k: v for k, v in wire.items() if k not in REQUEST_ARGS and k not in HASH_ARGS}
            args["request"] = self._book.request(wire)
        else:
            args = dict(wire)
        if args.get("new_computed_blocks") is not None:
            args["new_computed_blocks"] = self._blocks(args["new_computed_blocks"])
        if "block_ids" in args:
            args["block_ids"] = {b.block_id for b in blocks_by_id(self.pool, args["block_ids"])}
        if "skip_zeroing_group_ids" in args:
            args["skip_zeroing_group_ids"] = tuple(args["skip_zeroing_group_ids"])
        if self._checks_first(name, wire):  # asked of can_fit_full_sequence instead (_fits)
            args.pop("full_sequence_must_fit")
        return fit_arguments(name, args, self._params[name])

    def _blocks(self, wire: Sequence[int]) -> Any:
        groups = groups_in(wire)
        if groups is None:
            return self.manager.empty_kv_cache_blocks
        return self.make_blocks([blocks_by_id(self.pool, g) for g in groups])

    def make_blocks(self, groups: list[list[Any]]) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        return KVCacheBlocks(tuple(groups))

    # -- live ---------------------------------------------------------------------------
    def shim(self, name: str) -> Callable[..., Any]:
        """What replaces the manager's own method: the wire call, recorded, with the
        caller's objects passed through."""
        original = self._originals[name]
        bind = _binder(inspect.signature(original))
        wire_call = getattr  # looked up per call: the recorder patches the wire after this

        def live(*args: Any, **kwargs: Any) -> Any:
            wire = self._wire_args(bind(args, kwargs))
            self._real = (original, args, kwargs)
            self._live_result = None
            try:
                wire_call(self, name)(**wire)
            finally:
                self._real = None
            return self._live_result

        live.__wrapped__ = original  # type: ignore[attr-defined]
        return live

    def _wire_args(self, arguments: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in arguments.items():
            if key == "request":
                out.update(self._request_out(value))
            elif key == "new_computed_blocks":
                out[key] = None if value is None else blocks_out(value, self.manager)
            elif key == "block_ids":
                out[key] = tuple(sorted(value))
            elif isinstance(value, (tuple, list)) and all(type(x) is int for x in value):
                out[key] = tuple(value)
            else:
                out[key] = value
        return out

    def _request_out(self, req: Any) -> dict[str, Any]:
        out = {key: getattr(req, attr, None) for key, attr in REQUEST_ARGS.items()}
        status = out["request_status"]
        out["request_status"] = getattr(status, "name", None if status is None else str(status))
        rid = req.request_id
        sent = self._sent.get(rid, 0)
        hashes = getattr(req, "block_hashes", None) or ()  # only its new tail is copied: a decode step's is empty
        if len(hashes) < sent:  # the request's hashes were rebuilt: send them all again
            sent = 0
        t, n = hashes_out(hashes[sent:])
        out.update(request_hashes=t, request_hashes_from=sent, request_hash_len=n)
        self._sent[rid] = len(hashes)
        return out


def _binder(sig: inspect.Signature) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]:
    """``sig.bind(*args, **kwargs)`` with defaults applied, as a dict in the parameters'
    order: on every call of a live scheduler, so the plain case (no ``*args``, no
    ``**kwargs``, every argument known) takes a few dict operations, not inspect's
    general binding (~20 us a call); anything else goes to inspect, which also raises
    the TypeError the method itself would."""
    params = sig.parameters
    names = tuple(params)
    known = frozenset(names)
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
    plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params.values())
    positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params.values())

    def general(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if not plain or len(args) > positional or not known.issuperset(kwargs):
            return general(args, kwargs)
        given = dict(zip(names, args))  # noqa: B905 - fewer args than names
        if not given.keys().isdisjoint(kwargs):
            return general(args, kwargs)  # the same argument twice: inspect says so
        given.update(kwargs)
        try:
            return {n: given[n] if n in given else defaults[n] for n in names}
        except KeyError:  # a required argument missing
            return general(args, kwargs)

    return bind


# Arguments a release before the recording's names otherwise: (its name, the recording's).
_RENAMED = {"remove_skipped_blocks": (("total_computed_tokens", "processed_computed_tokens"),)}
# Arguments that only steer something a release without them also lacks, so any value
# means nothing there: has_scheduled_reqs says whether the watermark applies, and a
# release without it keeps no watermark (a trace with one is refused at construction).
_MOOT = frozenset({"has_scheduled_reqs"})


def fit_arguments(name: str, args: dict[str, Any], params: Any) -> dict[str, Any]:
    """A recorded call's arguments as this manager's method takes them. An argument the
    method lacks is dropped when the recording gave it its neutral value (None, False,
    0, empty: what an older release did without it); any other value means the trace
    needs what this release does not have, and BuildUnsupported says which."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return args
    for old, new in _RENAMED.get(name, ()):
        if new in args and new not in params and old in params:
            args[old] = args.pop(new)
    for key in [k for k in args if k not in params]:
        value = args.pop(key)
        if value not in (None, False, 0, (), []) and key not in _MOOT:
            raise BuildUnsupported(f"this vLLM's {VLLM_MANAGER_NAMES.get(name, name)}() has no {key}, which the "
                                   f"trace sets to {str(value)[:40]}")
    return args


def blocks_out(blocks: Any, manager: Any) -> tuple[int, ...]:
    """KVCacheBlocks (or per-group lists) in wire form."""
    if blocks is getattr(manager, "empty_kv_cache_blocks", None):
        return EMPTY
    return groups_out(getattr(blocks, "blocks", blocks))


def result_out(name: str, result: Any, manager: Any) -> Any:
    """A manager call's result in wire form."""
    if name == "get_computed_blocks":
        # releases before 0.26 keep no shared-prefix boundary: theirs is 0, as full attention's is
        blocks, hit, boundary = result if len(result) == 3 else (*result, 0)
        return (int(hit), int(boundary), *blocks_out(blocks, manager))
    if name == "allocate_slots":
        return None if result is None else blocks_out(result, manager)
    if name == "pop_blocks_for_free":
        return tuple(b.block_id for b in result)
    if isinstance(result, bool) or result is None:
        return result
    return None


def attach(manager: Any) -> ManagerWire:
    """Put a wire in front of a live vLLM manager; the recorder records the wire."""
    wire = ManagerWire(manager, ctor_args_of(manager), live=True)
    for name in wire._originals:
        setattr(manager, VLLM_MANAGER_NAMES.get(name, name), wire.shim(name))
    return wire


def is_manager(obj: Any) -> bool:
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}" == MANAGER_CLASS


def ctor_args_of(manager: Any) -> dict[str, Any]:
    """A live manager's constructor arguments, as the family records them."""
    config = manager.kv_cache_config
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    coordinator = manager.coordinator
    return {
        "num_blocks": int(manager.block_pool.num_gpu_blocks),
        "block_size": int(specs[0].block_size) if specs else 0,
        "hash_block_size": int(manager.block_pool.hash_block_size),
        "max_model_len": int(manager.max_model_len),
        # only sliding-window and chunked-local admission read it; full attention does not keep it
        "max_in_flight_tokens": int(getattr(coordinator, "max_in_flight_tokens", 0) or manager.max_model_len),
        "enable_caching": bool(manager.enable_caching),
        # the manager keeps int(watermark * num_blocks); half a block more gives that back exactly
        "watermark": (manager.watermark_blocks + 0.5) / config.num_blocks if manager.watermark_blocks else 0.0,
        "attention": attention_of(specs),
        # which of a sliding window's blocks stay cached (None: every one; vLLM's server
        # default, 0: only the latest boundary); the hybrid coordinator reads it
        "retention_interval": getattr(config, "prefix_cache_retention_interval", None),
        # a server with an EAGLE/MTP drafter: each prefix hit gives up a block (absent: none)
        **({"use_eagle": True} if getattr(manager, "use_eagle", False) else {}),
    }


def attention_of(specs: list[Any]) -> str:
    """A manager's KV-cache groups as the trace's ``attention`` names them, in order."""
    if len({int(s.block_size) for s in specs}) > 1:  # groups of several block sizes: not constructed yet
        return ",".join(type(s).__name__ for s in specs)
    names = []
    for spec in specs:
        kind = type(spec).__name__
        if kind == "FullAttentionSpec":
            names.append("full")
        elif kind == "SlidingWindowSpec":
            names.append(f"sliding_window:{int(spec.sliding_window)}")
        elif kind == "MambaSpec" and (name := mamba_name(spec)):
            names.append(name)
        else:  # recorded by name; no build constructs it yet
            names.append(kind)
    return ",".join(names)


_MAMBA_KINDS = {mode: kind for kind, mode in MAMBA_MODES.items()}  # vLLM's cache mode -> the trace's name


def mamba_name(spec: Any) -> str | None:
    """A Mamba group's name in a trace's ``attention``; None for one no build constructs
    (prefill checkpoints, a mode of a release after this wire)."""
    kind = _MAMBA_KINDS.get(getattr(spec, "mamba_cache_mode", "none"))
    if kind is None or getattr(spec, "num_prefill_checkpoint_blocks", 0):
        return None
    spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    return f"{kind}:{spec_blocks}" if spec_blocks else kind


def group_specs(groups: tuple[Group, ...], block_size: int) -> list[Any]:
    """vLLM KV-cache specs for the groups a trace names, of the smallest shapes: which
    block goes where does not depend on what a block holds."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    shape = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs: list[Any] = []
    for g in groups:
        if g.kind == "full":
            specs.append(FullAttentionSpec(**shape))
        elif g.kind == "sliding_window":
            specs.append(SlidingWindowSpec(**shape, sliding_window=g.width))
        else:
            try:
                from vllm.v1.kv_cache_interface import MambaSpec
            except ImportError:
                raise BuildUnsupported("this vLLM has no Mamba KV-cache group") from None
            params = inspect.signature(MambaSpec).parameters
            if "mamba_cache_mode" not in params:
                raise BuildUnsupported("this vLLM's Mamba group has no prefix-caching modes")
            specs.append(MambaSpec(block_size=block_size, shapes=((1,),), dtypes=(torch.float32,),
                                   mamba_cache_mode=MAMBA_MODES[g.kind], num_speculative_blocks=g.width))
    return specs


class InstalledManager(ManagerWire):
    """``--build vllm``: the installed vLLM's manager, built from a trace's arguments
    with the KV-cache groups the trace's ``attention`` names (full attention, sliding
    windows: one, or a hybrid model's several) and no KV tensors (replay needs none)."""

    def __init__(self, num_blocks: int, block_size: int, hash_block_size: int, max_model_len: int,
                 max_in_flight_tokens: int, enable_caching: bool, watermark: float, attention: str,
                 retention_interval: int | None = None, use_eagle: bool | None = None) -> None:
        groups = vllm_groups(attention)
        if not groups:
            raise BuildUnsupported("--build vllm builds managers of full-attention, sliding-window and Mamba "
                                   f"groups of one block size; the trace's had {attention}")
        try:
            from vllm.v1.core.kv_cache_manager import KVCacheManager
            from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
            from vllm.v1.request import RequestStatus
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.partition(".")[0] != ENGINE:  # a release's own dependency, not vLLM's code
                raise BuildUnloadable(f"this vLLM imports {exc.name}, which is not installed here (a vLLM build uses "
                                      f"the installed vLLM's dependencies: pip install {exc.name.partition('.')[0]})"
                                      ) from None
            raise BuildUnloadable(f"vLLM's KV-cache manager could not be imported: {exc}") from None
        except Exception as exc:  # any import-time failure: this vLLM cannot be a build
            raise BuildUnloadable(f"vLLM's KV-cache manager could not be imported: {type(exc).__name__}: "
                                  f"{exc}") from None
        retention = {}
        if retention_interval is not None:
            if "prefix_cache_retention_interval" in inspect.signature(KVCacheConfig).parameters:
                retention = {"prefix_cache_retention_interval": retention_interval}
            elif any(g.kind == "sliding_window" for g in groups):  # only a sliding window's caching reads it
                raise BuildUnsupported("this vLLM keeps every sliding-window block cached; the trace's manager had "
                                       f"a retention interval of {retention_interval}")
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(group_specs(groups, block_size))],
            **retention)
        wanted = dict(max_model_len=max_model_len, scheduler_block_size=block_size, hash_block_size=hash_block_size,
                      max_in_flight_tokens=max_in_flight_tokens, enable_caching=enable_caching, watermark=watermark,
                      # what releases before 0.26 called the in-flight token budget
                      max_num_batched_tokens=max_in_flight_tokens, use_eagle=bool(use_eagle))
        params = inspect.signature(KVCacheManager).parameters
        if use_eagle and "use_eagle" not in params:
            raise BuildUnsupported("this vLLM's KVCacheManager has no EAGLE drafter's prefix-hit drop")
        if watermark and "watermark" not in params:
            raise BuildUnsupported(f"this vLLM's KVCacheManager keeps no watermark; the trace's was {watermark}")
        if hash_block_size != block_size and "hash_block_size" not in params:
            raise BuildUnsupported("this vLLM's KVCacheManager hashes whole blocks; the trace hashed "
                                   f"{hash_block_size}-token pieces of {block_size}-token blocks")
        manager = KVCacheManager(config, **{k: v for k, v in wanted.items() if k in params})
        args = dict(num_blocks=num_blocks, block_size=block_size, hash_block_size=hash_block_size,
                    max_model_len=max_model_len, max_in_flight_tokens=max_in_flight_tokens,
                    enable_caching=enable_caching, watermark=watermark, attention=attention)
        if retention_interval is not None:
            args["retention_interval"] = retention_interval
        if use_eagle:
            args["use_eagle"] = True
        super().__init__(manager, args, status=lambda name: RequestStatus[name] if name else None)


def installed(family: str | None, recorded_class: str = "") -> tuple[str, str | None, type]:
    """``--build vllm``: the installed vLLM's manager, for a trace of the vllm family."""
    return ENGINE, ENGINE, InstalledManager


def construct(fam: Any, cls: type, ctor: dict[str, Any], device: Any) -> Any:
    """A manager of ``cls`` from a trace's constructor arguments; it keeps no tensors,
    so the device is the caller's."""
    return cls(**{name: ctor.get(name) for name in fam.ctor_args})


def wire_for(obj: Any) -> ManagerWire | None:
    """What a recording of an engine object records: the wire before a vLLM manager."""
    return attach(obj) if is_manager(obj) else None
