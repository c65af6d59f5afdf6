"""The results store: migrations, atomic runs, concurrent writers, bad databases, CLI."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest
from conftest import run_in_process
from sqlalchemy import func, select

from kvreplay.errors import BadInput
from kvreplay.jobs.stored_replay import replay_and_store
from kvreplay.store.db import open_store, tables
from kvreplay.store.models import Run, ViolationRow
from kvreplay.store.runs import list_runs
from kvreplay.workload.synth import SynthConfig, synthesize


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("t") / "disagg.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=out, requests=150))
    return out


def run_cli(capsys, *argv):
    res = run_in_process(capsys, *argv)
    return res.returncode, res.stdout, res.stderr


def counts(db):
    st = open_store(db)
    with st.session() as s:
        n = s.scalar(select(func.count()).select_from(Run)), s.scalar(select(func.count()).select_from(ViolationRow))
    st.close()
    return n


def test_opening_creates_the_schema_through_alembic(db_url):
    st = open_store(db_url)
    assert {"alembic_version", "traces", "builds", "runs", "violations", "divergences"} <= set(tables(st.engine))
    with st.engine.connect() as c:
        assert c.exec_driver_sql("select version_num from alembic_version").scalar() == "0007"
    assert st.engine.dialect.name == ("postgresql" if "://" in db_url else "sqlite")
    st.close()
    if "://" not in db_url:
        with sqlite3.connect(db_url) as con:
            assert con.execute("pragma journal_mode").fetchone()[0] == "wal"


def test_a_run_is_stored_whole(db_url, trace, capsys):
    db = db_url
    code, out, _ = run_cli(capsys, "replay", str(trace), "--build", "builtin:swa@stale-tail", "--db", db, "--json")
    rep = json.loads(out)
    assert code == 1 and rep["status"] == "violation" and rep["run_id"] == 1
    code, out, _ = run_cli(capsys, "show", "1", "--db", db, "--json")
    shown = json.loads(out)
    assert shown["build"] == "builtin:swa@stale-tail" and shown["status"] == "violation"
    assert shown["trace_calls"] == rep["calls_replayed"] > 0
    assert shown["first_violation"] == rep["first_violation"]
    assert len(shown["violations"]) == len(rep["violations"])
    assert shown["violation_total"] == sum(rep["violation_counts"].values())
    code, out, _ = run_cli(capsys, "runs", "--db", db, "--json", "--status", "violation")
    assert [r["run_id"] for r in json.loads(out)] == [1]
    code, out, _ = run_cli(capsys, "runs", "--db", db, "--json", "--build", "builtin:swa")
    assert json.loads(out) == []


def test_a_failure_while_storing_leaves_nothing(db_url, trace, monkeypatch):
    db = db_url
    replay_and_store(trace, "builtin:swa", db=db)
    import kvreplay.store.runs as runs_mod

    def boom(**kw):  # a violation row that cannot be made, mid-run (not a mapped class: one per case)
        raise RuntimeError("disk gone")

    monkeypatch.setattr(runs_mod, "ViolationRow", boom)
    with pytest.raises(RuntimeError):
        replay_and_store(trace, "builtin:swa@stale-tail", db=db)
    assert counts(db) == (1, 0)  # the first run only, no half of the second


@pytest.mark.slow
def test_eight_replays_writing_at_once_lose_nothing(db_url, trace):
    db = db_url
    open_store(db).close()
    builds = ["builtin:swa", "builtin:swa@stale-tail", "builtin:swa@page-partial-clear", "builtin:swa@deferred-lookup",
              "builtin:swa@unfiltered-page0", "builtin:swa@stale-tail", "builtin:swa", "builtin:swa@page-partial-clear"]
    procs = [subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", "replay", str(trace), "--build", b,
                               "--db", db, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for b in builds]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode in (0, 1), err
        reports.append(json.loads(out))
    st = open_store(db)
    stored = list_runs(st)
    st.close()
    assert sorted(r.build.spec for r in stored) == sorted(builds)
    expected_violations = sum(len(r["violations"]) for r in reports)
    assert counts(db) == (8, expected_violations)


@pytest.mark.parametrize("make_db, message", [
    (lambda p: str(p / "missing-dir" / "r.db"), "cannot open database"),
    (lambda p: (p / "junk.db").write_text("this is not sqlite " * 100) and str(p / "junk.db"), "cannot open database"),
    (lambda p: "nosuchdialect://x/y", "cannot open database"),
    (lambda p: str(p), "is a directory"),
])
def test_a_database_that_cannot_be_opened_is_bad_input(tmp_path, trace, capsys, make_db, message):
    db = make_db(tmp_path)
    with pytest.raises(BadInput, match=message):
        open_store(db)
    code, out, err = run_cli(capsys, "replay", str(trace), "--build", "builtin:swa", "--db", db)
    assert code == 2 and message in err and err.count("\n") == 1


def test_on_a_fresh_machine_the_default_database_and_its_directory_are_made(tmp_path, trace, capsys, monkeypatch):
    """No --db and no KVREPLAY_DB: the default file's directory is made on first use (a
    directory given with --db must exist; the case above)."""
    monkeypatch.delenv("KVREPLAY_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "fresh" / "share"))
    code, out, err = run_cli(capsys, "replay", str(trace), "--build", "builtin:swa")
    assert code == 0, err
    assert (tmp_path / "fresh" / "share" / "kvreplay" / "kvreplay.db").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--build", "builtin:nope"], "unknown build"),
    (["--build", "builtin:paged"], "records a swa pool"),
    (["--build", "builtin:swa", "--mode", "fuzzy"], "unknown mode"),
    (["--build", "py:no_such_module_xyz:Pool"], "could not be loaded"),
])
def test_bad_replay_input_exits_2_or_125_and_stores_nothing(db_url, trace, capsys, argv, message):
    db = db_url
    code, out, err = run_cli(capsys, "replay", str(trace), *argv, "--db", db)
    assert code == (125 if "loaded" in message else 2)
    assert message in err and err.count("\n") == 1
    assert counts(db) == (0, 0)


def test_corrupt_or_truncated_trace_is_bad_input_and_stores_nothing(tmp_path, db_url, trace, capsys):
    db = db_url
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(trace.read_bytes()[: trace.stat().st_size // 3])
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1" + b"\0" * 5000)
    for bad in (cut, junk):
        code, _, err = run_cli(capsys, "replay", str(bad), "--build", "builtin:swa", "--db", db)
        assert code == 2 and err.startswith("kvreplay: error:") and err.count("\n") == 1
    assert counts(db) == (0, 0)
    code, _, err = run_cli(capsys, "show", "7", "--db", db)
    assert code == 2 and "no run 7" in err


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_diff_shows_where_two_builds_part(trace, capsys):
    code, out, _ = run_cli(capsys, "diff", str(trace), "--base", "builtin:swa", "--candidate", "builtin:swa", "--json")
    assert code == 0 and json.loads(out)["differing_calls"] == 0
    code, out, _ = run_cli(capsys, "diff", str(trace), "--base", "builtin:paged", "--candidate", "builtin:swa")
    assert code == 2
    from kvreplay.replay.diff import diff_builds

    d = diff_builds(trace, "builtin:swa", "py:pool_policies:HighPagesFirstSWAPool", context=3)
    assert d.first is not None and d.first.method == "alloc_extend_swa_tail" and d.first_kind == "result"
    assert len(d.context) <= 3 and d.per_method["alloc_extend_swa_tail"] >= 1
    code, out, _ = run_cli(capsys, "diff", str(trace), "--base", "builtin:swa",
                           "--candidate", "py:pool_policies:HighPagesFirstSWAPool")
    assert code == 1 and "first at call" in out and "alloc_extend_swa_tail" in out


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_demo_runs_the_main_job_end_to_end(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    code, out, err = run_cli(capsys, "demo", "-n", "300", "--db", db, "--out", str(tmp_path / "d"), "--json")
    d = json.loads(out)
    assert code == 0 and d["ok"]
    assert d["clean"]["status"] == "clean" and d["buggy"]["status"] == "violation"
    assert d["stored"]["first_violation"]["invariant"] == "swa-mapping"
    assert counts(db)[0] == 2


def test_a_database_at_the_first_revision_is_upgraded_on_open(tmp_path):
    from alembic import command
    from sqlalchemy import create_engine, inspect

    from kvreplay.store.db import alembic_config

    path = tmp_path / "old.db"
    eng = create_engine(f"sqlite:///{path}")
    cfg = alembic_config()
    with eng.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    assert "calls" not in {c["name"] for c in inspect(eng).get_columns("traces")}
    eng.dispose()
    st = open_store(str(path))
    assert "calls" in {c["name"] for c in inspect(st.engine).get_columns("traces")}
    assert "message" in {c["name"] for c in inspect(st.engine).get_columns("runs")}
    st.close()
    with sqlite3.connect(path) as con:
        assert con.execute("select version_num from alembic_version").fetchone()[0] == "0007"


def test_two_writers_creating_the_same_build_both_succeed(db_url):
    """The race the 8-writer test can hit on PostgreSQL, made certain: writer A has
    inserted build X (not yet committed) when writer B looks for it, finds none and
    inserts too; B's insert waits for A, fails on the unique key, and takes A's row."""
    import threading

    from kvreplay.store.models import Build
    from kvreplay.store.runs import _get_or_create_build

    if "://" not in db_url:
        pytest.skip("SQLite's write lock serializes writers: there is no race to make")
    st = open_store(db_url)
    try:
        a = st.session()
        a.begin()
        a.add(Build(spec="builtin:raced", resolved_version="a"))
        a.flush()
        got = {}

        def writer_b() -> None:
            with st.session() as b, b.begin():
                got["b"] = _get_or_create_build(b, "builtin:raced", "b").id

        t = threading.Thread(target=writer_b)
        t.start()
        t.join(timeout=1.0)
        assert t.is_alive()  # B waits on A's uncommitted row
        a.commit()
        t.join(timeout=30)
        with st.session() as s:
            rows = s.scalars(select(Build).where(Build.spec == "builtin:raced")).all()
        assert len(rows) == 1 and got["b"] == rows[0].id and rows[0].resolved_version == "a"
    finally:
        st.close()
