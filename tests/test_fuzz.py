"""Fuzzing the trace reader, the replayer and the manifest reader with damaged and
hostile input (tests/trace_mutator.py). Whatever the input, a command exits 0, 1, 2
or 125, with one line on stderr for bad input (exit 2), never a traceback, never a
hang, and writes nothing on exit 2 (no database is created).

The fast tier runs 60 traces and 40 manifests; the slow tier (.ci/run) runs 2,000 traces and
500 manifests. ``KVREPLAY_FUZZ_CASES=N KVREPLAY_FUZZ_SEED=S pytest -m slow
tests/test_fuzz.py`` runs a long campaign (scripts/fuzz.sh)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from trace_mutator import mutate_manifest, mutate_trace

from kvreplay.workload.synth import SynthConfig, synthesize

CORPUS = Path(__file__).resolve().parents[1] / "traces"
SEED = int(os.environ.get("KVREPLAY_FUZZ_SEED", "20261130"))
SLOW_TRACES = int(os.environ.get("KVREPLAY_FUZZ_CASES", "2000"))
OK_EXITS = {0, 1, 2, 125}
CASE_TIMEOUT_S = 60


@contextmanager
def deadline(seconds: float, what: str):
    def hung(signum, frame):
        raise TimeoutError(f"no answer after {seconds} s: {what}")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Small well-formed traces of every family, each with the build it replays on."""
    out = tmp_path_factory.mktemp("fuzz-bases")
    made = []
    for scenario, build, kw in (("disagg-mtp", "builtin:swa", {"full_size": 256, "swa_size": 128}),
                                ("decode", "builtin:paged", {"full_size": 256}),
                                ("radix-swa", "builtin:swa", {"full_size": 512, "swa_size": 256})):
        path = out / f"{scenario}.parquet"
        synthesize(SynthConfig(scenario=scenario, out=path, requests=6, **kw))
        made.append((scenario, pq.read_table(path), build))
    path = out / "vllm-prefix.parquet"  # vLLM's family: requests, block ids, hashes
    synthesize(SynthConfig(scenario="vllm-prefix", out=path, requests=6, block_tokens=16, full_size=1024,
                           max_running=4))
    made.append(("vllm-prefix", pq.read_table(path), "builtin:vllm"))
    path = out / "prefix-tree.parquet"  # the tree family: requests, page hashes, slot runs, nodes, locks
    synthesize(SynthConfig(scenario="prefix-tree", out=path, requests=8, full_size=256, page_size=4, max_running=4))
    made.append(("prefix-tree", pq.read_table(path), "builtin:tree"))
    made.append(("none-leak", pq.read_table(CORPUS / "sglang-0.5.23-decode-none-leak.parquet"), "builtin:swa"))
    return made


def _check(res, argv, what, wrote: Path | None) -> None:
    where = f"{what}: {' '.join(argv)}"
    assert res.returncode in OK_EXITS, (where, res.returncode, res.stderr[-500:])
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, (where, res.stderr[-800:])
    if res.returncode == 2:
        assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1, (where, res.stderr)
        if wrote is not None:
            assert not wrote.exists(), (where, "bad input wrote a database")


def _fuzz_traces(cases: int, seed: int, bases, tmp_path: Path, cli, first: int = 0) -> dict[int, int]:
    exits: dict[int, int] = {}
    for i in range(first, first + cases):
        rng = random.Random(seed * 1_000_003 + i)
        name, table, build = rng.choice(bases)
        path = tmp_path / f"case-{i}.parquet"
        what = f"seed {seed} case {i} ({name}, {mutate_trace(rng, table, path)})"
        db = tmp_path / f"k-{i}.db"
        replays = [["replay", str(path), "-b", build, "--db", str(db), "--device", "cpu"]]
        if name in ("vllm-prefix", "prefix-tree"):  # remap hands ids from the trace to the build: damaged ones too
            replays.append(["replay", str(path), "-b", build, "--mode", "remap", "--no-store"])
        for argv in (*replays, ["inspect", str(path)]):
            with deadline(CASE_TIMEOUT_S, what):
                res = cli(*argv)
            _check(res, argv, what, db if argv[0] == "replay" else None)
            if argv is replays[0]:
                exits[res.returncode] = exits.get(res.returncode, 0) + 1
        path.unlink(missing_ok=True)
        db.unlink(missing_ok=True)
    return exits


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_damaged_traces_fast(bases, tmp_path, cli):
    exits = _fuzz_traces(60, SEED, bases, tmp_path, cli)
    assert exits.get(2, 0) > 0 and exits.get(0, 0) + exits.get(1, 0) > 0, exits  # both kinds were reached


# The many cases in shards, so that the slow tier's two workers share them.
SHARDS = 4


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_damaged_traces_many(bases, tmp_path, cli, shard):
    first, last = SLOW_TRACES * shard // SHARDS, SLOW_TRACES * (shard + 1) // SHARDS
    exits = _fuzz_traces(last - first, SEED + 1, bases, tmp_path, cli, first)
    print(f"fuzz: damaged traces {first}..{last - 1}, replay exits {dict(sorted(exits.items()))}")
    assert sum(exits.values()) == last - first


@pytest.fixture
def corpus(tmp_path):
    names = ["sglang-0.5.23-swa-page0", "sglang-0.5.23-decode-none-leak"]
    doc = json.loads((CORPUS / "manifest.json").read_text())
    doc["traces"] = [e for e in doc["traces"] if e["name"] in names]
    for e in doc["traces"]:
        shutil.copy(CORPUS / e["file"], tmp_path / e["file"])
    return tmp_path, doc


def _fuzz_manifests(cases: int, seed: int, corpus, cli, first: int = 0) -> dict[int, int]:
    root, doc = corpus
    exits: dict[int, int] = {}
    for i in range(first, first + cases):
        rng = random.Random(seed * 7919 + i)
        damaged, what = mutate_manifest(rng, doc)
        (root / "manifest.json").write_text(json.dumps(damaged))
        db = root / f"k-{i}.db"
        for argv in (["ci", str(root), "-b", "builtin:swa", "--db", str(db)], ["corpus", "check", str(root)]):
            with deadline(CASE_TIMEOUT_S, what):
                res = cli(*argv)
            assert res.returncode in {0, 1, 2}, (what, argv, res.stderr)
            _check(res, argv, f"manifest case {i} ({what})", db if argv[0] == "ci" else None)
            exits[res.returncode] = exits.get(res.returncode, 0) + 1
        db.unlink(missing_ok=True)
    return exits


def test_damaged_manifests_fast(corpus, cli):
    exits = _fuzz_manifests(40, SEED, corpus, cli)
    assert exits.get(2, 0) > 0, exits


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(2))
def test_damaged_manifests_many(corpus, cli, shard):
    exits = _fuzz_manifests(250, SEED + 1, corpus, cli, first=250 * shard)
    print(f"fuzz: damaged manifests {250 * shard}..{250 * shard + 249}, exits {dict(sorted(exits.items()))}")


def _fuzz_dashboard(cases: int, seed: int, db: str) -> dict[int, int]:
    """Random GETs over every route with hostile parameters: never a 500."""
    import random

    from kvreplay.jobs.dashboard import create_app
    from kvreplay.store.db import open_store

    rng = random.Random(seed)
    client = create_app(open_store(db)).test_client()
    words = ["1", "0", "-1", str(1 << 63), "9" * 400, "x" * 5000, "%", "%25", "'; DROP TABLE runs;--", "<a>", "\x00",
             "9999-12-31", "0001-01-01", "2026-13-40", "violation", "clean", "../../etc/passwd", "", "1e9", "١"]
    routes = ["/", "/runs/{w}", "/compare", "/traces/{w}", "/api/runs", "/assets/{w}", "/favicon.ico", "/{w}"]
    params = ["trace", "build", "status", "since", "until", "a", "b"]
    codes: dict[int, int] = {}
    for _ in range(cases):
        route = rng.choice(routes).replace("{w}", rng.choice(words).replace("/", "%2F") or "x")
        query = "&".join(f"{rng.choice(params)}={rng.choice(words)}" for _ in range(rng.randint(0, 3)))
        got = client.get(route + ("?" + query if query else "")).status_code
        codes[got] = codes.get(got, 0) + 1
        assert got < 500, (route, query)
    return codes


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_dashboard_routes_fast(swa_trace_80, tmp_path):
    from kvreplay.jobs.stored_replay import replay_and_store

    db = str(tmp_path / "k.db")
    replay_and_store(swa_trace_80, "builtin:swa", db=db, device="cpu")
    codes = _fuzz_dashboard(int(os.environ.get("KVREPLAY_FUZZ_DASHBOARD", "400")), SEED, db)
    assert codes.get(200) and codes.get(404) and codes.get(400)
