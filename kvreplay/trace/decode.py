"""Decoding a batch of trace rows into Calls: index data straight from the Arrow
buffers into tensors (one tensor per batch and column, sliced per value), the
rarer value kinds through ``decode_value``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from kvreplay.trace.format import (
    BOOL,
    COUNTERS,
    FLOAT,
    INT,
    INTS,
    NONE,
    OPAQUE,
    SEGMENTS,
    STR,
    TENSOR,
    Call,
    Opaque,
)


class _Values:
    """One struct column of values (``args`` elements or ``result``), decoded column-wise:
    a tensor value is a slice of a single per-batch tensor, not a new allocation."""

    def __init__(self, arr: pa.Array, device: str | torch.device) -> None:
        fields = dict(zip([f.name for f in arr.type], arr.flatten(), strict=True))
        self.kind = fields["kind"].to_pylist()
        self.i = fields["i"].to_pylist()
        self.f = fields["f"].to_pylist()
        self.s = fields["s"].to_pylist()
        self.dtype = fields["dtype"].to_pylist()
        self.shape_off, self.shape = _list_parts(fields["shape"])
        self.shape = self.shape.tolist()
        self.data_off, data = _list_parts(fields["data"])
        self.data = torch.from_numpy(data).to(device)
        self.device = device

    def get(self, j: int) -> Any:
        kind = self.kind[j]
        if kind == TENSOR:
            t = self.data[self.data_off[j]:self.data_off[j + 1]]
            shape = self.shape[self.shape_off[j]:self.shape_off[j + 1]]
            if math.prod(shape) != len(t) or any(d < 0 for d in shape):
                raise ValueError(f"a tensor of shape {shape} holds {len(t)} values")
            dtype = self.dtype[j]
            if dtype != "torch.int64":
                t = t.to(tensor_dtype(dtype))
            return t if len(shape) == 1 else t.reshape(shape)
        if kind == NONE:
            return None
        if kind == INT:
            return self.i[j]
        # The rarer kinds take the general decoder.
        return decode_value({
            "kind": kind, "i": self.i[j], "f": self.f[j], "s": self.s[j], "dtype": self.dtype[j],
            "shape": self.shape[self.shape_off[j]:self.shape_off[j + 1]],
            "data": self.data[self.data_off[j]:self.data_off[j + 1]].tolist(),
        }, self.device)


def _list_parts(arr: pa.Array) -> tuple[list[int], np.ndarray]:
    """Offsets (from 0) and flat int64 values of a list<int64> array."""
    off = arr.offsets.to_numpy()
    # A writable copy: replayed tensors are views into it, and a build may write to its arguments.
    values = np.array(arr.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
    return (off - off[0]).tolist(), values


def decode_batch(batch: pa.RecordBatch, top_level_only: bool, device: str | torch.device) -> Iterator[Call]:
    col = batch.column
    names = batch.schema.names
    seq = col(names.index("seq")).to_pylist()
    depth = col(names.index("depth")).to_pylist()
    parent = col(names.index("parent")).to_pylist()
    target = col(names.index("target")).to_pylist()
    method = col(names.index("method")).to_pylist()
    t0 = col(names.index("t_start_ns")).to_pylist()
    t1 = col(names.index("t_end_ns")).to_pylist()
    exc_type = col(names.index("exc_type")).to_pylist()
    exc_msg = col(names.index("exc_msg")).to_pylist()
    counters = {k: col(names.index(k)).to_pylist() for k in COUNTERS}
    args = col(names.index("args"))
    arg_off = args.offsets.to_numpy()
    arg_off = (arg_off - arg_off[0]).tolist()
    flat_args = args.flatten()
    arg_names = flat_args.flatten()[flat_args.type.get_field_index("name")].to_pylist()
    av = _Values(flat_args, device)
    rv = _Values(col(names.index("result")), device)
    for r in range(batch.num_rows):
        if top_level_only and depth[r] != 0:
            continue
        lo, hi = arg_off[r], arg_off[r + 1]
        yield Call(
            seq=seq[r], parent=parent[r], depth=depth[r], target=target[r], method=method[r],
            args={arg_names[j]: av.get(j) for j in range(lo, hi)},
            has_opaque=OPAQUE in av.kind[lo:hi],
            result=rv.get(r),
            exc_type=exc_type[r], exc_msg=exc_msg[r],
            counters={k: v[r] for k, v in counters.items()},
            t_start_ns=t0[r], t_end_ns=t1[r],
        )


# -- values -----------------------------------------------------------------------

_DTYPES = {str(d): d for d in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def decode_value(v: dict[str, Any] | None, device: str | torch.device = "cpu") -> Any:
    """Turn one value struct (as ``to_pylist`` gives it) back into a Python value."""
    if v is None:
        return None
    kind = v["kind"]
    if kind == NONE:
        return None
    if kind == BOOL:
        return bool(v["i"])
    if kind == INT:
        return v["i"]
    if kind == FLOAT:
        return v["f"]
    if kind == STR:
        return v["s"]
    if kind == TENSOR:
        return _tensor(v["data"], v["dtype"], device).reshape(v["shape"])
    if kind == INTS:
        return tuple(v["data"]) if v["i"] else list(v["data"])
    if kind == SEGMENTS:
        out, pos, shape = [], 0, v["shape"]
        dtypes = v["dtype"].split(",")
        for k in range(0, len(shape), 2):
            n, start = shape[k], shape[k + 1]
            dtype = dtypes[k // 2] if len(dtypes) > 1 else dtypes[0]
            out.append((_tensor(v["data"][pos:pos + n], dtype, device), start))
            pos += n
        return out
    return Opaque(v["s"])


def tensor_dtype(name: str) -> torch.dtype:
    return _DTYPES.get(name, torch.int64)


def _tensor(data: list[int], dtype: str, device: str | torch.device) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.int64, device=device).to(tensor_dtype(dtype))
