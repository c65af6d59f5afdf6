"""One rule for when a stored run may stand in for a replay (store/runs.py,
``reusable_run``): bisect and matrix reuse exactly the same runs."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from kvreplay.builds.spec import BuildSpec
from kvreplay.jobs.bisect import Prober
from kvreplay.jobs.matrix import run_matrix
from kvreplay.jobs.stored_replay import replay_and_store
from kvreplay.store.db import open_store
from kvreplay.store.models import Run
from kvreplay.store.runs import REUSABLE, reusable_run
from kvreplay.trace.hashing import content_hash

SPECS = ["builtin:swa", "builtin:swa@stale-tail", "builtin:swa@page-partial-clear",
         "builtin:swa@deferred-lookup", "builtin:swa@unfiltered-page0"]


@pytest.mark.slow
def test_bisect_and_matrix_reuse_exactly_the_same_runs(swa_trace_80, tmp_path):
    db = str(tmp_path / "k.db")
    runs = {spec: replay_and_store(swa_trace_80, spec, db=db).run_id for spec in SPECS}
    st = open_store(db)
    with st.session() as s, s.begin():
        # a run of another kvreplay, a run whose build did not load here, a crashed one
        s.execute(update(Run).where(Run.id == runs["builtin:swa@page-partial-clear"]).values(kvreplay_version="0.0.1"))
        s.execute(update(Run).where(Run.id == runs["builtin:swa@deferred-lookup"]).values(status="unloadable"))
        s.execute(update(Run).where(Run.id == runs["builtin:swa@unfiltered-page0"]).values(status="crashed"))
    digest = content_hash(swa_trace_80)
    by_rule = {spec for spec in SPECS if reusable_run(st, digest, BuildSpec.parse(spec), "strict") is not None}
    st.close()
    assert by_rule == {"builtin:swa", "builtin:swa@stale-tail"}
    prober = Prober(swa_trace_80, db=db, mode="strict", device="cpu", timeout_s=60)
    by_bisect = {spec for spec in SPECS if prober.cached(spec) is not None}
    res = run_matrix([str(swa_trace_80)], SPECS, db=db, mode="strict", device="cpu", jobs=1)
    by_matrix = {c.build for c in res.cells if c.cached}
    assert by_bisect == by_matrix == by_rule


def test_only_statuses_that_follow_from_code_and_trace_are_reused():
    assert REUSABLE == {"clean", "violation", "divergence", "unsupported"}


def test_a_spec_that_does_not_pin_its_code_is_never_reused(swa_trace_80, tmp_path):
    db = str(tmp_path / "k.db")
    replay_and_store(swa_trace_80, "py:kvreplay.families.sglang.swa:SWAPool", db=db)
    st = open_store(db)
    try:
        assert reusable_run(st, content_hash(swa_trace_80), BuildSpec.parse("py:kvreplay.families.sglang.swa:SWAPool"),
                            "strict") is None
    finally:
        st.close()


def test_what_a_build_resolved_to_has_one_answer():
    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.version import __version__

    assert BuildSpec.parse("builtin:swa@stale-tail").resolved() == f"kvreplay {__version__}"
    assert BuildSpec.parse("sglang==0.5.12").resolved(code_id="0.5.12") == "sglang 0.5.12"
    assert BuildSpec.parse("git:/repo@" + "a" * 40).resolved(code_id="a" * 12) == "git " + "a" * 12
    pool = SWAPool(64, 32, 4)
    assert BuildSpec.parse("py:kvreplay.families.sglang.swa:SWAPool").resolved(pool=pool) == f"kvreplay {__version__}"
