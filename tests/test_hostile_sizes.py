"""Hostile input, fourth round, class 4: sizes, counts and ids a trace gives are bounded
before anything is allocated for them. Each case is bad input (exit 2, one line, no
database made), refused before a pool is built or a value decoded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

CORPUS = Path(__file__).resolve().parents[1] / "traces"
MAMBA = CORPUS / "sglang-0.5.12-mamba-stale-ping-pong.parquet"
MAMBA_LIVE = CORPUS / "live-sglang-0.5.23-lfm2-mamba-mooncake40.parquet"
VLLM_LIVE = CORPUS / "live-vllm-0.32.0-prefix-mooncake300.parquet"
SWA_FOLDED = CORPUS / "live-sglang-0.5.23-swa-speculative-mooncake24.parquet"


def _rows(path: Path, first: int | None = None) -> tuple[list[dict], pa.Schema]:
    t = pq.read_table(path)
    return t.slice(0, first).to_pylist() if first else t.to_pylist(), t.schema


def _write(rows: list[dict], schema: pa.Schema, path: Path, ctor: dict | None = None) -> Path:
    table = pa.Table.from_pylist(rows, schema=schema)
    if ctor is not None:
        md = dict(schema.metadata)
        md[b"kvreplay.ctor_args"] = json.dumps({**json.loads(md[b"kvreplay.ctor_args"]), **ctor}).encode()
        table = table.replace_schema_metadata(md)
    pq.write_table(table, path)
    return path


def _bad(res, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in res.stderr, (w, res.stderr)


def _replay_refused(cli, trace: Path, build: str, tmp_path: Path, *words: str) -> None:
    db = tmp_path / "k.db"
    _bad(cli("replay", str(trace), "-b", build, "--db", str(db)), *words)
    assert not db.exists()


def _edit(rows: list[dict], method: str, name: str, value: int | list[int], depth: int = 0) -> None:
    """The first ``method`` row at ``depth`` that gives its argument ``name`` a value gets ``value``."""
    for row in rows:
        if row["method"] == method and row["depth"] == depth:
            for a in row["args"]:
                if a["name"] == name and a["kind"] != "none":
                    if isinstance(value, list):
                        a.update(data=value, shape=[len(value)])
                    else:
                        a["i"] = value
                    return
    raise AssertionError(f"no {method} with {name}")


# -- the mamba family: the pool's sizes, request numbers, slots and counts ----------------
@pytest.mark.parametrize("size, env", [("size", "KVREPLAY_MAX_REQUEST_ROWS"),
                                       ("mamba_size", "KVREPLAY_MAX_STATE_SLOTS")])
def test_a_mamba_pool_of_2_27_rows_or_slots_is_refused_before_it_is_built(tmp_path, cli, size, env):
    rows, schema = _rows(MAMBA)
    trace = _write(rows, schema, tmp_path / "t.parquet", ctor={size: 1 << 27})
    _replay_refused(cli, trace, "builtin:mamba", tmp_path, f"{size} is 134,217,728", env)


def test_the_state_slot_bound_refuses_only_past_it(tmp_path, cli, monkeypatch):
    rows, schema = _rows(MAMBA)
    trace = _write(rows, schema, tmp_path / "t.parquet", ctor={"mamba_size": 1000})
    import kvreplay.families.mamba as fam

    monkeypatch.setattr(fam, "MAX_STATE_SLOTS", 999)
    _replay_refused(cli, trace, "builtin:mamba", tmp_path, "mamba_size is 1,000")
    monkeypatch.setattr(fam, "MAX_STATE_SLOTS", 1000)
    res = cli("replay", str(trace), "-b", "builtin:mamba", "--no-store")
    assert res.returncode in (0, 1) and "error" not in res.stderr, res.stderr


@pytest.mark.parametrize("number", [1 << 62, (1 << 63) - 1, -1, -(1 << 63)])
def test_a_request_number_near_2_62_or_negative_is_refused(tmp_path, cli, number):
    rows, schema = _rows(MAMBA)
    _edit(rows, "alloc_reqs", "requests", [number])
    _edit(rows, "free_req", "request", number)
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:mamba", tmp_path, "argument request", f"{number:,}", "a request number")


@pytest.mark.parametrize("method, name, value, depth", [
    ("alloc", "need_size", -3, 0),  # the scheduler's own allocation
    ("alloc", "need_size", -3, 1),  # one the pool made inside its call
    ("alloc", "need_size", 1 << 62, 0),
    ("alloc_group_begin", "num_reqs", -3, 0),
    ("donate_track", "slot", 1 << 62, 0),
    ("set_request", "state", -2, 0),  # -1 is "none"; below is no slot
    ("free", "free_index", [-9], 0),
    ("free_mamba_cache", "keep", 7, 0),
], ids=["need-negative", "nested-need-negative", "need-2^62", "group-negative", "slot-2^62", "state-negative",
        "free-negative", "keep-7"])
def test_a_negative_or_absurd_count_or_slot_is_refused(tmp_path, cli, method, name, value, depth):
    rows, schema = _rows(MAMBA)
    _edit(rows, method, name, value, depth)
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:mamba", tmp_path, f"argument {name} holds")


def test_a_negative_kv_length_is_refused(tmp_path, cli):
    rows, schema = _rows(MAMBA_LIVE)
    _edit(rows, "set_request", "kv_len", -(1 << 62))
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:mamba", tmp_path, "argument kv_len holds")


def test_a_list_where_a_count_belongs_is_refused(tmp_path, cli):
    rows, schema = _rows(MAMBA)
    for row in rows:
        if row["method"] == "free_req":
            arg = next(a for a in row["args"] if a["name"] == "request")
            arg.update(kind="ints", data=[1, 2], shape=[2])
            break
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:mamba", tmp_path, "argument request is 'ints', not a whole number")


def test_a_build_that_raises_on_a_request_without_a_row_answers_the_call(tmp_path, cli):
    """In range, but a request the pool never gave a row: the pool's error is its answer
    (an exception the recording did not have), not kvreplay's crash."""
    rows, schema = _rows(MAMBA)
    _edit(rows, "set_request", "request", 9999)
    _edit(rows, "set_request", "state", 5)
    later = next(i for i, r in enumerate(rows) if r["method"] == "set_request")
    row = next(r for r in rows[later:] if r["method"] == "free_mamba_cache")
    next(a for a in row["args"] if a["name"] == "request")["i"] = 9999
    trace = _write(rows, schema, tmp_path / "t.parquet")
    res = cli("replay", str(trace), "-b", "builtin:mamba", "--no-store")
    assert res.returncode == 1 and "internal error" not in res.stderr, res.stderr


@pytest.mark.parametrize("trace", [MAMBA, MAMBA_LIVE, VLLM_LIVE, *sorted(CORPUS.glob("vllm-*.parquet"))],
                         ids=lambda p: p.stem)
def test_the_corpus_traces_are_within_their_bounds(trace):
    from kvreplay.trace.reader import TraceReader

    assert TraceReader(trace).check_calls() > 0


# -- vLLM: lists of ids and hashes, hash lengths --------------------------------------------
def _replace_list(arr: pa.ListArray, j: int, values: np.ndarray) -> pa.ListArray:
    """``arr`` with list ``j`` holding ``values``, made in Arrow (no Python list of them)."""
    off = arr.offsets.to_numpy().astype(np.int64)
    flat = arr.flatten().to_numpy(zero_copy_only=False)
    body = np.concatenate([flat[:off[j]], values.astype(np.int64), flat[off[j + 1]:]])
    new_off = off.copy()
    new_off[j + 1:] += len(values) - (off[j + 1] - off[j])
    mask = arr.is_null().to_numpy(zero_copy_only=False)
    return pa.ListArray.from_arrays(pa.array(new_off, pa.int32()), pa.array(body, pa.int64()),
                                    mask=pa.array(mask) if mask.any() else None)


def _long_list(path: Path, out: Path, method: str, name: str, values: np.ndarray, depth: int = 0,
               first: int = 400) -> Path:
    """The trace's first ``first`` rows, the first ``method`` row's list argument ``name`` a
    list of ``values``, with a shape that agrees."""
    table = pq.read_table(path).slice(0, first).combine_chunks()
    methods, depths = table.column("method").to_pylist(), table.column("depth").to_pylist()
    args = table.column("args").chunk(0)
    flat = args.flatten()
    off, names, kinds = args.offsets.to_pylist(), flat.field("name").to_pylist(), flat.field("kind").to_pylist()
    j = next(k for i, (m, d) in enumerate(zip(methods, depths, strict=True)) if m == method and d == depth
             for k in range(off[i], off[i + 1]) if names[k] == name and kinds[k] in ("ints", "tensor"))
    fields = {f.name: flat.field(f.name) for f in flat.type}
    fields["data"] = _replace_list(fields["data"], j, values)
    fields["shape"] = _replace_list(fields["shape"], j, np.array([len(values)]))
    structs = pa.StructArray.from_arrays(list(fields.values()), fields=list(flat.type))
    new_args = pa.ListArray.from_arrays(args.offsets, structs, type=args.type)
    table = table.set_column(table.schema.get_field_index("args"), table.schema.field("args"), new_args)
    pq.write_table(table, out, compression="zstd")
    return out


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
@pytest.mark.parametrize("method, name, depth", [("free_blocks", "block_ids", 1),
                                                 ("get_computed_blocks", "request_hashes", 0)],
                         ids=["block-ids", "hashes"])
def test_a_vllm_list_of_tens_of_millions_is_refused_from_the_footer(tmp_path, cli, method, name, depth):
    trace = _long_list(VLLM_LIVE, tmp_path / "t.parquet", method, name, np.ones(10_000_000, np.int64), depth)
    assert trace.stat().st_size < 4 << 20
    # (from the footer's counts: no value was read, let alone decoded)
    _replay_refused(cli, trace, "builtin:vllm", tmp_path, "row group 0 lists 10,0", "KVREPLAY_MAX_GROUP_IDS")


@pytest.mark.parametrize("method, name, depth, said", [
    ("free_blocks", "block_ids", 1, "argument block_ids lists 100,000 values, more than the 1,026"),
    ("get_computed_blocks", "request_hashes", 0, "argument request_hashes lists 100,000 values"),
    ("allocate_slots", "new_computed_blocks", 0, "argument new_computed_blocks lists 100,000"),
], ids=["block-ids", "hashes", "hit"])
def test_a_vllm_list_longer_than_any_call_is_refused_before_it_is_decoded(tmp_path, cli, method, name, depth, said):
    trace = _long_list(VLLM_LIVE, tmp_path / "t.parquet", method, name, np.ones(100_000, np.int64), depth)
    _replay_refused(cli, trace, "builtin:vllm", tmp_path, said)


@pytest.mark.parametrize("value", [1 << 40, -8, 129])
def test_a_vllm_hash_length_out_of_range_is_refused(tmp_path, cli, value):
    rows, schema = _rows(VLLM_LIVE, 400)
    _edit(rows, "get_computed_blocks", "request_hash_len", value)
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:vllm", tmp_path, "argument request_hash_len holds", "KVREPLAY_MAX_HASH_BYTES")


@pytest.mark.parametrize("name, value", [("block_ids", [1 << 40]), ("block_ids", [-1]), ("num_new_tokens", -5),
                                         ("request_num_tokens", 1 << 62), ("num_blocks", 1 << 30)])
def test_a_vllm_block_id_or_count_out_of_range_is_refused(tmp_path, cli, name, value):
    rows, schema = _rows(VLLM_LIVE, 400)
    method, depth = {"block_ids": ("free_blocks", 1), "num_new_tokens": ("allocate_slots", 0),
                     "request_num_tokens": ("get_computed_blocks", 0), "num_blocks": ("get_new_blocks", 1)}[name]
    _edit(rows, method, name, value, depth)
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:vllm", tmp_path, f"argument {name} holds")


# -- folded groups and rows naming another family's pools ------------------------------------
@pytest.mark.parametrize("column, target", [("folded_group_targets", "blocks"),
                                            ("folded_group_bounds_targets", "state"),
                                            ("folded_group_targets", "full,blocks")])
def test_a_folded_group_naming_another_familys_pool_is_refused(tmp_path, cli, column, target):
    rows, schema = _rows(SWA_FOLDED)
    row = next(r for r in rows if r[column] is not None)
    row[column] = target
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:swa", tmp_path, "folded free group names sub-allocators", "full, swa")


@pytest.mark.parametrize("column", ["folded_group_targets", "folded_group_bounds_targets"])
def test_a_folded_group_naming_millions_of_pools_is_refused_from_the_footer(tmp_path, cli, column):
    rows, schema = _rows(SWA_FOLDED)
    next(r for r in rows if r[column] is not None)[column] = "full," * (4 << 20)  # 20 MB, a few KB packed
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:swa", tmp_path, f"bytes of {column}", "more than names of pools can")


def test_a_row_targeting_another_familys_pool_is_refused(tmp_path, cli):
    rows, schema = _rows(SWA_FOLDED)
    next(r for r in rows if r["depth"] == 1)["target"] = "state"
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:swa", tmp_path, "rows target 'state', a pool of another family")


def test_a_shape_of_a_million_dimensions_is_refused_before_its_product(tmp_path, cli):
    """Its product is a Python int: minutes of arithmetic (and a message of megabytes)."""
    rows, schema = _rows(CORPUS / "sglang-0.5.23-swa-page0.parquet")
    arg = next(a for r in rows if r["depth"] == 0 for a in r["args"] if a["kind"] == "tensor" and a["data"])
    arg["shape"] = [3] * 1_000_000
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _replay_refused(cli, trace, "builtin:swa", tmp_path, "a tensor of 1,000,000 dimensions")


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
# -- peak memory, measured ----------------------------------------------------------------------
def test_the_largest_refusal_stays_far_under_a_gigabyte(tmp_path):
    """12 million block ids in one call: refused in a process capped at 3 GB of address
    space, at a peak resident size well under 1 GB."""
    trace = _long_list(VLLM_LIVE, tmp_path / "t.parquet", "free_blocks", "block_ids", np.ones(12_000_000, np.int64),
                       depth=1)
    launch = ("import os, resource, sys; cap = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (cap, cap)); "
              "pid = os.posix_spawn(sys.executable, [sys.executable, '-m', 'kvreplay.cli.app', *sys.argv[3:]], "
              "os.environ); _, status, usage = os.wait4(pid, 0); open(sys.argv[2], 'w').write(str(usage.ru_maxrss)); "
              "sys.exit(os.waitstatus_to_exitcode(status))")
    report, db = tmp_path / "maxrss", tmp_path / "k.db"
    res = subprocess.run([sys.executable, "-c", launch, str(3 << 30), str(report), "replay", str(trace), "-b",
                          "builtin:vllm", "--db", str(db)], capture_output=True, text=True, timeout=120)
    _bad(res, "row group 0 lists 12,0")
    assert not db.exists()
    assert int(report.read_text()) < 1 << 20, f"peak RSS {int(report.read_text()) >> 10} MB"
