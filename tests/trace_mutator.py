"""A seeded mutator of traces and corpus manifests, for the fuzz tests.

Each mutation damages one thing the way a broken recorder, a truncated copy, a bit
flip or a hostile author would: a cell, a column's type, the footer's metadata, the
file's bytes, a manifest key or value. ``mutate_trace(rng, table, path)`` writes the
damaged trace to ``path`` and returns what it did, so a failing case can be named
and rebuilt from its seed."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

WILD_INTS = [-1, -(2**62), 2**62, 2**31, 0, 1, 7, 4000, 10**12]
WILD_STRINGS = ["", "__init__", "__class__", "__setattr__", "alloc_extend[/red]", "[/]", "x" * 300, "free\nfree",
                "torch.float32", "nope", "gap", "recorder", "root", "swa", "full"]
WILD_JSON = ["[]", "3", "\"x\"", "null", "{\"size\": -4}", "{\"size\": \"big\"}", "{", "{\"format\": 1}",
             "{\"format\": 1, \"objects\": {\"root\": {\"free_pages\": {\"tensor\": \"float99\", \"shape\": [1], "
             "\"z\": \"eJw=\"}}}}",
             "{\"format\": 1, \"objects\": {\"root\": {\"free_pages\": {\"tensor\": \"int64\", \"shape\": [2], "
             "\"z\": \"not-base64!\"}}}}",
             # second round: nesting past any parser's stack, integers too long to convert, a type name
             # that is an attribute of torch, a shape that declares gigabytes
             "{\"a\": " * 3000 + "1" + "}" * 3000, "{\"size\": " + "9" * 5000 + "}",
             "{\"format\": 1, \"objects\": {\"full\": {\"free_pages\": {\"tensor\": \"load\", \"shape\": [1], "
             "\"z\": \"eJw=\"}}}}",
             "{\"format\": 1, \"objects\": {\"full\": {\"free_pages\": {\"tensor\": \"int64\", "
             "\"shape\": [100000, 100000], \"z\": \"eJw=\"}}}}"]


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return table.to_pylist()


def _rebuild(rows: list[dict[str, Any]], table: pa.Table) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=table.schema)


def _cell(rng: random.Random, table: pa.Table) -> tuple[pa.Table, str]:
    rows = _rows(table)
    if not rows:
        return table, "no rows to damage"
    r = rng.randrange(len(rows))
    row = rows[r]
    what = rng.choice(["method", "target", "depth", "seq", "parent", "arg-data", "arg-shape", "arg-kind",
                       "arg-dtype", "arg-name", "arg-drop", "arg-none", "result", "counter", "exc", "fold"])
    if what in ("method", "target"):
        row[what] = rng.choice(WILD_STRINGS)
    elif what in ("depth",):
        row[what] = rng.choice([-1, 5, 65, 127, 1])
    elif what in ("seq", "parent"):
        row[what] = rng.choice(WILD_INTS)
    elif what == "counter":
        row[rng.choice(["available", "full_available", "swa_available"])] = rng.choice(WILD_INTS)
    elif what == "exc":
        row["exc_type"] = rng.choice(WILD_STRINGS)
    elif what == "fold":  # counter reads folded into the row: how many, which (trace format 2)
        if "folded_reads" not in row:
            return table, "no fold columns (format 1)"
        row["folded_reads"] = rng.choice([*WILD_INTS, 3, 1 << 24, None])
        row["folded_pattern"] = rng.choice([0, 1, 2, 14, 57, 5, 10, -3, 2**31 - 1, None])
    elif what == "result":
        res = row["result"] or {"kind": "none"}
        res["kind"] = rng.choice(["none", "int", "tensor", "opaque", "segments", "ints", "bogus"])
        res["data"] = [rng.choice(WILD_INTS) for _ in range(rng.randrange(4))]
        res["shape"] = [rng.choice([0, 1, 3, 100])]
        row["result"] = res
    else:
        args = row["args"]
        if not args:
            return _rebuild(rows, table), f"row {r}: no args"
        a = args[rng.randrange(len(args))]
        if what == "arg-data":
            a["data"] = [rng.choice(WILD_INTS) for _ in range(max(1, len(a["data"] or [])))]
        elif what == "arg-shape":
            a["shape"] = [rng.choice([0, 1, 3, 1000, -1])]
        elif what == "arg-kind":
            a["kind"] = rng.choice(["none", "str", "float", "int", "tensor", "ints", "segments", "bogus"])
            a["s"], a["f"] = "nan", float("nan")
        elif what == "arg-dtype":
            a["dtype"] = rng.choice(["torch.float32", "torch.bool", "garbage", None, "torch.int8"])
        elif what == "arg-name":
            a["name"] = rng.choice(["page_ids", "free_idx", "x=__import__('os')", "", "indices", "segments"])
        elif what == "arg-drop":
            args.remove(a)
        elif what == "arg-none":
            a.update(kind="none", data=None, shape=None)
    return _rebuild(rows, table), f"row {r}: {what}"


def _rows_bulk(rng: random.Random, table: pa.Table) -> tuple[pa.Table, str]:
    what = rng.choice(["empty", "reverse", "shuffle", "duplicate", "truncate-rows", "negate-seq"])
    rows = _rows(table)
    if what == "empty":
        rows = []
    elif what == "reverse":
        rows.reverse()
    elif what == "shuffle":
        rng.shuffle(rows)
    elif what == "duplicate":
        rows = rows + rows
    elif what == "truncate-rows":
        rows = rows[: rng.randrange(len(rows) + 1)]
    else:
        for row in rows:
            row["seq"] = -1 - row["seq"]
    return _rebuild(rows, table), f"rows: {what}"


def _column_type(rng: random.Random, table: pa.Table) -> tuple[pa.Table, str]:
    name = rng.choice(["depth", "seq", "method", "target", "available", "parent", "t_start_ns"])
    col = table.column(name)
    if pa.types.is_string(col.type):
        new = pa.array([len(x or "") for x in col.to_pylist()], type=pa.int64())
    else:
        new = pa.array([str(x) for x in col.to_pylist()], type=pa.string())
    i = table.schema.get_field_index(name)
    meta = table.schema.metadata
    return table.set_column(i, pa.field(name, new.type), new).replace_schema_metadata(meta), f"column {name} retyped"


def _metadata(rng: random.Random, table: pa.Table) -> tuple[pa.Table, str]:
    md = dict(table.schema.metadata or {})
    key = rng.choice(["family", "ctor_args", "initial_state", "extra", "source_version", "schema_version",
                      "pool_class", "pid", "drop"])
    if key == "drop":
        victim = rng.choice(sorted(md))
        del md[victim]
        return table.replace_schema_metadata(md), f"metadata {victim!r} dropped"
    if key == "family":
        value = rng.choice(["tokn", "", "swa", "paged", "token"])
    elif key == "ctor_args":
        args = json.loads(md[b"kvreplay.ctor_args"])
        args[rng.choice(list(args))] = rng.choice([-5, "big", None, "false", 2**62, 1.5, [1]])
        value = rng.choice([json.dumps(args), rng.choice(WILD_JSON)])
    elif key in ("initial_state", "extra", "source_version"):
        value = rng.choice(WILD_JSON)
    elif key == "schema_version":
        value = rng.choice(["99", "x", "-1", "0"])
    elif key == "pid":
        value = rng.choice(["x", "-1", ""])
    else:
        value = rng.choice(["sglang.srt.evil:Pool", "os:system", "", "kvreplay.families.sglang.swa:SWAPool"])
    md[f"kvreplay.{key}".encode()] = value.encode()
    return table.replace_schema_metadata(md), f"metadata {key} = {value[:40]!r}"


MUTATIONS: list[Callable[[random.Random, pa.Table], tuple[pa.Table, str]]] = [
    _cell, _cell, _cell, _cell, _rows_bulk, _column_type, _metadata, _metadata,
]


def mutate_trace(rng: random.Random, table: pa.Table, path: Path) -> str:
    """Write a damaged copy of ``table`` to ``path``; returns what was damaged."""
    if rng.random() < 0.15:  # damage the bytes of a well-formed file
        pq.write_table(table, path)
        data = bytearray(path.read_bytes())
        how = rng.choice(["truncate", "flip", "zero-footer"])
        if how == "truncate":
            data = data[: rng.randrange(len(data))]
        elif how == "flip":
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            data[-rng.randrange(9, 64):-8] = bytes(len(data[-rng.randrange(9, 64):-8]))
        path.write_bytes(bytes(data))
        return f"bytes: {how}"
    damaged, what = rng.choice(MUTATIONS)(rng, table)
    pq.write_table(damaged, path)
    return what


def mutate_manifest(rng: random.Random, doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A damaged copy of a manifest document; returns it and what was damaged."""
    doc = json.loads(json.dumps(doc))
    entry = rng.choice(doc["traces"])
    what = rng.choice(["rename-key", "modes-string", "dup-name", "path-escape", "absolute", "string-entry",
                       "wrong-hash", "newline-name", "long-name", "bad-status", "seq-key", "call-type",
                       "unknown-invariant", "version", "directory"])
    if what == "rename-key":
        exp = entry["expect"][0]
        exp["mode"] = exp.pop("modes", ["strict"])
    elif what == "modes-string":
        entry["expect"][0]["modes"] = "strict"
    elif what == "dup-name":
        doc["traces"].append(json.loads(json.dumps(entry)))
    elif what == "path-escape":
        entry["file"] = "../" + entry["file"]
    elif what == "absolute":
        entry["file"] = "/etc/passwd"
    elif what == "string-entry":
        doc["traces"].append("just a string")
    elif what == "wrong-hash":
        entry["sha256"] = "0" * 64
    elif what == "newline-name":
        entry["name"] = "a\nb"
    elif what == "long-name":
        entry["name"] = "n" * 300
    elif what == "bad-status":
        entry["expect"][0]["status"] = "fine"
    elif what == "seq-key":
        entry["expect"][0]["capacity_assert_seq"] = 5
    elif what == "call-type":
        entry["expect"][0]["violations"] = [{"invariant": "ownership", "call": "12"}]
    elif what == "unknown-invariant":
        entry["expect"][0]["status"] = "violation"
        entry["expect"][0]["violations"] = [{"invariant": "ownersip"}]
    elif what == "version":
        doc["version"] = rng.choice([1, 99, "2"])
    else:
        entry["file"] = "."
    return doc, what
