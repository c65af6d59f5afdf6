"""A test per block-pool rule (vLLM's family): the fewest manager calls that trip it on
a manager breaking that rule by one method (tests/block_breakers.py), run through
CheckedManager, which fails at the call that breaks it; the same calls are clean on
builtin:vllm; and with the rule's check removed the case no longer trips."""

from __future__ import annotations

import re

import pytest

from kvreplay.families.vllm.block_wire import hashes_out
from kvreplay.families.vllm.checked import CheckedManager
from kvreplay.families.vllm.checker import BlockPoolChecker

CTOR = dict(num_blocks=8, block_size=4, hash_block_size=4, max_model_len=64, max_in_flight_tokens=64,
            enable_caching=True, watermark=0.0, attention="full")


def _request(rid: str, tokens: int, blocks: tuple[int, ...], computed: int = 0, hashes_from: int = 0) -> dict:
    t, n = hashes_out([bytes([b]) * 32 for b in blocks[hashes_from:]])
    return dict(request_id=rid, request_num_tokens=tokens, request_num_prompt_tokens=tokens,
                request_num_computed_tokens=computed, request_num_in_flight_tokens=0, request_num_preemptions=0,
                request_skip_reading_prefix_cache=False, request_shared_prefix_boundary=0,
                request_status="WAITING", request_hashes=t, request_hashes_from=hashes_from, request_hash_len=n)


def admit(m: CheckedManager, rid: str, tokens: int = 10, blocks: tuple[int, ...] = (1, 2)) -> None:
    """A new request: its prefix lookup, then its prompt's slots (as vLLM's scheduler does)."""
    hit = m.get_computed_blocks(**_request(rid, tokens, blocks))
    m.allocate_slots(**_request(rid, tokens, blocks, hashes_from=len(blocks)), num_new_tokens=tokens - hit[0],
                     num_new_computed_tokens=hit[0], new_computed_blocks=hit[2:])


def one(m: CheckedManager) -> None:
    admit(m, "a")


def one_and_free(m: CheckedManager) -> None:
    admit(m, "a")
    m.free_request(request_id="a")


def two(m: CheckedManager) -> None:
    admit(m, "a")
    admit(m, "b", blocks=(3, 4))


def shared_prefix(m: CheckedManager) -> None:
    admit(m, "a")
    admit(m, "b")  # its first block is a's


def decode_in_flight(m: CheckedManager) -> None:
    """A request decoding under asynchronous scheduling: each step is scheduled while the
    one before is in flight (one token in flight at every allocation)."""
    admit(m, "a", tokens=10, blocks=(1, 2))
    for computed in range(11, 17):
        req = _request("a", computed + 1, tuple(range(1, 1 + (computed + 1) // 4)), computed=computed)
        m.allocate_slots(**{**req, "request_num_in_flight_tokens": 1, "request_status": "RUNNING"}, num_new_tokens=1)


def then_finish(steps):
    def run(m: CheckedManager) -> None:
        steps(m)
        m.finish()
    return run


B = "py:block_breakers:"
# rule id -> (build, calls)
CASES = {
    "block-pool/negative-ref-count": (B + "DoubleFreeManager", one_and_free),
    "block-pool/ref-count-not-owners": (B + "DoubleTouchManager", shared_prefix),
    "block-pool/free-queue-mismatch": (B + "UnqueuedFreeManager", one_and_free),
    "block-pool/handout-while-held": (B + "StickyManager", two),
    "block-pool/free-queue-links": (B + "MiscountingManager", one_and_free),
    "block-pool/null-block-free": (B + "NullFreeingManager", one_and_free),
    "block-pool/null-block-ref-count": (B + "NullCountingManager", one_and_free),
    "block-pool/stale-cached-hash": (B + "ForgetfulManager", then_finish(lambda m: (one_and_free(m), admit(
        m, "b", blocks=(5, 6)), admit(m, "c", blocks=(7, 8))))),
    "quiescence/held-block": (B + "LeakyManager", then_finish(one_and_free)),
    "block-pool/window-freed-in-flight": (B + "EagerWindowManager", decode_in_flight),
    "block-pool/state-not-retired": (B + "UnretiredStateManager", decode_in_flight),
}


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_the_rule_fires_at_the_call_that_breaks_it(rule_id):
    build, calls = CASES[rule_id]
    with pytest.raises(AssertionError) as err:
        calls(CheckedManager(build, ctor=CTOR, invariant=rule_id))
    assert re.search(rf"\b{re.escape(rule_id)}\b", str(err.value)), str(err.value)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_the_correct_manager_does_not_fire_it(rule_id):
    _build, calls = CASES[rule_id]
    m = CheckedManager("builtin:vllm", ctor=CTOR)
    calls(m)
    m.finish()
    # A checker that was never fed would find nothing as well.
    assert m.checker.calls > 0, "no call of the case reached the checker"
    assert [f"{v.invariant}/{v.rule} at call #{v.call} {v.method}: {v.message}" for v in m.checker.log.kept] == []


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_without_the_rules_check_its_case_fails(rule_id, monkeypatch):
    """The mutation check: with the rule's check removed, its case no longer trips, so the
    case above fails."""
    flag = BlockPoolChecker._flag
    dropped: list[int] = []

    def without(self, call, method, rid, *args, **kwargs):  # type: ignore[no-untyped-def]
        if rid == rule_id:
            dropped.append(call)
        else:
            flag(self, call, method, rid, *args, **kwargs)

    monkeypatch.setattr(BlockPoolChecker, "_flag", without)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_the_rule_fires_at_the_call_that_breaks_it(rule_id)
    # A case that tripped no check at all would pass the line above too.
    assert dropped, f"{rule_id}: its check never fired on its case"


def test_a_prefix_hit_shares_blocks_and_the_hit_is_whole_blocks_short_of_the_last_token():
    m = CheckedManager("builtin:vllm", ctor=CTOR)
    admit(m, "a", tokens=9, blocks=(1, 2))
    hit = m.get_computed_blocks(**_request("b", 9, (1, 2)))
    a = m.pool.held_blocks("a")
    assert hit[:2] == (8, 0) and hit[2:] == (1, 2, *a[:2])  # a's two full blocks, in one group
    m.allocate_slots(**_request("b", 9, (1, 2), hashes_from=2), num_new_tokens=1, num_new_computed_tokens=8,
                     new_computed_blocks=hit[2:])
    assert [m.pool.pool.blocks[i].ref_cnt for i in a] == [2, 2, 1]
    m.free_request(request_id="a")
    m.free_request(request_id="b")
    assert m.finish() == {}


def test_a_window_let_go_on_the_processed_basis_keeps_what_the_step_in_flight_reads():
    """vLLM 0.26 on: the window's blocks go once no scheduled step reads them, and go all
    the same (the same calls on the optimistic basis fire at the step that lets one go early)."""
    m = CheckedManager(B + "WindowManager", ctor=CTOR)
    decode_in_flight(m)
    m.finish()
    # at 16 tokens computed, one in flight: the step at position 15 reads from 8, block 2 on
    assert m.pool.window_tables("a")[0][:3] == (-1, -1, m.pool.window_tables("a")[0][2]) != (-1, -1, -1)
    fired = r"window-freed-in-flight at call #\d+ allocate_slots.*a step in flight still reads"
    with pytest.raises(AssertionError, match=fired):
        decode_in_flight(CheckedManager(B + "EagerWindowManager", ctor=CTOR))


def test_a_mamba_group_keeps_only_the_state_its_next_step_reads():
    """A Mamba group retired on the processed tokens fires neither rule; retired on the
    count that includes the step in flight it lets go of the state that step reads; kept,
    its old states are flagged once each."""
    m = CheckedManager(B + "StateManager", ctor=CTOR)
    decode_in_flight(m)
    m.finish()
    # at 16 tokens computed, one in flight: the step at 15 reads 14's state, in block 3
    table = m.pool.window_tables("a")[0]
    assert table[:3] == (-1, -1, -1) and table[3] >= 0, table
    with pytest.raises(AssertionError, match=r"window-freed-in-flight at call #\d+ allocate_slots.*the Mamba group"):
        decode_in_flight(CheckedManager(B + "EagerStateManager", ctor=CTOR))
    kept = CheckedManager(B + "UnretiredStateManager", ctor=CTOR, invariant="block-pool/none")
    decode_in_flight(kept)
    fired = [v for v in kept.checker.log.kept if v.rule == "state-not-retired"]
    assert fired and len({b for v in fired for b in v.indices}) == sum(len(v.indices) for v in fired), fired


def test_a_manager_container_that_grows_with_the_requests_served_fires_growth():
    """growth/unbounded-container, on the vLLM family: a list the manager appends to per
    finished request passes 4 x its 8 blocks + 1024 entries and is flagged once, at the
    call that took it there; builtin:vllm serves as many requests and keeps nothing."""
    served = 4 * CTOR["num_blocks"] + 1024 + 1
    m = CheckedManager(B + "HoardingManager", ctor=CTOR, invariant="growth")
    with pytest.raises(AssertionError, match=r"growth/unbounded-container at call #\d+ free_request.*finished"):
        for i in range(served):
            one_and_free_as(m, f"r{i}")
    fine = CheckedManager("builtin:vllm", ctor=CTOR)
    for i in range(served):
        one_and_free_as(fine, f"r{i}")
    fine.finish()


def one_and_free_as(m: CheckedManager, rid: str) -> None:
    admit(m, rid)
    m.free_request(request_id=rid)
