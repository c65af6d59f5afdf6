"""The mamba family: sglang's hybrid request pool with its state slots, recorded through
its wire, replayed on kvreplay's pool and its bug variant, held to the state-pool rules
(each rule made to fire by a pool or a scheduler that breaks it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvreplay.builds.resolve import load_build
from kvreplay.contract.registry import family
from kvreplay.families.mamba.checker import StatePoolChecker
from kvreplay.families.mamba.pool import HybridStatePool, StateSlots
from kvreplay.replay.dispatch import replay
from kvreplay.trace.format import check_ctor_args
from kvreplay.workload.synth import SynthConfig, synthesize

CORPUS = Path(__file__).resolve().parents[1] / "traces"
STALE = CORPUS / "sglang-0.5.12-mamba-stale-ping-pong.parquet"
CTOR = {"size": 8, "mamba_size": 16, "extra_buffer": True, "ping_pong": 2, "max_context_len": 64}


class Driven:
    """A build behind its wire, driven by hand under the checker (every call fully checked)."""

    def __init__(self, pool_class: type | None = None, build: str = "builtin:mamba") -> None:
        self.wire = load_build(build, "mamba", CTOR, "cpu")
        if pool_class is not None:  # a breaker: the same wire over another pool
            from kvreplay.families.mamba.wire import StateWire

            self.wire = StateWire(pool_class(**CTOR), dict(CTOR))
        self.checker = StatePoolChecker(self.wire, full_check_every=1, keep=100)
        self.n = 0

    def __call__(self, method: str, target: str = "root", **args: Any) -> Any:
        self.n += 1
        log: list[tuple[str, Any]] = []
        self.wire.wire_state.log = log
        owner = self.wire.wire_state if target == "state" else self.wire
        result = getattr(owner, method)(**args)
        self.wire.wire_state.log = None
        reqs = tuple(args["requests"]) if method == "alloc_reqs" else (
            (args["request"],) if "request" in args else ())
        self.checker.after(self.n, method, args, result, log, reqs)
        return result

    def rules(self) -> set[str]:
        return {f"{v.invariant}/{v.rule}" for v in self.checker.log.kept}


def _finish(d: Driven) -> set[str]:
    d.checker.finish(d.n)
    return d.rules()


# -- the pool and the corpus --------------------------------------------------------------------
def test_a_synth_hybrid_trace_replays_clean_on_the_builtin_pool_in_both_modes(tmp_path):
    out = tmp_path / "h.parquet"
    res = synthesize(SynthConfig(scenario="hybrid-mamba", out=out, requests=120, state_slots=24, max_running=6,
                                 full_size=600, batch_tokens=256, seed=3))
    assert res.requests_done == 120 and res.retractions > 0 and res.evictions > 0, res
    assert res.extra["donations"] > 0 and res.extra["aborts"] > 0, res.extra
    for mode in ("strict", "remap"):
        r = replay(out, "builtin:mamba", mode=mode, device="cpu")
        assert r.status == "clean", (mode, r.first_violation, r.first_divergence)


def test_the_stale_tracking_pair_is_caught_at_the_retracted_requests_return():
    good = replay(STALE, "builtin:mamba", device="cpu")
    assert good.status == "clean", (good.first_violation, good.first_divergence)
    bad = replay(STALE, "builtin:mamba@stale-ping-pong", mode="remap", device="cpu")
    first = bad.first_violation
    assert (first.invariant, first.rule, first.method, first.call) == ("state-pool", "request-holds-free-slot",
                                                                        "alloc_reqs", 3025), first
    # what follows from it: the free slots are handed to others and freed twice
    assert {"state-pool/slot-shared", "state-pool/double-free"} <= set(bad.violation_counts), bad.violation_counts


def test_the_wire_keeps_what_the_pool_wrote_to_a_request():
    d = Driven()
    rows = d("alloc_reqs", requests=(1, 2))
    assert rows == (7, 8)  # the free list's last two, as sglang 0.5.23 takes them
    r1 = d.wire.request(1).slots()
    assert r1 == (7, 1, (2, 3)), r1  # a state slot and a pair, from the head
    d("free_mamba_cache", request=1, keep=1)  # the pair's entry 1 kept for the cache
    assert d.wire.request(1).slots() == (7, None, ()), d.wire.request(1).slots()
    assert 3 not in d.wire.free_slots() and 2 in d.wire.free_slots()
    d("free_req", request=1)
    d("free", target="state", free_index=(3,))  # the cache evicts the kept state
    d("free_mamba_cache", request=2, keep=None)
    d("free_req", request=2)
    assert _finish(d) == set(), d.rules()
    assert d.wire.available_size() == 16


# -- each rule, made to fire ---------------------------------------------------------------------
class _TwiceSlots(StateSlots):
    """Hands the slot it handed out last out again."""

    last = None

    def alloc(self, need_size: int) -> Any:
        if self.last is not None and need_size == 1:
            return self.last
        got = super().alloc(need_size)
        if got is not None and need_size == 1:
            self.last = got
        return got


class _TwicePool(HybridStatePool):
    slots_class = _TwiceSlots


class _DropSlots(StateSlots):
    """Loses every slot freed."""

    def free(self, free_index: Any) -> None:
        pass


class _DropPool(HybridStatePool):
    slots_class = _DropSlots


class _DoubleListSlots(StateSlots):
    """Puts every freed slot on the free list twice."""

    def free(self, free_index: Any) -> None:
        super().free(free_index)
        super().free(free_index)


class _DoubleListPool(HybridStatePool):
    slots_class = _DoubleListSlots


def test_handout_while_held():
    d = Driven(_TwicePool)
    d("alloc", target="state", need_size=1)
    d("alloc", target="state", need_size=1)
    assert "state-pool/handout-while-held" in d.rules()


def test_double_free():
    d = Driven()
    slot = d("alloc", target="state", need_size=1)
    d("free", target="state", free_index=slot)
    d("free", target="state", free_index=slot)
    assert "state-pool/double-free" in d.rules()


def test_request_holds_free_slot_and_slot_shared_from_the_stale_pair():
    d = Driven(build="builtin:mamba@stale-ping-pong")
    d("alloc_reqs", requests=(1,))
    d("free_mamba_cache", request=1, keep=None)  # retracted: everything given back...
    d("free_req", request=1)
    assert d.rules() == set()  # a request between lives may name what it gave back
    d("alloc_reqs", requests=(2,))  # ...and handed to the next request
    d("alloc_reqs", requests=(1,))  # back, with its old pair
    assert {"state-pool/request-holds-free-slot"} <= d.rules(), d.rules()
    d2 = Driven()
    d2("alloc_reqs", requests=(1, 2))
    held = d2.wire.request(1).slots()[1]
    d2("set_request", request=2, state=held)  # a hit's copy that is another request's state
    assert "state-pool/slot-shared" in d2.rules()


def test_free_list_and_conservation():
    d = Driven(_DoubleListPool)
    slot = d("alloc", target="state", need_size=1)
    d("free", target="state", free_index=slot)
    assert "state-pool/free-list" in d.rules()
    d = Driven(_DropPool)
    slot = d("alloc", target="state", need_size=1)
    d("free", target="state", free_index=slot)
    assert "state-pool/conservation" in d.rules()


def test_quiescence_orphans_and_state_left_on_an_ended_request():
    d = Driven()
    d("alloc", target="state", need_size=1)  # a prefix hit's copy never handed to a request
    assert "quiescence/orphan-state-slot" in _finish(d)
    d = Driven()
    d("alloc_reqs", requests=(1,))
    d("free_req", request=1)  # the row goes, the state does not (sglang #23496's session path)
    assert "quiescence/ended-request-state" in _finish(d)


class _HoardPool(HybridStatePool):
    """Keeps every request that gave its row back, in a list nobody drains."""

    def free(self, req: Any) -> None:
        super().free(req)
        self.__dict__.setdefault("ended", []).append(req)


def test_a_container_that_grows_with_the_requests_served_fires_growth():
    """growth/unbounded-container on the mamba family: past 4 x (8 rows + 16 slots) + 1024
    entries, flagged once; builtin:mamba serves as many requests and keeps nothing."""
    for pool, fires in ((_HoardPool, True), (None, False)):
        d = Driven(pool)
        for n in range(4 * 24 + 1024 + 1):
            d("alloc_reqs", requests=(n,))
            d("free_mamba_cache", request=n, keep=None)
            d("free_req", request=n)
        fired = [v for v in d.checker.log.kept if f"{v.invariant}/{v.rule}" == "growth/unbounded-container"]
        assert len(fired) == fires, fired
        assert not fires or "ended holds" in fired[0].message, fired


def test_every_rule_of_the_family_is_made_to_fire_here():
    named = set(Path(__file__).read_text().split('"')[1::2])
    rules = {line.split("|")[0].strip() for line in family("mamba").rules.strip().splitlines()}
    assert rules <= named, rules - named


# -- hostile input -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, word", [({"ping_pong": 3}, "ping_pong"), ({"extra_buffer": "yes"}, "extra_buffer"),
                                       ({"mamba_size": 0}, "mamba_size"), ({"size": -1}, "size")])
def test_a_traces_constructor_arguments_are_checked(bad, word):
    with pytest.raises(ValueError, match=word):
        check_ctor_args("mamba", {**CTOR, **bad})


def test_synth_options_are_checked_in_one_line(cli, tmp_path):
    r = cli("synth", "hybrid-mamba", "-o", str(tmp_path / "x.parquet"), "--state-slots", "2")
    assert r.returncode == 2 and "--state-slots" in (r.stdout + r.stderr) and "Traceback" not in (r.stdout + r.stderr)
    r = cli("synth", "decode", "-o", str(tmp_path / "y.parquet"), "--aborts", "0.5")
    assert r.returncode == 2 and "hybrid-mamba" in (r.stdout + r.stderr)
    assert not list(tmp_path.iterdir())


def test_builds_lists_the_family_with_its_variant(cli):
    r = cli("builds", "--json")
    assert r.returncode == 0, (r.stdout + r.stderr)
    names = json.dumps(json.loads(r.stdout))
    assert "builtin:mamba" in names and "builtin:mamba@stale-ping-pong" in names


# -- the live face: a server's requests recorded through the wire ------------------------------
def test_a_running_servers_pool_is_recorded_and_replays_strict_clean(tmp_path):
    """A scheduler as sglang 0.5.23's runs a pool without the extra buffer: groups of
    admissions, a prefix hit's copied state put on the request by the cache, the cache's
    own copies of running states, a finished request's state kept in place, an eviction,
    and a retracted request allocated anew. Its trace replays clean, and every change the
    server made to a request outside the pool is said once, before the call that reads it."""
    from kvreplay.families.mamba.live import LiveStateWire
    from kvreplay.families.mamba.wire import WireRequest
    from kvreplay.recorder.recording import record
    from kvreplay.trace.reader import TraceReader

    ctor = {"size": 4, "mamba_size": 8, "extra_buffer": False, "ping_pong": 1, "max_context_len": 64}
    pool = HybridStatePool(**ctor)
    wire = LiveStateWire(pool)
    slots = pool.mamba_allocator
    out = tmp_path / "live.parquet"
    reqs = [WireRequest(1000 + i) for i in range(4)]  # the server's objects (their own numbering)
    with record(wire, out, flush_s=0):
        slots.alloc_group_begin(2)
        assert pool.alloc(reqs[:2]) is not None
        slots.alloc_group_end()
        tree = [slots.alloc(1)]  # the cache copies a running request's state
        reqs[0].kv_allocated_len = 40
        pool.free(reqs[0])  # finished: the cache keeps its state slot in place
        tree.append(reqs[0].mamba_pool_idx.reshape(1))
        hit = slots.alloc(1)  # a prefix hit: the cached state copied for a new request
        reqs[2].mamba_pool_idx = hit[0]
        assert pool.alloc([reqs[2]]) is not None
        slots.free(tree.pop(0))  # an eviction
        reqs[1].kv_allocated_len = 12
        pool.free_mamba_cache(reqs[1])  # retracted: state and row given back
        pool.free(reqs[1])
        reqs[1].kv_allocated_len = 0
        assert pool.alloc([reqs[1]]) is not None  # back, with a fresh state slot
    assert wire._known.keys() == {2, 3}  # requests that gave their row back are forgotten
    rows = [tc.call for tc in TraceReader(out).top_calls(device="cpu", nested_args=True)]
    said = [(c.args["request"], {k: v for k, v in c.args.items() if k != "request" and v is not None})
            for c in rows if c.method == "set_request"]
    # the KV length only where the pool reads it (alloc); a request back after its row went: said whole
    assert said == [(3, {"state": int(hit[0])}), (2, {"state": -1, "track": (), "kv_len": 0})]
    for build in ("builtin:mamba", "builtin:mamba@stale-ping-pong"):
        r = replay(out, build, mode="strict", device="cpu")
        assert r.status == "clean", (build, r.first_divergence, r.first_violation)
