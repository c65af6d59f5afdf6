"""Configuration values as hostile input (issue 60, class 5): every environment variable
kvreplay reads and every numeric option is checked where it is read. A bad one is one
line on stderr and exit 2 (never a traceback, an internal error or a default taken in
silence), and nothing is written; inside a recorded server a bad switch turns
recording off, said in one line, and never raises into the server."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hostile_checks import bad as _bad

from kvreplay.errors import BadInput
from kvreplay.limits import env_float, env_int
from kvreplay.recorder.switch_values import parts, read_switches

TARGET = "kvreplay.families.sglang.swa:SWAPool"
PROGRAM = """
import torch
from kvreplay.families.sglang.swa import SWAPool
pool = SWAPool(256, 64, 4, need_sort=False)
t = lambda *v: torch.tensor(v, dtype=torch.int64)
pool.free(pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4))
"""




def _kvreplay(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvreplay.cli.app", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


# -- kvreplay's own variables -----------------------------------------------------------------
@pytest.mark.parametrize("name, value", [
    ("KVREPLAY_PROGRESS_S", "abc"), ("KVREPLAY_PROGRESS_S", "nan"), ("KVREPLAY_PROGRESS_S", "-1"),
    ("KVREPLAY_PROGRESS_S", "inf"), ("KVREPLAY_MAX_POOL_SLOTS", "-1"), ("KVREPLAY_MAX_POOL_SLOTS", "0"),
    ("KVREPLAY_MAX_STRING_BYTES", "1e9"), ("KVREPLAY_MAX_BLOCKS", "lots"), ("KVREPLAY_MAX_FOLDED_READS", "1_000"),
    ("KVREPLAY_MAX_GROUP_VALUES", "9" * 5000), ("KVREPLAY_TORCH_THREADS", "abc"), ("KVREPLAY_TORCH_THREADS", "0"),
    ("KVREPLAY_START_METHOD", "bogus"), ("KVREPLAY_RECORDER", "bogus"), ("KVREPLAY_WRITER", "bogus"),
    ("KVREPLAY_TENSOR_SHIM", "2"),
])
def test_a_bad_value_of_a_kvreplay_variable_is_one_line_naming_it(cli, monkeypatch, tmp_path, name, value):
    monkeypatch.setenv(name, value)
    _bad(cli("synth", "decode", "-n", "5", "-o", str(tmp_path / "t.parquet")), name, "want")
    assert not (tmp_path / "t.parquet").exists()


def test_a_bad_variable_read_at_import_breaks_neither_the_import_nor_help(tmp_path):
    """KVREPLAY_PROGRESS_S was float() at import: every command, --help too, was a traceback."""
    env = {"KVREPLAY_PROGRESS_S": "abc", "KVREPLAY_MAX_POOL_SLOTS": "-1"}
    _bad(_kvreplay("runs", "--db", str(tmp_path / "k.db"), env=env), "KVREPLAY_")
    assert not (tmp_path / "k.db").exists()
    shown = _kvreplay("--help", env=env)
    assert shown.returncode == 0 and "Usage" in shown.stdout and not shown.stderr


def test_help_still_answers_in_process_with_a_bad_variable(cli, monkeypatch):
    monkeypatch.setenv("KVREPLAY_START_METHOD", "bogus")
    assert cli("replay", "--help").returncode == 0


@pytest.mark.parametrize("value, words", [
    pytest.param("nonexistent_family_pkg", ["does not import"], marks=pytest.mark.slow),
    pytest.param("os.path", ["no family package"], marks=pytest.mark.slow),
    ("../x", ["not a module name"]),
])
def test_kvreplay_families_naming_no_family_package_is_bad_input_not_an_internal_error(value, words):
    _bad(_kvreplay("builds", env={"KVREPLAY_FAMILIES": value}), "KVREPLAY_FAMILIES", *words)


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e300", "-1", "1_000", " 7x", "9" * 5000, "\u0663", "0x10"])
def test_the_typed_readers_take_nothing_outside_their_range(monkeypatch, raw):
    monkeypatch.setenv("KVREPLAY_T", raw)
    with pytest.raises(BadInput, match="KVREPLAY_T"):
        env_int("KVREPLAY_T", 1, 0, 1000)
    with pytest.raises(BadInput, match="KVREPLAY_T"):
        env_float("KVREPLAY_T", 1.0, 0.0, 1000.0)
    monkeypatch.setenv("KVREPLAY_T", " 12 ")
    assert env_int("KVREPLAY_T", 1, 0, 1000) == 12 and env_float("KVREPLAY_T", 1.0, 0.0, 1000.0) == 12.0
    monkeypatch.setenv("KVREPLAY_T", "")
    assert env_int("KVREPLAY_T", 7, 0, 1000) == 7


def test_a_cache_directory_that_cannot_be_one_is_bad_input_not_an_internal_error(monkeypatch, tmp_path):
    """KVREPLAY_CACHE under a file made every git: or release build exit 134 (NotADirectoryError)."""
    from kvreplay.builds.cache import cache_root

    (tmp_path / "file").write_text("")
    for value in (str(tmp_path / "file"), str(tmp_path / "file" / "below")):
        monkeypatch.setenv("KVREPLAY_CACHE", value)
        with pytest.raises(BadInput, match="KVREPLAY_CACHE"):
            cache_root()
    monkeypatch.setenv("KVREPLAY_CACHE", str(tmp_path / "new" / "cache"))
    assert cache_root() == tmp_path / "new" / "cache" and not (tmp_path / "new").exists()


# -- the recorder's switches ------------------------------------------------------------------
def test_a_rank_that_is_a_path_is_refused_by_record_and_nothing_is_written(cli, monkeypatch, tmp_path):
    """KVREPLAY_RANK=../x wrote the trace outside --out while record said none was written."""
    monkeypatch.setenv("KVREPLAY_RANK", "../escaped/x")
    out = tmp_path / "out"
    _bad(cli("record", "--out", str(out), "--class", TARGET, "--", sys.executable, "-c", "pass"), "KVREPLAY_RANK",
         "plain name")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, value", [
    ("KVREPLAY_FOLD_READS", "maybe"), ("KVREPLAY_CPU_COMPAT", "no-such-patch"),
])
def test_record_refuses_an_inherited_switch_its_processes_would_refuse(cli, monkeypatch, tmp_path, name, value):
    """These silently switched recording off (or rotation) in the server; record now says so first."""
    monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    _bad(cli("record", "--out", str(out), "--part-s", "0", "--part-rows", "0", "--", sys.executable, "-c", "pass"),
         name)
    assert not out.exists()


@pytest.mark.parametrize("name, value", [
    ("KVREPLAY_FLIGHT", "abc"), ("KVREPLAY_FLIGHT", "5"), ("KVREPLAY_COUNTERS_EVERY", "-3"),
    ("KVREPLAY_CHECKPOINT_EVERY", "x"), ("KVREPLAY_PARTS", "1,2"), ("KVREPLAY_WATCH", "bogus"),
    ("KVREPLAY_RECORD_CLASSES", "os:a/b"),
])
def test_record_hands_on_only_the_switches_its_flags_set(cli, monkeypatch, tmp_path, name, value):
    """A switch one of record's flags owns, inherited from the shell, is not passed on:
    the recording is what the command line asked for."""
    from kvreplay.recorder.live import record_env

    monkeypatch.setenv(name, value)
    assert name not in record_env(tmp_path / "out")
    res = cli("record", "--out", str(tmp_path / "out"), "--print-env", "--json")
    assert res.returncode == 0 and json.loads(res.stdout).get(name) != value, res.stderr


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_recorded_process_turns_recording_off_loudly_on_a_bad_switch(tmp_path):
    """A server launched with --print-env's variables by hand: a bad switch is one line on
    stderr naming it, the program runs on, and nothing is written, inside --out or outside."""
    from kvreplay.recorder.switches import SITE_DIR

    out = tmp_path / "out"
    env = {**os.environ, "KVREPLAY_RECORD_DIR": str(out), "KVREPLAY_RECORD_CLASSES": TARGET,
           "PYTHONPATH": os.pathsep.join([str(SITE_DIR), os.environ.get("PYTHONPATH", "")]),
           "KVREPLAY_RANK": "../escaped", "KVREPLAY_FLIGHT": "nan"}
    res = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if "kvreplay" in line]
    assert len(said) == 1 and "not recording" in said[0] and "KVREPLAY_" in said[0], res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_switches_read_back_what_record_writes():
    sw = read_switches({"KVREPLAY_RECORD_DIR": "/x", "KVREPLAY_RANK": "tp0dp1-a.b", "KVREPLAY_FLIGHT": "500",
                        "KVREPLAY_PARTS": "1000000,600,0,1073741824", "KVREPLAY_CPUS": "0,1,7"})
    assert (sw.rank, sw.flight, sw.rotation.rows, sw.rotation.seconds, sw.cpus) == ("tp0dp1-a.b", 500, 10**6, 600.0,
                                                                                      (0, 1, 7))
    assert parts("") == parts("0,0,0,0") and not parts("").on
    for text in ("1,2", "1,nan,0,0", "+1,600,0,0", "1_0,600,0,0", "1,0.05,0,0", "1,600,0,-1", "1,inf,0,0"):
        with pytest.raises(BadInput, match="KVREPLAY_PARTS"):
            parts(text)
    for rank in ("..", ".hidden", "a/b", "x" * 65, "a\nb", "tp0\x1b[31m"):
        with pytest.raises(BadInput, match="KVREPLAY_RANK"):
            read_switches({"KVREPLAY_RANK": rank})
    with pytest.raises(BadInput, match="KVREPLAY_CPUS"):
        read_switches({"KVREPLAY_CPUS": "0,../1"})


def test_flight_below_zero_is_refused_with_print_env_too(cli, tmp_path):
    _bad(cli("record", "--out", str(tmp_path / "o"), "--flight", "-5", "--print-env"), "--flight")


def test_a_tiny_keep_mb_is_refused_not_rounded_to_keep_all(cli, tmp_path):
    _bad(cli("record", "--out", str(tmp_path / "o"), "--keep-mb", "1e-9", "--print-env"), "--keep-mb")
    res = cli("record", "--out", str(tmp_path / "o"), "--keep-mb", "0.001", "--print-env", "--json")
    assert res.returncode == 0, res.stderr
    assert int(json.loads(res.stdout)["KVREPLAY_PARTS"].split(",")[3]) > 0  # a bound, not "keep all"


# -- numeric options --------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "-1", "1e300", "inf"])
def test_ci_timeout_that_is_no_number_of_seconds_is_bad_input(cli, tmp_path, value):
    db = tmp_path / "k.db"
    _bad(cli("ci", str(tmp_path), "-b", "builtin:swa", "--timeout", value, "--db", str(db)), "--timeout")
    assert not db.exists()


def test_corpus_add_max_mb_nan_does_not_turn_the_limit_off(cli, tmp_path):
    corpus = tmp_path / "corpus"
    _bad(cli("corpus", "add", str(tmp_path / "t.parquet"), "--name", "x", "--corpus", str(corpus), "--max-mb", "nan"),
         "--max-mb")
    assert not corpus.exists()


def _numeric_options() -> list[tuple[tuple[str, ...], str, type]]:
    import kvreplay.cli.app  # noqa: F401 - registers every command
    from kvreplay.cli.base import app

    def commands(t, prefix=()):
        for c in t.registered_commands:
            yield prefix + (c.name or c.callback.__name__.replace("_", "-"),), c.callback
        for g in t.registered_groups:
            yield from commands(g.typer_instance, prefix + (g.name,))

    found = []
    for path, fn in commands(app):
        hints = typing.get_type_hints(fn)
        for name, p in inspect.signature(fn).parameters.items():
            kind = next((t for t in (int, float) if hints[name] is t or t in typing.get_args(hints[name])), None)
            if kind is not None:
                decls = [d for d in getattr(p.default, "param_decls", None) or () if d.startswith("--")]
                found.append((path, max(decls, key=len) if decls else "--" + name.replace("_", "-")
                              if type(p.default).__name__ == "OptionInfo" else name.upper(), kind))
                assert hasattr(getattr(p.default, "callback", None), "bounds"), \
                    f"kvreplay {' '.join(path)} {name}: a numeric option without a bound (base.within)"
    return found


NUMERIC = _numeric_options()


@pytest.mark.parametrize("path, flag, kind", NUMERIC, ids=[f"{' '.join(p)} {f}" for p, f, _ in NUMERIC])
def test_every_numeric_option_refuses_nan_and_absurd_values_before_it_starts(cli, tmp_path, path, flag, kind):
    """Every int and float option has a range, checked as it is parsed (before any required
    argument is missing, before anything is read or written)."""
    assert len(NUMERIC) > 50
    for value in (["nan", "inf", "-1e300"] if kind is float else ["100000000000000000000", "-100000000000000000000"]):
        argv = (*path, "--", value) if flag.isupper() else (*path, flag, value)
        _bad(cli(*argv), flag, "must be")
    assert not any(tmp_path.iterdir())


# -- vLLM constructor values ------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_trace(tmp_path_factory):
    from kvreplay.workload.synth import SynthConfig, synthesize

    out = tmp_path_factory.mktemp("vllm") / "v.parquet"
    synthesize(SynthConfig(scenario="vllm-prefix", out=out, requests=10))
    return out


def _with_ctor(src: Path, dst: Path, **changes) -> Path:
    table = pq.read_table(src)
    md = dict(table.schema.metadata)
    args = json.loads(md[b"kvreplay.ctor_args"])
    md[b"kvreplay.ctor_args"] = json.dumps({**args, **changes}).encode()
    pq.write_table(table.replace_schema_metadata(md), dst)
    return dst


@pytest.mark.parametrize("changes", [{"num_blocks": 0}, {"hash_block_size": 5}, {"hash_block_size": 32},
                                     {"max_model_len": 0}, {"max_in_flight_tokens": 0}, {"block_size": 3}])
def test_vllm_constructor_values_no_pool_takes_are_bad_input_not_untestable(cli, tmp_path, vllm_trace, changes):
    trace = _with_ctor(vllm_trace, tmp_path / "t.parquet", **changes)
    db = tmp_path / "k.db"
    _bad(cli("replay", str(trace), "-b", "builtin:vllm", "--db", str(db)), next(iter(changes)))
    assert not db.exists()


def test_a_vllm_value_another_build_takes_is_still_untestable_here(cli, tmp_path, vllm_trace):
    """hash_block_size 8 of 16-token blocks: vLLM's manager takes it, the builtin one does not (125)."""
    trace = _with_ctor(vllm_trace, tmp_path / "t.parquet", hash_block_size=8)
    assert cli("replay", str(trace), "-b", "builtin:vllm", "--no-store").returncode == 125
