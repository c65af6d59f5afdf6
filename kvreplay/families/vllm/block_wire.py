"""The wire form of vLLM's KV-cache manager calls (the "vllm" family): how a request,
its block hashes and lists of blocks travel as plain values in a trace, and the
request a replay rebuilds from them. families/vllm/wire.py puts the wire in front of vLLM's
own manager; block_pool.py is kvreplay's manager speaking it natively."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# What the wire records of a request: the attributes vLLM's manager and block pool read,
# each as ``request_<attribute>`` (a method's own arguments may share a name with one).
REQUEST_FIELDS = ("request_id", "num_tokens", "num_prompt_tokens", "num_computed_tokens", "num_in_flight_tokens",
                  "num_preemptions", "skip_reading_prefix_cache", "shared_prefix_boundary", "status")
REQUEST_ARGS = {f if f == "request_id" else f"request_{f}": f for f in REQUEST_FIELDS}
HASH_ARGS = ("request_hashes", "request_hashes_from", "request_hash_len")
# Blocks on the wire: (groups, len of each group, ids...); the manager's own shared
# empty KVCacheBlocks is (-1,), since vLLM tells it apart by identity.
EMPTY = (-1,)


# -- values -------------------------------------------------------------------------------
def hashes_out(hashes: Sequence[bytes]) -> tuple[tuple[int, ...], int]:
    """Block hashes as one flat tuple of int64 words (big-endian, 8 bytes each, the last
    one zero-padded) and the hashes' length in bytes."""
    if not hashes:
        return (), 0
    n = len(hashes[0])
    if any(len(h) != n for h in hashes):
        raise ValueError("block hashes of different lengths")
    words = (n + 7) // 8
    return tuple(int.from_bytes(h[i * 8:(i + 1) * 8].ljust(8, b"\0"), "big", signed=True)
                 for h in hashes for i in range(words)), n


def hashes_in(flat: Sequence[int], length: int) -> list[bytes]:
    """The inverse of ``hashes_out``; ValueError when the words do not make whole hashes."""
    if hasattr(flat, "reshape"):  # an int64 tensor [n, words], as the first vLLM traces hold them
        flat = flat.reshape(-1).tolist()
    words = (length + 7) // 8
    if length < 1 or len(flat) % words:
        raise ValueError(f"{len(flat)} words are not whole {length}-byte block hashes")
    return [b"".join(int(w).to_bytes(8, "big", signed=True) for w in flat[i:i + words])[:length]
            for i in range(0, len(flat), words)]


# The block a pool keeps as its null placeholder (a sliding window's skipped blocks point
# at it): the first of its free queue, 0, in vLLM's pool and the builtin one alike. Never
# handed out, never cached, yet a hit may name it.
NULL_BLOCK_ID = 0


def groups_out(groups: Sequence[Sequence[Any]]) -> tuple[int, ...]:
    """Per-group block lists (KVCacheBlock objects or ids) as one tuple of ints."""
    ids = [b if isinstance(b, int) else b.block_id for g in groups for b in g]
    return (len(groups), *(len(g) for g in groups), *ids)


def groups_in(wire: Sequence[int]) -> list[list[int]] | None:
    """Block ids per group from their wire form; None for the manager's shared empty."""
    if tuple(wire) == EMPTY:
        return None
    if not wire or wire[0] < 0 or len(wire) < 1 + wire[0]:
        raise ValueError(f"not a block list: {tuple(wire)[:8]}")
    n = wire[0]
    sizes, ids = wire[1:1 + n], list(wire[1 + n:])
    if sum(sizes) != len(ids):
        raise ValueError("a block list's group sizes do not add up")
    out, at = [], 0
    for size in sizes:
        out.append(ids[at:at + size])
        at += size
    return out


class StandIn:
    """A request as the manager sees it, rebuilt from the wire."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.block_hashes: list[bytes] = []
        self.kv_cache_report_mode = "incremental"
        self.status: Any = None

    # What vLLM 0.34's manager asks a request for, from what the wire carries: a request
    # that skips cache reads may hit nothing; others are bounded by their last token only
    # (prompt-logprob limits are not recorded: a recording of such requests would need them).
    @property
    def prefix_cache_hit_limit(self) -> int | None:
        return 0 if getattr(self, "skip_reading_prefix_cache", False) else None

    def get_max_cache_hit_length(self, bound: int | None = None) -> int:
        limits = (self.num_tokens - 1, self.prefix_cache_hit_limit, bound)  # type: ignore[attr-defined]
        return min(limit for limit in limits if limit is not None)


def blocks_by_id(pool: Any, ids: Sequence[int]) -> list[Any]:
    """The pool's blocks with these ids; ValueError for an id the pool does not have
    (a damaged or hostile trace: a negative id would otherwise name a block from the end)."""
    blocks = pool.blocks
    n = len(blocks)
    for i in ids:
        if type(i) is not int or not 0 <= i < n:
            raise ValueError(f"block id {str(i)[:20]} is not a block of this pool (0..{n - 1})")
    return [blocks[i] for i in ids]


class RequestBook:
    """Requests by id, as a replay rebuilds them from the rows: each call updates the
    counts and appends the hashes the row carries."""

    def __init__(self, status: Callable[[str], Any] = str) -> None:
        self._status = status
        self._by_id: dict[str, StandIn] = {}

    def request(self, wire: dict[str, Any]) -> StandIn:
        rid = wire["request_id"]
        req = self._by_id.get(rid)
        if req is None:
            req = self._by_id[rid] = StandIn(rid)
        for key, attr in REQUEST_ARGS.items():
            if key in wire and attr != "request_id":
                setattr(req, attr, self._status(wire[key]) if attr == "status" else wire[key])
        start = int(wire.get("request_hashes_from", 0) or 0)
        del req.block_hashes[start:]
        if wire.get("request_hash_len"):
            req.block_hashes.extend(hashes_in(wire["request_hashes"], int(wire["request_hash_len"])))
        return req

    def forget(self, request_id: Any) -> None:
        self._by_id.pop(request_id, None)

    def args_without_request(self, wire: dict[str, Any]) -> dict[str, Any]:
        """A row's arguments less the request's own."""
        return {k: v for k, v in wire.items() if k not in REQUEST_ARGS and k not in HASH_ARGS}
