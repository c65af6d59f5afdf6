"""Traces where fleets keep them: a real S3-compatible server (moto's server mode,
started here unless .ci/run started one), hive-partitioned dumps, and Ray."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
from servers import s3_server

from kvreplay.store.db import open_store
from kvreplay.store.runs import get_run, list_runs, run_to_dict
from kvreplay.workload.synth import SynthConfig, synthesize

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(endpoint, bucket): a bucket of its own on the server; the AWS_* settings and a
    mirror directory of its own for this module (skipped without the s3test extra)."""
    with s3_server() as endpoint:
        import boto3  # moto's dependency: here only when the server could start

        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": endpoint,
               "KVREPLAY_REMOTE_CACHE": str(tmp_path_factory.mktemp("mirror"))}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        bucket = f"kv-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        try:
            yield endpoint, bucket
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _upload(endpoint: str, bucket: str, local: Path, prefix: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    for f in files:
        key = prefix if local.is_file() else f"{prefix}/{f.relative_to(local).as_posix()}"
        client.upload_file(str(f), bucket, key)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A corpus of two small traces, with expectations for builtin:swa and a bug variant."""
    from kvreplay.corpus.manage import add_trace

    d = tmp_path_factory.mktemp("corpus")
    src = tmp_path_factory.mktemp("src")
    for name, scenario, n in (("mtp", "disagg-mtp", 150), ("radix", "radix-swa", 60)):
        synthesize(SynthConfig(scenario=scenario, out=src / f"{name}.parquet", requests=n))
        add_trace(src / f"{name}.parquet", name, corpus=d, builds=["builtin:swa", "builtin:swa@stale-tail"])
    return d


def _stored(db: str) -> list[dict]:
    """Every stored run, without what differs between two runs of the same replay."""
    st = open_store(db)
    try:
        runs = [run_to_dict(get_run(st, r.id), details=True) for r in list_runs(st)]
    finally:
        st.close()
    for r in runs:
        for k in ("run_id", "id", "wall_s", "cpu_s", "calls_per_s", "created_at", "when", "started_at"):
            r.pop(k, None)
    return sorted(runs, key=lambda r: (r["trace"], r["build"], r["mode"]))


def test_a_trace_on_s3_replays_as_the_local_one(s3, cli, tmp_path):
    endpoint, bucket = s3
    local = ROOT / "traces" / "sglang-0.5.12-swa-tail-prealloc.parquet"
    _upload(endpoint, bucket, local, "t/seed.parquet")
    uri = f"s3://{bucket}/t/seed.parquet"
    a = cli("replay", uri, "--build", "builtin:swa@stale-tail", "--db", str(tmp_path / "r.db"), "--json")
    b = cli("replay", str(local), "--build", "builtin:swa@stale-tail", "--no-store", "--json")
    assert a.returncode == b.returncode == 1
    ra, rb = json.loads(a.stdout), json.loads(b.stdout)
    assert ra["trace"] == uri and ra["violation_counts"] == rb["violation_counts"]
    assert ra["violations"] == rb["violations"]
    shown = json.loads(cli("show", str(ra["run_id"]), "--db", str(tmp_path / "r.db"), "--json").stdout)
    assert shown["trace"] == uri  # the store names the trace by its URI, not the mirror
    # inspect reads it too; a missing key is a one-line error
    assert "169 calls" in cli("inspect", uri).stdout
    missing = cli("inspect", f"s3://{bucket}/t/nope.parquet")
    assert missing.returncode == 2 and "no such file" in missing.stderr and missing.stderr.count("\n") == 1


def test_synth_writes_to_s3(s3, cli):
    _, bucket = s3
    uri = f"s3://{bucket}/made/t.parquet"
    r = cli("synth", "decode", "--requests", "20", "-o", uri, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["path"] == uri
    assert json.loads(cli("inspect", uri, "--json").stdout)["calls"] == json.loads(r.stdout)["calls"]


@pytest.mark.slow
def test_a_hive_partitioned_dump_is_a_corpus(s3, cli, tmp_path, small_corpus):
    endpoint, bucket = s3
    dump = tmp_path / "dump"
    for host, rank, name in (("a", "0", "mtp"), ("b", "1", "radix")):
        where = dump / f"host={host}" / "date=2026-11-30" / f"rank={rank}"
        where.mkdir(parents=True)
        shutil.copy(small_corpus / f"{name}.parquet", where / "trace.parquet")
    _upload(endpoint, bucket, dump, "dump")
    uri = f"s3://{bucket}/dump"
    listed = json.loads(cli("inspect", uri, "--json").stdout)
    assert [(t["partition"]["host"], t["partition"]["rank"]) for t in listed] == [("a", "0"), ("b", "1")]
    assert all(t["partition"]["date"] == "2026-11-30" for t in listed)
    ci = cli("ci", uri, "--build", "builtin:swa", "--db", str(tmp_path / "ci.db"), "--json")
    assert ci.returncode == 0, ci.stderr
    cases = json.loads(ci.stdout)["results"]
    assert [c["case"]["partition"]["host"] for c in cases] == ["a", "b"] and all(c["outcome"] == "pass" for c in cases)
    bad = cli("ci", uri, "--build", "builtin:swa@stale-tail", "--db", "", "--json")
    assert bad.returncode == 1  # a dump has no expectations: every trace must replay clean
    m = cli("matrix", uri, "--builds", "builtin:swa,builtin:swa@stale-tail", "--db", str(tmp_path / "m.db"),
            "--json")
    parts = json.loads(m.stdout)["partitions"]
    assert sorted(p["host"] for p in parts.values()) == ["a", "b"]


def test_ci_on_s3(s3, cli, tmp_path, small_corpus):
    endpoint, bucket = s3
    _upload(endpoint, bucket, small_corpus, "corpus")
    db = str(tmp_path / "ci.db")
    r = cli("ci", f"s3://{bucket}/corpus", "--build", "builtin:swa@stale-tail", "--db", db, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    runs = _stored(db)
    assert len(runs) == 2 and all(x["trace"].startswith(f"s3://{bucket}/corpus/") for x in runs)
    assert any(x["status"] == "violation" for x in runs)  # the manifest's expectations held (exit 0)


@pytest.mark.slow
@pytest.mark.ray
def test_ci_on_s3_with_ray_stores_the_same_runs(s3, cli, tmp_path, small_corpus):
    if os.environ.get("KVREPLAY_REQUIRE_SERVICES") != "1":
        pytest.importorskip("ray")
    endpoint, bucket = s3
    _upload(endpoint, bucket, small_corpus, "corpus-ray")
    uri = f"s3://{bucket}/corpus-ray"
    plain, on_ray = str(tmp_path / "plain.db"), str(tmp_path / "ray.db")
    for build in ("builtin:swa", "builtin:swa@stale-tail"):
        a = cli("ci", uri, "--build", build, "--db", plain, "--json")
        b = cli("ci", uri, "--build", build, "--db", on_ray, "--json", "--ray")
        assert a.returncode == b.returncode == 0, b.stderr
    assert _stored(plain) == _stored(on_ray) and len(_stored(plain)) == 4
    # segments of one trace on Ray: the serial run again
    trace = tmp_path / "cp.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=trace, requests=150, checkpoint_every=600))
    serial = json.loads(cli("replay", str(trace), "--build", "builtin:swa@stale-tail", "--no-store", "--json").stdout)
    ray = json.loads(cli("replay", str(trace), "--build", "builtin:swa@stale-tail", "--no-store", "--json",
                         "--ray").stdout)
    for d in (serial, ray):
        d.pop("wall_s")
        d.pop("cpu_s")
        d.pop("calls_per_s")
    assert serial == ray
    # a matrix with a Ray task per build stores what local workers store
    m_plain = json.loads(cli("matrix", uri, "--builds", "builtin:swa,builtin:swa@stale-tail", "--db",
                             str(tmp_path / "m1.db"), "--json").stdout)
    m_ray = json.loads(cli("matrix", uri, "--builds", "builtin:swa,builtin:swa@stale-tail", "--db",
                           str(tmp_path / "m2.db"), "--json", "--ray").stdout)

    def cells(m: dict) -> list:
        return sorted((c["trace"], c["build"], c["status"], json.dumps(c["firsts"], sort_keys=True))
                      for c in m["cells"])
    assert cells(m_plain) == cells(m_ray) and len(m_ray["cells"]) == 4
    # a bisect whose steps run on Ray names the same first bad build
    b = cli("bisect", str(trace), "--builds", "builtin:swa,builtin:swa@stale-tail", "--db", str(tmp_path / "b.db"),
            "--json", "--ray")
    assert b.returncode == 0, b.stdout + b.stderr
    assert json.loads(b.stdout)["first_bad"]["spec"] == "builtin:swa@stale-tail"
