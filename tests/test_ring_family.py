"""A family unlike sglang's goes through every command (issue 61): tests/ringfam, a ring of
tickets whose calls name ids of its own, whose counter read is ``left``, with its own
replayer, checker, profile figures and synth scenario. It enters kvreplay by its package
alone, named in KVREPLAY_FAMILIES: nothing under kvreplay/ knows it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import ringfam

from kvreplay.contract import registry
from kvreplay.contract.protocols import conformance

TESTS = Path(__file__).resolve().parent
PKG = TESTS.parent / "kvreplay"


@pytest.fixture
def ring(monkeypatch):
    """The ring family, registered here and named to every process kvreplay starts."""
    monkeypatch.setenv(registry.FAMILIES_ENV, "ringfam")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    registry.register(ringfam.RING)
    yield ringfam.RING
    registry.unregister("ring")


def _json(res):
    assert res.returncode in (0, 1), res.stdout + res.stderr
    return json.loads(res.stdout)


@pytest.fixture
def ring_trace(ring, tmp_path, cli):
    trace = tmp_path / "ring.parquet"
    res = cli("synth", "ring-churn", "-n", "200", "--full-size", "48", "-o", str(trace))
    assert res.returncode == 0, res.stderr
    return trace


def test_the_ring_meets_the_contract_and_nothing_in_kvreplay_names_it(ring):
    assert conformance(ring) == []
    named = [p for p in PKG.rglob("*.py") if "ringfam" in p.read_text() or '"ring"' in p.read_text()]
    assert named == []


def test_the_ring_is_read_replayed_and_checked(ring_trace, tmp_path, cli):
    info = _json(cli("inspect", str(ring_trace), "--json"))
    assert info["meta"]["family"] == "ring"
    prof = _json(cli("profile", str(ring_trace), "--json"))
    # its own figures: tickets per take and per give, its own counter read counted apart
    assert prof["family"] == "ring" and prof["counter_reads"] == 200
    assert prof["extend_tokens"]["n"] > 100 and 1 <= prof["extend_tokens"]["max"] <= 4
    assert prof["freed_per_free"]["n"] > 10
    assert set(prof["calls_by_method"]) == {"take", "give"}
    for mode in ("strict", "remap"):
        clean = _json(cli("replay", str(ring_trace), "-b", "builtin:ring", "--mode", mode, "--no-store", "--json"))
        assert clean["status"] == "clean" and clean["calls_replayed"] == prof["calls"], clean
        assert clean["held_at_end"] == {"ring": 0}
    bad = _json(cli("replay", str(ring_trace), "-b", "builtin:ring@give-twice", "--mode", "remap", "--no-store",
                    "--json"))
    assert bad["first_violation"]["invariant"] == "ring-owner"
    assert bad["first_violation"]["rule"] == "handed-twice"
    strict = _json(cli("replay", str(ring_trace), "-b", "builtin:ring@give-twice", "--no-store", "--json"))
    assert strict["divergence_counts"].get("counter", 0) > 0  # the doubled queue shows in `left`


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_the_ring_goes_through_every_job(ring_trace, tmp_path, cli):
    db = f"sqlite:///{tmp_path / 'k.db'}"
    diff = cli("diff", str(ring_trace), "--base", "builtin:ring", "--candidate", "builtin:ring@give-twice", "--json")
    assert diff.returncode == 1 and json.loads(diff.stdout)["differing_calls"] > 0, diff.stdout + diff.stderr

    small = tmp_path / "small.parquet"
    mini = _json(cli("minimize", str(ring_trace), "--build", "builtin:ring@give-twice", "-o", str(small), "--json"))
    assert mini["calls_after"] < mini["calls_before"]
    again = _json(cli("replay", str(small), "-b", "builtin:ring@give-twice", "--no-store", "--json"))
    assert again["status"] in ("violation", "divergence"), again

    matrix = cli("matrix", str(ring_trace), "--builds", "builtin:ring,builtin:ring@give-twice", "--mode", "remap",
                 "--db", db, "--json")
    assert matrix.returncode == 1 and "ring-owner" in matrix.stdout, matrix.stdout + matrix.stderr

    found = _json(cli("bisect", str(ring_trace), "--builds", "builtin:ring,builtin:ring,builtin:ring@give-twice",
                      "--mode", "remap", "--db", db, "--json"))
    assert found["first_bad"]["spec"] == "builtin:ring@give-twice" and found["target"]["id"] == "ring-owner"

    stored = _json(cli("replay", str(ring_trace), "-b", "builtin:ring@give-twice", "--mode", "remap", "--db", db,
                       "--json"))
    page = tmp_path / "r.html"
    assert cli("report", str(stored["run_id"]), "--db", db, "-o", str(page)).returncode == 0
    assert "handed-twice" in page.read_text()

    corpus = tmp_path / "corpus"
    added = cli("corpus", "add", str(ring_trace), "--name", "ring", "--corpus", str(corpus),
                "-b", "builtin:ring", "-b", "builtin:ring@give-twice")
    assert added.returncode == 0, added.stdout + added.stderr
    assert cli("corpus", "check", str(corpus)).returncode == 0
    for build, code in (("builtin:ring", 0), ("builtin:ring@give-twice", 0)):  # each shows what it must
        res = cli("ci", str(corpus), "--build", build, "--db", db)
        assert res.returncode == code, res.stdout + res.stderr


PROG = """
from ringfam.pool import TicketRing
r = TicketRing(16)
held = [r.take(3) for _ in range(4)]
r.left()
r.give(held[1]); r.give(held[3])
r.left(); r.left()
r.take(5)
"""


@pytest.mark.slow  # (a recorded program: a writer process per run)
def test_a_recorded_and_watched_ring_program_replays(ring, tmp_path, cli):
    out = tmp_path / "rec"
    res = cli("record", "-o", str(out), "--part-s", "0", "--part-rows", "0", "--watch", "--",
              sys.executable, "-c", PROG)
    assert res.returncode == 0, res.stdout + res.stderr
    traces = sorted(out.glob("kvreplay-*.parquet"))
    assert len(traces) == 1, list(out.iterdir())
    res = _json(cli("replay", str(traces[0]), "--build", "builtin:ring", "--no-store", "--json"))
    assert res["status"] == "clean" and res["calls_replayed"] == 10, res
    # the repeated `left` read folded into the row before it, and read back as its calls
    import pyarrow.parquet as pq

    assert pq.read_metadata(traces[0]).num_rows < 10


def test_the_public_replayer_and_replay_take_any_family(ring_trace):
    import kvreplay

    r = kvreplay.Replayer(ring_trace, "builtin:ring@give-twice", mode="remap")
    assert isinstance(r, kvreplay.Replayer) and type(r).__name__ == "RingReplayer"
    assert r.run().first_violation.invariant == "ring-owner"
    assert kvreplay.replay(ring_trace, "builtin:ring", mode="remap").status == "clean"
    with pytest.raises(TypeError):
        kvreplay.replay(ring_trace, "builtin:ring", segment=None)  # the options are typed: no stray keywords


def test_the_ring_scenario_takes_an_option_of_its_own(ring, tmp_path, cli):
    """A scenario's own option (--set NAME=VALUE) reaches its model typed; the shared
    configuration has no field for it."""
    gives = {}
    for chance in ("0", "1"):
        trace = tmp_path / f"ring-{chance}.parquet"
        res = cli("synth", "ring-churn", "-n", "100", "--full-size", "48", "--set", f"give_chance={chance}",
                  "-o", str(trace))
        assert res.returncode == 0, res.stderr
        gives[chance] = _json(cli("profile", str(trace), "--json"))["calls_by_method"].get("give", 0)
    assert gives["1"] > gives["0"] + 20, gives
    for bad, said in (("give_chance=2", "give_chance must be in 0.0..1.0"), ("give_chance=often", "takes a number"),
                      ("window=3", "has no option of that name (its own: give_chance)"), ("give_chance", "NAME=VALUE")):
        res = cli("synth", "ring-churn", "-n", "10", "--set", bad, "-o", str(tmp_path / "x.parquet"))
        assert res.returncode == 2 and said in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert not (tmp_path / "x.parquet").exists()
