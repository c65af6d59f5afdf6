"""Replay a trace of vLLM's KV-cache manager (the ``vllm`` family) against a build.

The build is a wire (families/vllm/wire.py): the installed vLLM's manager, or kvreplay's own
(families/vllm/pool.py). Each recorded top-level row is issued on it as recorded (a
manager call, or a block-pool call the scheduler made itself); strict mode compares
the result, the free-block count after the call and the block-pool calls made inside
it with the recording; the checker (families/vllm/checker.py) looks at the blocks each call
named. The report is the one every replay makes (replay/report.py), so the store,
reports and exit codes treat both families alike."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from kvreplay.builds.spec import BuildSpec
from kvreplay.errors import BuildUnsupported
from kvreplay.families.vllm.block_wire import EMPTY, NULL_BLOCK_ID, groups_in, groups_out
from kvreplay.families.vllm.checker import BlockPoolChecker
from kvreplay.families.vllm.vocabulary import VLLM_BLOCK_METHODS
from kvreplay.replay.compare import block_remap_difference, exception_difference, same
from kvreplay.replay.loop import ReplayLoop, plain
from kvreplay.trace.format import Opaque, TopCall
from kvreplay.trace.reader import TraceReader


class BlockReplayer(ReplayLoop):
    """One replay of one block-pool trace against one build; ``run`` (the shared loop)
    drives it."""

    # The block-pool calls a manager call made are compared with their block ids.
    nested_args = True

    def __init__(self, trace: str | Path, build: str | BuildSpec, *, mode: str = "strict", device: str = "auto",
                 full_check_every: int = 1000, stop_at_first: bool = False, check: bool = True,
                 keep: int = 20, after_gap: bool = False, reader: TraceReader | None = None,
                 checked: bool = False, **_: Any) -> None:
        self._open(trace, build, mode=mode, device=device, stop_at_first=stop_at_first, keep=keep, reader=reader,
                   checked=checked, whole="vLLM")
        self.pool = self._build(build, self.device)
        # the free-block count read through the method as built: a recorder started on this
        # pool afterwards (minimize's rebase) wraps the pool's methods, and must not see the reads
        self._available = self.pool.available_size
        checker = BlockPoolChecker(self.pool, full_check_every=full_check_every, keep=keep) if check else None
        # a manager method by its name, a block-pool one by ("blocks", name): no tuple per manager call
        self._methods: dict[str | tuple[str, str], Callable[..., Any]] = {}
        self._log: list[tuple[str, Any]] = []
        # a recording that starts mid-life (a snapshot, a later part) may hit blocks cached before it
        fresh = self.meta.initial_state is None and not (self.meta.extra.get("part") or {}).get("index")
        self.remap = BlockRemap(int(self.meta.ctor_args["block_size"]), fresh) if self.mode == "remap" else None
        self.pool.wire_blocks.log = self._log
        self._watch(checker, {"blocks": int(self.meta.ctor_args["num_blocks"])})
        self._see = self.timeline.seer("blocks")

    def calls_to_replay(self) -> Iterable[TopCall]:
        return self.reader.top_calls(device="cpu", nested_args=self.nested_args)

    def step(self, tc: TopCall) -> tuple[Any, BaseException | None]:
        """Issue one recorded call; returns what the build returned or raised."""
        c, n = tc.call, tc.number
        self.calls += 1
        fn = self._methods.get(c.method if c.target != "blocks" else ("blocks", c.method)) or self._method(tc)
        opaque = [k for k, v in c.args.items() if isinstance(v, Opaque)] if c.has_opaque else None
        if fn is None or opaque:
            why = (f"build {self.build_spec} has no method {c.method}" if fn is None else
                   f"argument(s) {', '.join(opaque)} of {c.method} were not recorded losslessly")
            return self._unsupported(n, c.method, why)
        log = self._log  # the wire appends this call's block-pool calls; read before the next call
        log.clear()
        raised: BaseException | None = None
        result: Any = None
        args = c.args if self.remap is None else self.remap.args(c)
        try:
            result = fn(**args)
        except BuildUnsupported as exc:  # the build lacks what this call needs: not its answer
            return self._unsupported(n, c.method, str(exc))
        except Exception as exc:  # the build's answer: compared with the recording's
            raised = exc
        want = c.counters.get("available")
        avail = None
        if want is not None:
            avail = self._available()
            self._see(n, avail)
        if raised is not None or c.exc_type is not None:
            got_exc, why = exception_difference(c.exc_type, raised)
            if why is not None:
                self._diverge(n, c.method, "exception", c.exc_type, got_exc, why)
            return result, raised
        if self.remap is None:
            # Most calls return what was recorded, leave the recorded free count and make no
            # block-pool call: that is decided here, without a call into _compare.
            recorded = c.result
            if (type(recorded) is not type(result) or type(result) not in _PLAIN or recorded != result
                    or want != avail or (c.target != "blocks" and (tc.nested or log))):
                self._compare(tc, result, want, avail, log)
        else:
            self.remap.learn(tc, args, result, log)
            why = block_remap_difference(c.result, result) or self.remap.unstored_hit(tc)
            if why is not None:
                self._diverge(n, c.method, "result", c.result, result, why)
        checker = self.checker
        if checker is not None:
            if c.target == "blocks":  # the scheduler's own block-pool call
                log = [(c.method, result if c.method == "get_new_blocks" else args.get("block_ids"))]
            if log or c.method in checker.WITHOUT_NESTED:  # else no block changed hands (a decode
                checker.after(n, c.method, args, result, log)  # token in its last block, a lookup)
        return result, raised

    def _method(self, tc: TopCall) -> Callable[..., Any] | None:
        c = tc.call
        owner = self.pool.wire_blocks if c.target == "blocks" else self.pool
        if c.target == "blocks" and c.method not in VLLM_BLOCK_METHODS:
            return None
        fn = getattr(owner, c.method, None)
        if fn is not None:
            self._methods[c.method if c.target != "blocks" else ("blocks", c.method)] = fn
        return fn

    def _compare(self, tc: TopCall, result: Any, want: int | None, avail: int | None,
                 log: list[tuple[str, Any]]) -> None:
        """A call that returned, as its recording did: its result, free blocks and nested calls."""
        c, n = tc.call, tc.number
        recorded = c.result
        if not (recorded == result if type(recorded) is type(result) and type(result) is not torch.Tensor
                else same(plain(recorded), plain(result))):
            self._diverge(n, c.method, "result", c.result, result, "result differs from the recording")
            return
        if want is not None and want != avail:
            self._diverge(n, c.method, "counter", [want], [avail], "free blocks after the call differ")
        if c.target == "blocks" or not (tc.nested or log):
            return
        rec = [(x.method, plain(x.result if x.method == "get_new_blocks" else x.args.get("block_ids")))
               for x in tc.nested]
        got = [(m, plain(r)) for m, r in log]
        if rec != got:
            first = next((i for i, (a, b) in enumerate(zip(rec, got, strict=False)) if a != b), min(len(rec), len(got)))
            self._diverge(n, c.method, "nested", [f"blocks.{m} -> {r}" for m, r in rec[first:first + 3]],
                          [f"blocks.{m} -> {r}" for m, r in got[first:first + 3]],
                          "the build's block-pool calls differ from the recording")


class BlockRemap:
    """Remap mode's translation of recorded block ids into the build's own.

    The scheduler names blocks only where the manager handed them to it: a prefix hit
    (``get_computed_blocks``) that it passes back to ``allocate_slots``, and the blocks
    ``pop_blocks_for_free`` gave it, which it frees itself. So a call is issued with the
    build's answer to the request's last lookup, its hit tokens in place of the
    recorded ones (the new tokens grown or shrunk by the difference, so the request
    reaches the same length), and a scheduler's free with the ids the build popped.
    Other recorded ids go through what the build handed out in their place."""

    def __init__(self, block_size: int, fresh: bool = True) -> None:
        self.block_size = block_size
        self.hits: dict[str, tuple[Any, Any]] = {}  # request -> (recorded lookup, the build's)
        self.ids: dict[int, int] = {}  # recorded block id -> the build's, as handed out
        # The recorded ids the recording's pool ever handed out (since its cache was last
        # reset): only those can it have cached. None: a recording that started mid-life.
        self.handed_out: set[int] | None = set() if fresh else None

    def unstored_hit(self, tc: Any) -> str | None:
        """Remap issues the build's own lookups, so nothing else sees the recording's:
        a recorded prefix hit on a block the recording never handed out (so never
        filled, never cached) is its pool's fault, and remap would otherwise pass it."""
        c = tc.call
        if self.handed_out is None or c.method != "get_computed_blocks" or not isinstance(c.result, tuple):
            return None
        try:
            groups = groups_in(c.result[2:]) or []
        except (ValueError, TypeError):
            return None  # not the wire's form: the comparison and the checker say what is wrong
        for b in (b for g in groups for b in g):
            if b != NULL_BLOCK_ID and b not in self.handed_out:
                return (f"the recording's prefix hit names block {b}, which its pool never handed out: a hit on a "
                        "block that was never stored")
        return None

    def args(self, c: Any) -> dict[str, Any]:
        a = c.args
        if c.method == "allocate_slots" and a.get("new_computed_blocks") is not None:
            looked = self.hits.pop(a.get("request_id"), None)
            if looked is not None:
                return self._with_hit(a, *looked)
        ids = a.get("block_ids")
        if isinstance(ids, (tuple, list)):
            return {**a, "block_ids": type(ids)(self.ids.get(b, b) if type(b) is int else b for b in ids)}
        return a

    def _with_hit(self, a: dict[str, Any], recorded: Any, got: Any) -> dict[str, Any]:
        # the recorded values come from a trace: any that is not what the wire makes leaves
        # the call as recorded (strict comparison and the checker then say what is wrong)
        new, computed = a.get("num_new_tokens", 0), a.get("num_new_computed_tokens", 0)
        if not (isinstance(recorded, tuple) and isinstance(got, tuple) and len(got) >= 3 and recorded
                and all(type(v) is int for v in (recorded[0], got[0], new, computed))):
            return a
        rec_tokens, got_tokens = recorded[0], got[0]
        end = computed + new  # where the recorded call left the request
        blocks = got[2:]
        if got_tokens > end - 1 and got_tokens > 0:  # a longer hit than the call covers: keep what fits
            groups = groups_in(blocks) or []
            keep = max(end - 1, 0) // self.block_size
            groups = [g[:keep] for g in groups]
            blocks = groups_out(groups) if keep else EMPTY
            got_tokens = keep * self.block_size
        return {**a, "new_computed_blocks": blocks, "num_new_computed_tokens": got_tokens,
                "num_new_tokens": max(new + rec_tokens - got_tokens, 0) if rec_tokens != got_tokens else new}

    def learn(self, tc: Any, args: dict[str, Any], result: Any, log: list[tuple[str, Any]]) -> None:
        c = tc.call
        if c.method == "get_computed_blocks" and isinstance(args.get("request_id"), str):
            self.hits[args["request_id"]] = (c.result, result)
        elif (c.method in ("pop_blocks_for_free", "get_new_blocks") and isinstance(c.result, (tuple, list))
              and isinstance(result, (tuple, list))):
            self.ids.update(zip(c.result, result, strict=False))
        rec = [x.result for x in tc.nested if x.method == "get_new_blocks"]
        if c.target == "blocks" and c.method == "get_new_blocks":
            rec.insert(0, c.result)
        if self.handed_out is not None:
            if c.method == "reset_prefix_cache" and c.result is True:
                self.handed_out.clear()  # every cached block is forgotten: nothing before can hit
            for r_ids in rec:
                if isinstance(r_ids, (tuple, list)):
                    self.handed_out.update(b for b in r_ids if type(b) is int)
        got = [r for m, r in log if m == "get_new_blocks"]
        for r_ids, g_ids in zip(rec, got, strict=False):
            if isinstance(r_ids, (tuple, list)) and isinstance(g_ids, (tuple, list)):
                self.ids.update(zip(r_ids, g_ids, strict=False))


# results that compare with == alone (a tensor's == is elementwise)
_PLAIN = frozenset({tuple, int, bool, type(None), str, float})


