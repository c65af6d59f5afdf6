"""Every family meets the written contract (kvreplay/contract/protocols.py,
docs/families.md): each registered family and the toy family of the tests, by its
record (``conformance``) and by a replayer made on a trace of it
(``replay_conformance``); and the check can fail, with the breach named."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import toyfam

from kvreplay.contract import protocols, registry
from kvreplay.contract.protocols import (
    Checker,
    Replayer,
    ScenarioServer,
    conformance,
    engine_conformance,
    members,
    replay_conformance,
)
from kvreplay.contract.record import load

FAKES = "kvreplay_contract_fakes"  # a module the breach tests name their parts in


def _families():
    return [*registry.families(), toyfam.TOY]


@pytest.mark.parametrize("name", [*registry.family_names(), toyfam.TOY.name])
def test_every_family_meets_the_contract(name):
    fam = toyfam.TOY if name == toyfam.TOY.name else registry.family(name)
    assert conformance(fam) == []


@pytest.mark.parametrize("name", [e.name for e in registry.engines()])
def test_every_engine_meets_the_contract(name):
    assert engine_conformance(registry.engine(name)) == []


def test_scenario_names_are_unique_across_families():
    names = [s.name for f in _families() for s in f.scenarios]
    assert len(names) == len(set(names))


def test_the_contract_knows_what_the_shared_code_knows():
    from kvreplay.check import family_checks, rules
    from kvreplay.replay import loop

    assert protocols.SEVERITIES == rules.SEVERITIES
    # the run loop gives every method the Replayer protocol asks of a class
    assert [m for m in members(Replayer) if callable(getattr(Replayer, m, None))
            and not callable(getattr(loop.ReplayLoop, m, None))] == []
    # the base class of a family's checks has every method the shared checker calls
    assert [m for m in members(protocols.FamilyChecks) if not hasattr(family_checks.FamilyChecks, m)] == []
    assert isinstance(rules.ViolationLog(), protocols.FindingLog)


def test_the_contract_module_reads_without_torch():
    import subprocess

    prog = ("import sys, kvreplay.contract.protocols, kvreplay.contract.record; "
            "print(sorted(m for m in ('torch', 'kvreplay.replay.loop') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_scenario_options_are_synth_options():
    from kvreplay.workload.synth import SynthConfig

    fields = {f.name for f in dataclasses.fields(SynthConfig)}
    assert [f"{s.name}: {o}" for f in _families() for s in f.scenarios for o in sorted(s.options)
            if o not in fields] == []


@pytest.mark.parametrize("fam", [f for f in registry.families() if f.wire], ids=lambda f: f.name)
def test_a_live_face_passes_objects_not_its_own(fam):
    # a recorder asks every family's live face of every object it records
    assert load(fam.wire)(object()) is None


def _scenarios():
    return [(f, s) for f in _families() for s in f.scenarios]


@pytest.fixture
def toy_registered():
    registry.register(toyfam.TOY)
    yield
    registry.unregister(toyfam.TOY.name)


@pytest.mark.parametrize("fam,sc", _scenarios(), ids=[s.name for _, s in _scenarios()])
def test_a_replayer_made_on_a_trace_meets_the_contract(fam, sc, tmp_path, toy_registered):
    from kvreplay.replay.replayers import make_replayer
    from kvreplay.workload.requests import load_requests
    from kvreplay.workload.synth import SynthConfig, make_pool, synthesize

    own = {"state_slots": 16} if "state_slots" in sc.options else {}  # a scenario's own options only
    cfg = SynthConfig(scenario=sc.name, out=tmp_path / f"{sc.name}.parquet", requests=6, **own)
    pool, _ = make_pool(cfg, sc)
    reqs = load_requests(None, count=2, seed=0, block_tokens=cfg.block_tokens)
    assert isinstance(load(sc.server)(pool, reqs, cfg, None), ScenarioServer)

    synthesize(cfg)
    r = make_replayer(cfg.out, fam.default_build)
    assert isinstance(r, Replayer) and isinstance(r.checker, Checker)
    assert replay_conformance(fam, r) == []
    report = r.run()
    assert type(report).__name__ == "ReplayReport" and report.status == "clean", report.message


# -- the check can fail ---------------------------------------------------------------------------
class _NoRun:
    """A replayer with everything but run."""

    nested_args = False
    replays_segments = False

    def __init__(self, trace, build, **options):
        pass

    def step(self, tc): ...

    def calls_to_replay(self): ...

    def first_row(self): ...

    def ends_at(self, c, row): ...

    def found_something(self): ...

    def report(self, wall, held, stopped): ...


class _FewOptions(_NoRun):
    def __init__(self, trace, build, *, reader=None, mode="strict"):
        pass

    def run(self, progress=None, calls=None): ...


def _two_param_checks(view, shadows):
    """A checks hook that forgot the flag."""


@pytest.fixture
def fakes(monkeypatch):
    mod = types.ModuleType(FAKES)
    mod.NoRun, mod.FewOptions, mod.checks = _NoRun, _FewOptions, _two_param_checks
    mod.not_callable = 3
    mod.see_one = lambda figures: None
    monkeypatch.setitem(sys.modules, FAKES, mod)
    return mod


def test_a_replayer_without_run_is_a_breach(fakes):
    fam = dataclasses.replace(toyfam.TOY, replayer=f"{FAKES}:NoRun")
    assert conformance(fam) == [
        f"toy: replayer: {FAKES}:NoRun has no run (a replayer subclasses kvreplay.replay.loop.ReplayLoop, "
        "whose run() gives the ReplayReport)"]


def test_a_replayer_that_takes_too_few_options_is_a_breach(fakes):
    fam = dataclasses.replace(toyfam.TOY, replayer=f"{FAKES}:FewOptions")
    (line,) = conformance(fam)
    assert line.startswith(f"toy: replayer: {FAKES}:FewOptions takes (trace, build, reader, mode); it is made as "
                           "(trace, build, *, reader, mode, device, ")


def test_a_checks_hook_with_the_wrong_parameters_is_a_breach(fakes):
    fam = dataclasses.replace(toyfam.TOY, checks=f"{FAKES}:checks")
    assert conformance(fam) == [
        f"toy: checks: {FAKES}:checks takes (view, shadows); it is called as checks(view, shadows, flag)"]


def test_a_profile_hook_with_the_wrong_parameters_is_a_breach(fakes):
    if "profile" not in {f.name for f in dataclasses.fields(toyfam.TOY)}:
        pytest.skip("the record has no profile hook")
    fam = dataclasses.replace(toyfam.TOY, profile=f"{FAKES}:see_one")
    assert conformance(fam) == [
        f"toy: profile: {FAKES}:see_one takes (figures); it is called as profile(figures, call)"]


def test_mismatched_sub_counters_are_a_breach():
    fam = dataclasses.replace(toyfam.TOY, sub_counters=("available", "swa_available"))
    assert conformance(fam) == [
        "toy: sub_counters: 2 counter column(s) for 1 sub-pool(s) (pool): one each, in order"]


def test_more_breaches_each_named(fakes):
    fam = dataclasses.replace(
        toyfam.TOY, builtins=(), sub_counters=("tokens_left",), construct=f"{FAKES}:not_callable",
        wire="no_such_module_here:wire_for", sizes=("size", "pages"),
        scenarios=(*toyfam.TOY.scenarios, toyfam.TOY.scenarios[0]))
    assert sorted(conformance(fam)) == sorted([
        "toy: sizes: pages not among its ctor_args",
        "toy: sub_counters: tokens_left not among its trace schema's counter columns "
        "(available, full_available, swa_available)",
        "toy: builtins: empty: the first is the correct pool a trace replays clean on",
        f"toy: construct: {FAKES}:not_callable is a int, not callable",
        "toy: wire: no_such_module_here:wire_for does not load (ModuleNotFoundError: No module named "
        "'no_such_module_here')",
        "toy: scenarios: names toy-churn more than once",
    ])


def test_a_built_pool_the_record_disowns_is_a_breach(tmp_path, toy_registered):
    from kvreplay.replay.replayers import make_replayer
    from kvreplay.workload.synth import SynthConfig, synthesize

    cfg = SynthConfig(scenario="toy-churn", out=tmp_path / "toy.parquet", requests=6, full_size=64)
    synthesize(cfg)
    r = make_replayer(cfg.out, "builtin:toy")
    fam = dataclasses.replace(toyfam.TOY, detect=lambda pool: False, sizes_of=lambda ctor: {"tokens": 1},
                              sub_allocators=(("pool", "toy_allocator"),))
    assert replay_conformance(fam, r) == [
        "toy: detect: says a StackPool its construct built is not of the family",
        "toy: sizes_of: gives tokens, not the sub_pools pool",
        "toy: sub_allocators: a StackPool has no toy_allocator",
    ]
    r.checker = object()
    assert replay_conformance(toyfam.TOY, r)[0].startswith("toy: checker: a object has no log, finish, log.keep")


def test_a_scenario_option_whose_default_is_out_of_its_bounds_is_a_breach():
    import dataclasses

    import ringfam

    from kvreplay.contract.protocols import conformance
    from kvreplay.contract.record import Param

    sc = dataclasses.replace(ringfam.RING.scenarios[0], params=(Param("give_chance", 2.0, "x", 0.0, 1.0),
                                                                Param("give chance", 1, "y")))
    breaches = conformance(dataclasses.replace(ringfam.RING, scenarios=(sc,)))
    assert any("give_chance's default does not take" in b for b in breaches), breaches
    assert any("'give chance' is not a name" in b for b in breaches), breaches
