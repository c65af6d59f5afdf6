"""The kvreplay command: synth, inspect, builds; deterministic traces; one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import run_in_process
from unfolded import unfolded

from kvreplay.trace.format import SCHEMA_VERSION


def run(capsys, *argv: str) -> tuple[int, str, str]:
    res = run_in_process(capsys, *argv)
    return res.returncode, res.stdout, res.stderr


@pytest.mark.parametrize("scenario", ["decode", "disagg-mtp", "radix-swa"])
def test_synth_same_seed_same_call_columns(tmp_path, capsys, scenario):
    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    for p in paths:
        code, out, _ = run(capsys, "synth", scenario, "-n", "60", "--seed", "7", "-o", str(p), "--json")
        assert code == 0 and json.loads(out)["requests_done"] == 60
    a, b = (unfolded(p) for p in paths)
    assert len(a) > 100 and a == b
    code, out, _ = run(capsys, "synth", scenario, "-n", "60", "--seed", "8", "-o", str(paths[1]), "--json")
    assert a != unfolded(paths[1])


def test_inspect_describes_a_trace(tmp_path, capsys):
    p = tmp_path / "t.parquet"
    run(capsys, "synth", "disagg-mtp", "-n", "40", "-o", str(p))
    code, out, _ = run(capsys, "inspect", str(p), "--json")
    s = json.loads(out)
    assert code == 0
    assert s["meta"]["family"] == "swa" and s["meta"]["ctor_args"]["need_sort"] is True
    assert s["calls_per_method"]["alloc_extend_swa_tail"] == 40
    assert s["calls"] + s["nested_rows"] == s["rows"] + s["folded_reads"] + 2 * s["folded_groups"] + s["folded_bounds"]
    assert 0 < s["peak_used"]["full"] <= 2048 and 0 < s["peak_used"]["swa"] <= 512
    assert s["time_span_s"] > 0 and s["file_bytes"] == p.stat().st_size
    assert 0 < s["bytes_per_index"] < 3
    assert "kvreplay synth disagg-mtp" in s["meta"]["extra"]["command"]
    code, out, _ = run(capsys, "inspect", str(p))
    assert code == 0 and "alloc_extend_swa_tail" in out and "bytes/index" in out


def test_builds_lists_the_builtins_and_variants(capsys):
    code, out, _ = run(capsys, "builds", "--json")
    specs = {b["build"] for b in json.loads(out)}
    assert code == 0 and {"builtin:swa", "builtin:swa@stale-tail", "builtin:swa@deferred-lookup"} <= specs


def test_workload_files_drive_the_model(tmp_path, capsys):
    moon = tmp_path / "m.jsonl"
    moon.write_text(
        "\n".join(
            json.dumps({"timestamp": i * 50, "input_length": 700 + 40 * i, "output_length": 30,
                        "hash_ids": [1, 2] if i % 2 else [1, 3]})
            for i in range(12)
        )
    )
    azure = tmp_path / "a.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "\n".join(f"2023-11-16 18:17:0{i}.9799600,{300 + i},{20 + i}" for i in range(8))
    )
    for wl, scenario in ((moon, "radix-swa"), (azure, "disagg-mtp")):
        out_path = tmp_path / f"{scenario}.parquet"
        code, out, err = run(capsys, "synth", scenario, "--workload", str(wl), "--length-scale", "0.1", "-n", "50",
                             "-o", str(out_path), "--json")
        assert code == 0, err
        done = json.loads(out)["requests_done"]
        assert done == (12 if wl == moon else 8)
    hits = json.loads(run(capsys, "synth", "radix-swa", "--workload", str(moon), "--length-scale", "0.1",
                          "-o", str(tmp_path / "x.parquet"), "--json")[1])["prefix_hit_tokens"]
    assert hits > 0  # Mooncake's shared hash_ids become prefix-cache hits


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "{tmp}/missing.parquet"], "no such file"),
        (["inspect", "{tmp}/notparquet.parquet"], "not a readable Parquet file"),
        (["inspect", "{tmp}/truncated.parquet"], "not a readable Parquet file"),
        (["inspect", "{tmp}/newer.parquet"], "newer than this kvreplay reads"),
        (["synth", "warp-drive", "-o", "{tmp}/x.parquet"], "unknown scenario"),
        (["synth", "decode", "--build", "builtin:nope", "-o", "{tmp}/x.parquet"], "unknown build"),
        (["synth", "decode", "--build", "builtin:swa", "-o", "{tmp}/x.parquet"], "needs a paged pool"),
        (["synth", "decode", "--workload", "{tmp}/missing.jsonl", "-o", "{tmp}/x.parquet"], "no such file"),
        (["synth", "decode", "--full-size", "8", "-o", "{tmp}/x.parquet"], "cannot fit an empty pool"),
        (["synth", "decode", "--device", "cuda:7", "-o", "{tmp}/x.parquet"], "no CUDA device"),
        (["synth", "disagg-mtp", "--k", "-1", "-o", "{tmp}/x.parquet"], "--k must be 0"),
        (["synth", "vllm-prefix", "--eagle", "--k", "0", "-o", "{tmp}/x.parquet"], "--eagle: at least 1"),
        (["synth", "decode", "--speculative", "-o", "{tmp}/x.parquet"], "an option of scenario radix-swa"),
        (["synth", "radix-swa", "--speculative", "--draft-accept", "1.5", "-o", "{tmp}/x.parquet"],
         "--draft-accept must be a probability"),
    ],
)
def test_bad_input_gives_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "notparquet.parquet").write_text("hello")
    good = tmp_path / "good.parquet"
    run(capsys, "synth", "decode", "-n", "20", "-o", str(good))
    (tmp_path / "truncated.parquet").write_bytes(good.read_bytes()[:-100])
    table = pq.read_table(good)
    md = dict(table.schema.metadata)
    md[b"kvreplay.schema_version"] = str(SCHEMA_VERSION + 1).encode()
    pq.write_table(table.replace_schema_metadata(md), tmp_path / "newer.parquet")
    code, out, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2
    assert message in err and err.count("\n") == 1 and err.startswith("kvreplay: error:")
    assert not (tmp_path / "x.parquet").exists()


def test_console_script_exit_codes():
    r = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "inspect", "/nonexistent.parquet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "kvreplay: error: /nonexistent.parquet: no such file"
    r = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "synth"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2  # usage error


def test_synth_keeps_the_trace_when_the_pool_asserts(tmp_path, cli):
    out = tmp_path / "t.parquet"
    res = cli("synth", "radix-swa", "--requests", "20", "--seed", "1", "--build", "builtin:swa@unfiltered-page0",
              "-o", str(out))
    assert res.returncode == 1
    assert res.stderr.startswith("kvreplay: error: builtin:swa@unfiltered-page0 failed after")
    assert "AssertionError" in res.stderr and res.stderr.count("\n") == 1
    assert out.exists()  # the reproducer, up to and including the failing call


def _no_reprs(value):
    """Every string in a JSON document, none of them a Python repr of a value."""
    if isinstance(value, dict):
        for v in value.values():
            _no_reprs(v)
    elif isinstance(value, list):
        for v in value:
            _no_reprs(v)
    elif isinstance(value, str):
        assert not value.startswith(("tensor(", "'", "segments(")), value


def test_replay_and_show_speak_one_json_vocabulary(swa_trace_80, tmp_path, cli):
    db = str(tmp_path / "k.db")
    replayed = json.loads(cli("replay", str(swa_trace_80), "-b", "builtin:swa@stale-tail", "--db", db,
                              "--json").stdout)
    shown = json.loads(cli("show", str(replayed["run_id"]), "--db", db, "--json").stdout)
    listed = json.loads(cli("runs", "--db", db, "--json").stdout)[0]
    for key in ("run_id", "build", "mode", "status", "exit_code", "calls_replayed", "violation_total",
                "divergence_total", "violation_counts", "violations", "divergences", "first_violation",
                "capacity_assert_call", "capacity_assert_after_calls"):
        assert shown[key] == replayed[key], key
    assert listed["run_id"] == replayed["run_id"]
    assert listed["first_violation"] == {k: replayed["first_violation"][k] for k in ("call", "invariant", "method")}
    first = replayed["first_violation"]
    assert isinstance(first["call"], int) and 1 <= first["call"] <= replayed["calls_replayed"]
    _no_reprs(replayed)
    _no_reprs(shown)


def test_divergence_values_are_json_values(tmp_path, cli):
    trace = tmp_path / "d.parquet"
    assert cli("synth", "decode", "-n", "20", "-o", str(trace)).returncode == 0
    res = cli("replay", str(trace), "-b", "py:pool_policies:HighPagesFirstPagedPool", "--no-store", "--json")
    first = json.loads(res.stdout)["first_divergence"]
    assert first["kind"] == "result" and isinstance(first["expected"], list) and isinstance(first["actual"], list)
    assert all(isinstance(x, int) for x in first["expected"])


def test_calls_are_numbered_alike_in_synth_inspect_and_replay(tmp_path, cli):
    trace = tmp_path / "t.parquet"
    made = json.loads(cli("synth", "disagg-mtp", "-n", "30", "-o", str(trace), "--json").stdout)
    seen = json.loads(cli("inspect", str(trace), "--json").stdout)
    replayed = json.loads(cli("replay", str(trace), "-b", "builtin:swa", "--no-store", "--json").stdout)
    assert made["calls"] == seen["calls"] == replayed["calls_replayed"] < made["rows"] == seen["rows"]


@pytest.mark.parametrize("argv, hint", [
    (["replay", "t.parquet", "-b", "builtin:swa@stale-tial"], "did you mean builtin:swa@stale-tail?"),
    (["runs", "--status", "clen"], "did you mean clean?"),
    (["minimize", "t.parquet", "-b", "builtin:swa@stale-tail", "-o", "m.parquet", "--invariant", "swa-maping"],
     "did you mean swa-mapping?"),
    (["replay", "t.parquet", "-b", "builtin:swa", "--failure", "ownersip"], "did you mean ownership?"),
    (["synth", "disagg-mpt", "-o", "x.parquet"], "did you mean disagg-mtp?"),
])
def test_a_near_miss_gets_a_did_you_mean(argv, hint, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = cli(*argv)
    assert res.returncode == 2 and hint in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_a_usage_error_is_one_line(cli):
    res = cli("replay", "--build")
    assert res.returncode == 2 and res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1


def test_long_work_reports_progress_lines_when_not_on_a_terminal(swa_trace_80, cli, monkeypatch):
    monkeypatch.setattr("kvreplay.cli.base.PROGRESS_EVERY_S", 0.0)
    res = cli("replay", str(swa_trace_80), "-b", "builtin:swa", "--no-store")
    assert res.returncode == 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"replay {swa_trace_80.name}: ")]
    done, total = lines[-1].split(": ")[1].split()[0].split("/")
    assert len(lines) >= 2 and done == total
    res = cli("diff", str(swa_trace_80), "--base", "builtin:swa", "--candidate", "builtin:swa@stale-tail")
    assert any(ln.startswith(f"diff {swa_trace_80.name}: ") for ln in res.stderr.splitlines())


def test_commands_that_read_the_store_never_create_one(tmp_path, cli):
    # A mistyped --db used to answer "no runs" and leave an empty 80 KB database behind.
    for argv in (("show", "99"), ("runs",), ("report", "1", "-o", str(tmp_path / "r.html"))):
        db = tmp_path / "sub" / "typo.db"
        res = cli(*argv, "--db", str(db))
        assert res.returncode == 2 and "database" in res.stderr, (argv, res.stderr)
        assert not db.exists() and not db.parent.exists() and not (tmp_path / "r.html").exists()


def test_synth_into_a_directory_that_does_not_exist_writes_nothing(tmp_path, cli):
    res = cli("synth", "decode", "-n", "5", "-o", str(tmp_path / "no" / "such" / "t.parquet"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_piped_table_keeps_whole_names_and_help_keeps_its_brackets(tmp_path, swa_trace_80, cli):
    db = str(tmp_path / "k.db")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    # the run to list is stored in this process; the commands whose output is piped run apart
    cli("replay", str(swa_trace_80), "--build", "builtin:swa@page-partial-clear", "--db", db)
    listed = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "runs", "--db", db], capture_output=True,
                            text=True, timeout=120, env=env).stdout
    assert "builtin:swa@page-partial-clear" in listed and "…" not in listed
    helped = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "replay", "--help"], capture_output=True,
                            text=True, timeout=120, env=env).stdout
    assert "kvreplay[ray]" in helped


def test_outputs_in_a_missing_directory_are_refused_before_any_work(cli, tmp_path):
    """-o, --junit, --summary and record --out never create directories above the one
    named; the refusal comes first, so nothing is written (the store included)."""
    db = tmp_path / "k.db"
    page0 = str(Path(__file__).resolve().parents[1] / "traces" / "sglang-0.5.23-swa-page0.parquet")
    corpus = str(Path(__file__).resolve().parents[1] / "traces")
    for argv in (("ci", corpus, "--build", "builtin:swa", "--junit", str(tmp_path / "no" / "j.xml")),
                 ("ci", corpus, "--build", "builtin:swa", "--summary", str(tmp_path / "no" / "s.md")),
                 ("record", "--out", str(tmp_path / "no" / "traces"), "--", sys.executable, "-c", "pass"),
                 ("replay", page0, "--build", "builtin:swa", "--report", str(tmp_path / "no" / "r.html"))):
        r = cli(*argv, "--db", str(db)) if argv[0] != "record" else cli(*argv)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)
        assert "does not exist" in r.stderr, r.stderr
        assert not (tmp_path / "no").exists() and not db.exists(), argv


@pytest.mark.slow
def test_a_matrix_cell_shows_every_rule_its_invariant_broke(cli, tmp_path):
    # On the seed reproducer, 0.5.12's pool breaks swa-mapping by two rules, 0.5.12.post1's
    # by one: a cell that showed only the earliest made them look the same.
    trace = str(Path(__file__).resolve().parents[1] / "traces" / "sglang-0.5.12-swa-tail-prealloc.parquet")
    r = cli("matrix", trace, "--builds", "builtin:swa,builtin:swa@stale-tail", "--db", str(tmp_path / "m.db"))
    assert r.returncode == 1, r.stderr
    # the swa-mapping column, read down its lines (a narrow console folds long cells)
    column = "".join(ln.split("│")[4].strip() for ln in r.stdout.splitlines() if ln.count("│") > 5)
    assert "#16released-page-keeps-peer" in column and "tail-prealloc-nontail-mapped" in column, r.stdout


def test_show_says_what_the_capacity_call_is(cli, tmp_path):
    page0 = str(Path(__file__).resolve().parents[1] / "traces" / "sglang-0.5.23-swa-page0.parquet")
    db = str(tmp_path / "k.db")
    assert cli("replay", page0, "--build", "builtin:swa@unfiltered-page0", "--db", db).returncode == 1
    shown = cli("show", "1", "--db", db).stdout
    assert "capacity: an available count exceeds its pool's size from call #" in shown, shown
    assert "assertion fires" not in shown


def test_a_release_missing_its_dependencies_says_which_environment_it_needs(tmp_path, monkeypatch):
    from kvreplay.errors import BuildUnloadable
    from kvreplay.families.sglang import release as adapter

    (tmp_path / "fake_release_pool.py").write_text("import orjson_not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BuildUnloadable) as err:
        adapter._first(("fake_release_pool:Allocator",))
    assert "imports orjson_not_installed_anywhere, which this environment lacks" in str(err.value)
    assert "pip install sglang==" in str(err.value)


def test_help_shows_flags_as_they_are_typed(cli):
    # "--json <bool>" read as an option taking a value; "--json true" is refused.
    shown = cli("replay", "--help").stdout
    line = next(ln for ln in shown.splitlines() if "--json" in ln)
    assert "<bool>" not in line and "<bool>" not in shown
    assert "<str>" in next(ln for ln in shown.splitlines() if "--mode" in ln)


def test_tables_on_a_narrow_terminal_wrap_and_never_cut_a_name(tmp_path, cli):
    import os
    import subprocess

    page0 = str(Path(__file__).resolve().parents[1] / "traces" / "sglang-0.5.23-swa-page0.parquet")
    db = str(tmp_path / "k.db")
    env = {**os.environ, "COLUMNS": "70"}
    cli("replay", page0, "-b", "builtin:swa@unfiltered-page0", "--db", db)  # the run to list, stored here
    got = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "runs", "--db", db], capture_output=True,
                         text=True, env=env).stdout
    assert max(len(ln) for ln in got.splitlines()) <= 70
    assert "…" not in got
    cells = "".join(ln.split("│")[3].strip() for ln in got.splitlines() if ln.count("│") > 3)
    assert "builtin:swa@unfiltered-page0" in cells  # the build column, read down its lines


@pytest.mark.slow
def test_what_the_demo_writes_outlives_the_command(tmp_path):
    """The demo's trace and report were written into the command's scratch directory,
    which is removed when the command ends: the printed path led nowhere."""
    import json
    import os
    import subprocess

    env = {**os.environ, "TMPDIR": str(tmp_path), "KVREPLAY_DB": str(tmp_path / "k.db")}
    r = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "demo", "--requests", "300", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert Path(d["trace"]).is_file() and Path(d["report"]).is_file()


def test_disagg_mtp_without_speculation_decodes_a_token_a_step(tmp_path, capsys):
    from kvreplay.trace.summary import summarize

    p = tmp_path / "k0.parquet"
    code, out, _ = run(capsys, "synth", "disagg-mtp", "--k", "0", "--sglang-scheduler", "-n", "40", "--window", "8",
                       "-o", str(p), "--json")
    assert code == 0, out
    calls = summarize(p).calls_per_method
    # every request's prompt preallocated, then a slot a step: no draft extends, no rejected-slot frees
    retracted = json.loads(out)["retractions"]  # a retracted request is preallocated again
    assert calls["alloc_extend_swa_tail"] == 40 + retracted and calls["alloc_decode"] > 0
    assert "alloc_extend" not in calls and "free" not in calls
    # two groups a turn of the loop, one more for each retraction
    assert calls["free_group_begin"] == 2 * calls["alloc_decode"] + retracted


def test_radix_swa_speculating_allocates_draft_slots_in_batched_extends(tmp_path, capsys):
    """sglang 0.5.23's speculative path: no alloc_decode, every row kept 2 (k + 1) slots past
    its committed length in whole pages; all accepted drafts end a request in fewer steps."""
    from kvreplay.trace.reader import TraceReader
    from kvreplay.trace.summary import summarize

    steps = {}
    for accept in ("0", "1"):
        p = tmp_path / f"spec{accept}.parquet"
        code, out, _ = run(capsys, "synth", "radix-swa", "--speculative", "--k", "2", "--draft-accept", accept,
                           "--sglang-scheduler", "-n", "30", "--window", "16", "--page-size", "4", "-o", str(p))
        assert code == 0, out
        calls = summarize(p).calls_per_method
        assert "alloc_decode" not in calls and "free" not in calls
        steps[accept] = calls["free_group_begin"]
        draft = 0  # extends whose rows all had slots before and grow to whole pages: draft slots
        for c in TraceReader(p).calls(top_level_only=True):
            if c.method == "alloc_extend" and int(c.args["prefix_lens_cpu"].min()) > 0:
                rows = list(zip(c.args["prefix_lens_cpu"].tolist(), c.args["seq_lens_cpu"].tolist(), strict=True))
                draft += all(b % 4 == 0 for a, b in rows if b > a)
        assert draft > calls["alloc_extend"] // 2, (draft, calls["alloc_extend"])
    assert steps["1"] < steps["0"]  # three tokens a step instead of one


def test_inspect_gives_the_peak_of_a_counter_that_counts_what_is_held(cli):
    """The tree's evictable and protected sizes count what the tree holds: their peak use
    is their largest value, not the pool's size less their smallest."""
    from kvreplay.contract.registry import family
    from kvreplay.trace.reader import TraceReader

    trace = Path(__file__).resolve().parents[1] / "traces" / "live-sglang-0.5.23-tree-retract32.parquet"
    got = json.loads(cli("inspect", str(trace), "--json").stdout)["peak_used"]
    calls = [tc.call for tc in TraceReader(trace).top_calls()]
    cols = family("tree").counter_of
    for sub in ("evictable", "protected"):
        col = cols[sub]
        most = max(c.counters.get(col) or 0 for c in calls)
        assert got[sub] == most < 65536, (sub, got)
    assert got["kv"] == 65536 - min(c.counters["available"] for c in calls if c.counters.get("available") is not None)
