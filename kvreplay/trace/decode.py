"""Decoding a batch of trace rows into Calls: index data straight from the Arrow
buffers into tensors (one tensor per batch and column, sliced per value), the
rarer value kinds through ``decode_value``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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
    TENSOR_DTYPES,
    Call,
    Opaque,
)

# A recorded tensor's dimensions: pools' index tensors have one or two. The product of a
# shape's dimensions is a Python int, so a 10^6-dimension shape is minutes of arithmetic
# from a few KB of trace, and its message megabytes.
MAX_TENSOR_DIMS = 64



def _decode_tensors(values: list[Any], tensors: np.ndarray, fields: dict[str, Any], shape_off: np.ndarray,
                    shape: np.ndarray, data_off: np.ndarray, views: _Views) -> None:
    """The tensor values into ``values``: plain 1-d int64 ones as views split in one call,
    the others (other shapes, other dtypes) one by one."""
    ndim = np.diff(shape_off)[tensors]
    plain = (ndim == 1) & _where_mask(fields["dtype"], "torch.int64")[tensors]
    simple = tensors[plain]
    if len(simple):
        length = np.diff(data_off)[simple]
        if (shape[shape_off[simple]] != length).any():
            j = int(simple[np.flatnonzero(shape[shape_off[simple]] != length)[0]])
            raise ValueError(f"a tensor of shape {shape[shape_off[j]:shape_off[j + 1]].tolist()} "
                             f"holds {int(length[simple == j][0])} values")
        for j, t in zip(simple.tolist(), views.many(simple), strict=True):
            values[j] = t
    dtypes = fields["dtype"]
    for j in tensors[~plain].tolist():
        if shape_off[j + 1] - shape_off[j] > MAX_TENSOR_DIMS:  # before the product of them all
            raise ValueError(f"a tensor of {int(shape_off[j + 1] - shape_off[j]):,} dimensions (at most "
                             f"{MAX_TENSOR_DIMS})")
        dims = shape[shape_off[j]:shape_off[j + 1]].tolist()
        t = views[j]
        if math.prod(dims) != len(t) or any(d < 0 for d in dims):
            raise ValueError(f"a tensor of shape {dims} holds {len(t)} values")
        dtype = dtypes[j].as_py()
        if dtype != "torch.int64":
            t = t.to(tensor_dtype(dtype))
        values[j] = t if len(dims) == 1 else t.reshape(dims)


class _Values:
    """One struct column of values (``args`` elements or ``result``), decoded column-wise
    into ``values``: index tensors are views of one per-batch tensor, split in a single
    call, and ints come straight from the column; only the rarer kinds (bools, floats,
    strings, segment lists, opaque values, other dtypes or shapes) are decoded one by one."""

    def __init__(self, arr: pa.Array, device: str | torch.device, wanted: np.ndarray | None = None) -> None:
        """``wanted``: which values to decode (the others stay raw: a caller that has
        no use for them, such as a replay for nested rows' arguments, saves the work)."""
        fields = dict(zip([f.name for f in arr.type], arr.flatten(), strict=True))
        n = len(arr)
        kind = fields["kind"]
        self.kind = kind.to_pylist()
        self.opaque = _where(kind, OPAQUE)
        shape_off, shape = _list_parts(fields["shape"])
        data_off, data = _list_parts(fields["data"])
        if n and (len(data_off) != n + 1 or len(shape_off) != n + 1):
            raise ValueError("value lists do not line up with their values")
        flat = torch.from_numpy(data).to(device)
        views = _Views(flat, data_off)
        values: list[Any] = fields["i"].to_pylist()
        for j in _where(kind, NONE):
            values[j] = None
        tensors = _where(kind, TENSOR)
        if wanted is not None:
            tensors = tensors[wanted[tensors]]
        if len(tensors):
            _decode_tensors(values, tensors, fields, shape_off, shape, data_off, views)
        rare = np.flatnonzero(pc.invert(pc.is_in(kind, value_set=_COMMON)).to_numpy(zero_copy_only=False)) \
            if n else _NO_ROWS
        if wanted is not None:
            rare = rare[wanted[rare]]
        if len(rare):
            self._decode_rare(values, rare, fields, shape_off, shape, data_off, data, views, device)
        self.values = values

    def _decode_rare(self, values: list[Any], rare: np.ndarray, fields: dict[str, Any], shape_off: np.ndarray,
                     shape: np.ndarray, data_off: np.ndarray, data: np.ndarray, views: _Views,
                     device: str | torch.device) -> None:
        """The rarer kinds of value, one by one."""
        f, s, dtype = fields["f"], fields["s"], fields["dtype"]
        # A vLLM trace's values are mostly strings (request ids, statuses), flags and id
        # lists: those come from whole columns, not from a per-value Arrow lookup.
        kinds, strs, floats = self.kind, None, None
        for j in rare.tolist():
            k = kinds[j]
            if k == STR:
                strs = s.to_pylist() if strs is None else strs
                values[j] = strs[j]
                continue
            if k == INTS:
                n_ids = int(data_off[j + 1] - data_off[j])
                if shape_off[j + 1] - shape_off[j] != 1 or shape[shape_off[j]] != n_ids:
                    raise ValueError(f"an id list of shape {shape[shape_off[j]:shape_off[j + 1]][:4].tolist()} "
                                     f"holds {n_ids} values")
                ids = data[data_off[j]:data_off[j + 1]].tolist()
                values[j] = tuple(ids) if values[j] else ids
                continue
            if k == BOOL:
                values[j] = bool(values[j])
                continue
            if k == FLOAT:
                floats = f.to_pylist() if floats is None else floats
                values[j] = floats[j]
                continue
            values[j] = decode_value({
                "kind": self.kind[j], "i": values[j], "f": f[j].as_py(), "s": s[j].as_py(),
                "dtype": dtype[j].as_py(), "shape": shape[shape_off[j]:shape_off[j + 1]].tolist(),
                "data": views[j],
            }, device)


class _Views:
    """Slices of a batch's index data, one per value: ``many`` makes those of many
    values in one ``split`` call (a Python-level slice per value costs more than the
    rest of decoding)."""

    def __init__(self, flat: torch.Tensor, off: np.ndarray) -> None:
        self.flat, self.off = flat, off

    def __getitem__(self, j: int) -> torch.Tensor:
        return self.flat[int(self.off[j]):int(self.off[j + 1])]

    def many(self, js: np.ndarray) -> list[torch.Tensor]:
        starts, ends = self.off[js], self.off[js + 1]
        if len(js) and (np.diff(starts) < 0).any():
            return [self[j] for j in js.tolist()]
        # Chunk edges: every value's start and end; empty values and the data between
        # values (segment lists, int lists) become chunks of their own, not views.
        edges = np.unique(np.concatenate([[0], starts, ends, [len(self.flat)]]))
        chunks = self.flat.split(np.diff(edges).tolist())
        at = np.searchsorted(edges, starts)
        empty = starts == ends
        return [self.flat[s:s] if e else chunks[k] for k, s, e in zip(at.tolist(), starts.tolist(), empty.tolist(),
                                                                        strict=True)]


_COMMON = pa.array([NONE, INT, TENSOR])
_NO_ROWS = np.empty(0, dtype=np.int64)


def _where_mask(col: pa.Array, value: str) -> np.ndarray:
    return pc.fill_null(pc.equal(col, value), False).to_numpy(zero_copy_only=False)


def _where(col: pa.Array, value: str) -> np.ndarray:
    return np.flatnonzero(_where_mask(col, value))


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (from 0) and flat int64 values of a list<int64> array."""
    off = arr.offsets.to_numpy()
    flat = arr.flatten()
    if flat.null_count:  # damaged definition levels: a null would become an arbitrary integer
        raise ValueError("a value list holds a null")
    # A writable copy: replayed tensors are views into it, and a build may write to its arguments.
    values = np.array(flat.to_numpy(zero_copy_only=False), dtype=np.int64)
    return off - off[0], values


def decode_batch(batch: pa.RecordBatch, top_level_only: bool, device: str | torch.device,
                 nested_args: bool = True) -> Iterator[Call]:
    """The batch's calls; ``nested_args=False``: nested rows come without arguments
    (a replay compares what sub-allocator calls returned, never what they were given)."""
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
    avail, full_avail, swa_avail = (col(names.index(k)).to_pylist() for k in COUNTERS)
    folded = col(names.index("folded_reads")).fill_null(0).to_pylist()
    pattern = col(names.index("folded_pattern")).to_pylist()
    group_at = col(names.index("folded_group_at")).to_pylist()
    group_targets = col(names.index("folded_group_targets")).to_pylist()
    group_bounds = col(names.index("folded_group_bounds")).to_pylist()
    bounds_targets = col(names.index("folded_group_bounds_targets")).to_pylist()
    args = col(names.index("args"))
    arg_off = args.offsets.to_numpy()
    arg_off = arg_off - arg_off[0]
    flat_args = args.flatten()
    arg_names = flat_args.flatten()[flat_args.type.get_field_index("name")].to_pylist()
    wanted = None
    if not nested_args:
        top = np.asarray(depth) == 0
        wanted = np.repeat(top, np.diff(arg_off))
    av = _Values(flat_args, device, wanted)
    rv = _Values(col(names.index("result")), device)
    values, results = av.values, rv.values
    opaque_rows = set((np.searchsorted(arg_off, av.opaque, side="right") - 1).tolist()) if len(av.opaque) else ()
    bounds = arg_off.tolist()
    for r in range(batch.num_rows):
        if top_level_only and depth[r] != 0:
            continue
        lo, hi = bounds[r], bounds[r + 1]
        args = dict(zip(arg_names[lo:hi], values[lo:hi], strict=True)) if nested_args or not depth[r] else {}
        yield Call(seq[r], parent[r], depth[r], target[r], method[r], args, results[r], exc_type[r], exc_msg[r],
                   {"available": avail[r], "full_available": full_avail[r], "swa_available": swa_avail[r]},
                   t0[r], t1[r], r in opaque_rows, folded[r], pattern[r], group_at[r], group_targets[r],
                   group_bounds[r], bounds_targets[r])


# -- values -----------------------------------------------------------------------

_DTYPES = {name: getattr(torch, name.removeprefix("torch.")) for name in TENSOR_DTYPES}


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
        data = v["data"].tolist() if isinstance(v["data"], torch.Tensor) else v["data"]
        return tuple(data) if v["i"] else list(data)
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


def _tensor(data: Any, dtype: str, device: str | torch.device) -> torch.Tensor:
    """``data``: a list of ints or an int64 tensor (a view of the batch's index data)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=torch.int64, device=device)
    dt = tensor_dtype(dtype)
    return t if dt == torch.int64 else t.to(dt)
