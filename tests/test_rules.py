"""A test per rule: for every rule of check/rules.py's table, the smallest call sequence
that trips it on a pool that breaks that rule (tests/rule_breakers.py: one overridden
method each), run through CheckedPool, which fails at the call that breaks the rule's
invariant. A rule whose check is removed from the checker fails its case here; a rule
added to the table without a case here fails the first test."""

from __future__ import annotations

import re

import pytest
import torch

from kvreplay.check.rules import RULES
from kvreplay.families.sglang.checked import CheckedPool

TOKEN = ("token", {"size": 16})
SWA1 = ("swa", {"size": 16, "size_swa": 16, "page_size": 1})
SWA4 = ("swa", {"size": 32, "size_swa": 32, "page_size": 4})


def _t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def alloc_free(p: CheckedPool) -> None:
    p.free(free_index=p.alloc(need_size=2))


def alloc(p: CheckedPool) -> None:
    p.alloc(need_size=2)


def alloc_twice(p: CheckedPool) -> None:
    p.alloc(need_size=2)
    p.alloc(need_size=2)


def free_unheld(p: CheckedPool) -> None:
    p.free(free_index=_t(5))


def alloc_free_many(p: CheckedPool) -> None:
    """More frees than 4 x the pool's 16 slots + 1024: past what any container may hold."""
    for _ in range(4 * 16 + 1024 + 1):
        alloc_free(p)


def then_finish(steps):  # the end-of-trace checks after ``steps``
    def run(p: CheckedPool) -> None:
        steps(p)
        p.finish()
    return run


def recycle_into_tail(p: CheckedPool) -> None:
    """Pages freed and handed out again by alloc_extend_swa_tail, their non-tail part
    still mapped to the SWA slots they had."""
    r = p.alloc_extend(prefix_lens=_t(0), prefix_lens_cpu=_t(0), seq_lens=_t(8), seq_lens_cpu=_t(8),
                       last_loc=_t(-1), extend_num_tokens=8)
    p.free(free_index=r)
    p.alloc_extend_swa_tail(prefix_lens=_t(0), prefix_lens_cpu=_t(0), seq_lens=_t(8), seq_lens_cpu=_t(8),
                            last_loc=_t(-1), extend_num_tokens=8, swa_tail_len=4)


# rule id -> (build, (family, constructor), calls)
CASES = {
    "capacity/available-out-of-bounds": ("py:rule_breakers:OverReportingTokenPool", TOKEN, alloc),
    "free-list/duplicate-free-page": ("py:rule_breakers:TwiceFreedTokenPool", TOKEN, alloc_free),
    "free-list/padding-page-free": ("py:rule_breakers:PaddingFreeingTokenPool", TOKEN, alloc_free),
    "free-list/page-out-of-range": ("py:rule_breakers:WildFreeListTokenPool", TOKEN, alloc_free),
    "ownership/handout-while-live": ("py:rule_breakers:KeepsHandedOutTokenPool", TOKEN, alloc_twice),
    "ownership/handout-out-of-range": ("py:rule_breakers:WildHandoutTokenPool", TOKEN, alloc),
    "ownership/free-not-live": ("builtin:token", TOKEN, free_unheld),
    "ownership/live-plus-available": ("py:rule_breakers:UnderReportingTokenPool", TOKEN, alloc),
    "ownership/live-page-free": ("py:rule_breakers:KeepsHandedOutTokenPool", TOKEN, alloc),
    "ownership/leaked-page": ("py:rule_breakers:DroppingFreeTokenPool", TOKEN, alloc_free),
    "none-unchanged/none-changed-state": ("py:rule_breakers:NoneButTakenTokenPool", TOKEN, alloc),
    "swa-mapping/released-page-keeps-peer": ("py:rule_breakers:KeepsPeerSWAPool", SWA1, alloc_free),
    "swa-mapping/tail-prealloc-nontail-mapped": ("py:rule_breakers:StaleTailSWAPool", SWA4, recycle_into_tail),
    "swa-mapping/shared-swa-slot": ("py:rule_breakers:SharedPeerSWAPool", SWA1, alloc),
    "swa-mapping/peer-not-live": ("py:rule_breakers:FreePeerSWAPool", SWA1, alloc),
    "swa-mapping/allocated-without-peer": ("py:rule_breakers:NoPeerSWAPool", SWA1, alloc),
    "swa-mapping/orphan-swa-slot": ("py:rule_breakers:OrphanSWAPool", SWA1, alloc_twice),
    "swa-mapping/sentinel-changed": ("py:rule_breakers:SentinelSWAPool", SWA1, alloc),
    "quiescence/leaked-page": ("py:rule_breakers:DroppingFreeTokenPool", TOKEN, then_finish(alloc_free)),
    "quiescence/orphan-swa-slot": ("py:rule_breakers:OrphanSWAPool", SWA1, then_finish(alloc_twice)),
    "growth/unbounded-container": ("py:rule_breakers:HoardingTokenPool", TOKEN, alloc_free_many),
}


def test_every_rule_in_the_table_has_a_case_and_no_case_names_another():
    from test_block_rules import CASES as BLOCK_CASES  # the vLLM family's rules

    from kvreplay.contract.registry import family

    # the mamba family's rules: tests/test_mamba.py makes each fire
    mamba = {line.split("|")[0].strip() for line in family("mamba").rules.strip().splitlines()}
    # the tree family's: tests/test_tree_family.py makes each fire (and checks that it does)
    tree = {line.split("|")[0].strip() for line in family("tree").rules.strip().splitlines()}
    assert not set(CASES) & set(BLOCK_CASES)
    assert set(CASES) | set(BLOCK_CASES) | mamba | tree == set(RULES)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_the_rule_fires_at_the_call_that_breaks_it(rule_id):
    build, (family, ctor), calls = CASES[rule_id]
    pool = CheckedPool(build, family=family, ctor=ctor, invariant=rule_id)
    with pytest.raises(AssertionError) as err:
        calls(pool)
    assert re.search(rf"\b{re.escape(rule_id)}\b", str(err.value)), str(err.value)


# A free of what was never held is the caller's fault, whatever the pool.
CALLERS_FAULT = sorted(r for r, (_b, _f, calls) in CASES.items() if calls is free_unheld)


@pytest.mark.parametrize("rule_id", sorted(set(CASES) - set(CALLERS_FAULT)))
def test_the_correct_pool_does_not_fire_it(rule_id):
    """The same calls on the builtin pool of the family break nothing: the case is the
    pool's fault, not the calls'."""
    _build, (family, ctor), calls = CASES[rule_id]
    pool = CheckedPool(f"builtin:{family}", family=family, ctor=ctor)
    calls(pool)
    pool.finish()  # the end-of-trace checks too
    # A checker that was never fed would find nothing as well.
    assert pool.calls > 0 and pool.checker.calls == pool.calls, (pool.calls, pool.checker.calls)
    assert [f"{v.invariant}/{v.rule} at call #{v.call} {v.method}: {v.message}" for v in pool.checker.log.kept] == []


@pytest.mark.parametrize("rule_id", CALLERS_FAULT)
def test_a_callers_fault_fires_on_the_correct_pool_too(rule_id):
    _build, (family, ctor), calls = CASES[rule_id]
    with pytest.raises(AssertionError, match=re.escape(rule_id)):
        calls(CheckedPool(f"builtin:{family}", family=family, ctor=ctor))


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_without_the_rules_check_its_case_fails(rule_id, monkeypatch):
    """The mutation check: with the rule's check removed (the checker drops that rule's
    findings), its case no longer trips, so the case above would fail."""
    from kvreplay.families.sglang.checker import InvariantChecker

    flag = InvariantChecker._flag
    dropped: list[int] = []

    def without(self, call, method, invariant, rule, *args, **kwargs):  # type: ignore[no-untyped-def]
        if f"{invariant}/{rule}" == rule_id:
            dropped.append(call)
        else:
            flag(self, call, method, invariant, rule, *args, **kwargs)

    monkeypatch.setattr(InvariantChecker, "_flag", without)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_the_rule_fires_at_the_call_that_breaks_it(rule_id)
    # A case that tripped no check at all would pass the line above too.
    assert dropped, f"{rule_id}: its check never fired on its case"
