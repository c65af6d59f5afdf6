"""Captured calls as raw buffers, and how they become an Arrow table.

Both capture engines hand the writer a ``RawBatch``: the row and value headers and
the element data as flat int64 buffers (``bytes`` or ``array('q')``), plus the few
Python objects a value can refer to (floats, strings, exception texts) and the name
table the headers index. ``to_table`` builds every column with a handful of numpy
and pyarrow operations per batch, none per row. This module imports no torch, so
the writer process starts fast."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pyarrow as pa

from kvreplay.recorder.layout import (
    GROUP_TARGET_BITS,
    K_BOOL,
    K_DEFERRED,
    K_FLOAT,
    K_INT,
    K_INTS,
    K_OPAQUE,
    K_STR,
    K_TENSOR,
    ROW_BOUNDS,
    ROW_BOUNDS_TARGETS,
    ROW_FOLD_COUNT,
    ROW_FOLD_PATTERN,
    ROW_GROUP_AT,
    ROW_GROUP_TARGETS,
    ROW_WIDTH,
    VALUE_WIDTH,
)
from kvreplay.trace.format import ARG_TYPE, SCHEMA, VALUE_KINDS, VALUE_TYPE

assert VALUE_KINDS[K_OPAQUE] == "opaque" and VALUE_KINDS[K_TENSOR] == "tensor"
NULL = -(2**63)  # a counter that was not read
_I_IS_VALUE = (K_BOOL, K_INT, K_INTS)


def _kind_names() -> pa.Array:
    return _strings(list(VALUE_KINDS))


class RawValues:
    """One struct column: value headers, stored shape entries, element data, objects."""

    __slots__ = ("head", "shape", "data", "objs")

    def __init__(self, head: Any, shape: Any, data: Any, objs: list[Any]) -> None:
        self.head, self.shape, self.data, self.objs = head, shape, data, objs

    def resolve(self) -> None:
        """Put the elements of deferred device copies into ``data``, waiting for each
        copy to land. Runs on the writer's side (its thread, the sender thread, a
        flight dump), never on the recorded program's thread."""
        if not self.objs or not any(callable(getattr(o, "device_values", None)) for o in self.objs):
            return
        h = np.frombuffer(self.head, dtype=np.int64).reshape(-1, VALUE_WIDTH).copy()
        deferred = np.flatnonzero(h[:, 0] == K_DEFERRED)
        ndata = h[:, 5]
        starts = np.cumsum(ndata) - ndata  # where each value's elements go once all are present
        data = np.frombuffer(self.data, dtype=np.int64)
        pieces, prev, missing = [], 0, 0
        for r in deferred:
            at = int(starts[r]) - missing  # in data as captured, deferred values are absent
            copy = self.objs[h[r, 1]]
            pieces += [data[prev:at], copy.device_values()]
            prev, missing = at, missing + int(ndata[r])
            self.objs[h[r, 1]] = None
            h[r, 0], h[r, 1] = getattr(copy, "kind", K_TENSOR), 0
        pieces.append(data[prev:])
        self.data = np.concatenate(pieces).astype(np.int64, copy=False).tobytes()
        self.head = h.tobytes()

    # PickleBuffer: with protocol 5 and a buffer_callback the buffers travel out of
    # band, so the writer process receives them without a copy into the pickle.
    def __getstate__(self) -> tuple[Any, ...]:
        self.resolve()
        buffers = (pickle.PickleBuffer(self.head), pickle.PickleBuffer(self.shape), pickle.PickleBuffer(self.data))
        return (*buffers, self.objs)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.head, self.shape, self.data, self.objs = state

    def struct(self, strings: pa.Array, with_names: bool, order: np.ndarray | None = None) -> pa.StructArray:
        """The Arrow struct array of every value, in the order they were put, or
        permuted by ``order`` (done on the flat buffers, far cheaper than an Arrow take)."""
        self.resolve()
        h = np.frombuffer(self.head, dtype=np.int64).reshape(-1, VALUE_WIDTH)
        kind, ival, dtype, device, nshape, ndata = (h[:, k] for k in range(6))
        # A 1-D tensor or int list has shape (n,) and keeps nothing in self.shape.
        implied = (nshape == 1) & ((kind == K_TENSOR) | (kind == K_INTS))
        stored_shape = np.frombuffer(self.shape, dtype=np.int64)
        data = np.frombuffer(self.data, dtype=np.int64)
        if order is not None:
            stored_shape = _permute_parts(stored_shape, np.where(implied, 0, nshape), order)
            data = _permute_parts(data, ndata, order)
            h = h[order]
            kind, ival, dtype, device, nshape, ndata = (h[:, k] for k in range(6))
            implied = implied[order]
        n = len(h)
        kinds = _kind_names().take(_arr(kind))

        i = _arr(ival, mask=~np.isin(kind, _I_IS_VALUE))
        fvals, fmask = np.zeros(n, dtype=np.float64), kind != K_FLOAT
        svals: list[str | None] = [None] * n
        for row in np.flatnonzero(np.isin(kind, (K_FLOAT, K_STR, K_OPAQUE))):
            if kind[row] == K_FLOAT:
                fvals[row] = self.objs[ival[row]]
            else:
                svals[row] = self.objs[ival[row]]
        f = _arr(fvals, mask=fmask)
        s = _strings(svals)

        def named(ids: np.ndarray) -> pa.Array:
            return strings.take(_arr(ids, mask=ids < 0))

        shape_off = _offsets(nshape)
        shape_vals = np.empty(int(shape_off[-1]), dtype=np.int64)
        at_implied = shape_off[:-1][implied]
        shape_vals[at_implied] = ndata[implied]
        rest = np.ones(len(shape_vals), dtype=bool)
        rest[at_implied] = False
        shape_vals[rest] = stored_shape
        fields = [
            kinds, i, f, s, named(dtype), named(device),
            pa.ListArray.from_arrays(_arr(shape_off), _arr(shape_vals)),
            pa.ListArray.from_arrays(_arr(_offsets(ndata)), _arr(data)),
        ]
        if with_names:
            return pa.StructArray.from_arrays([named(h[:, 6]), *fields], fields=list(ARG_TYPE))
        return pa.StructArray.from_arrays(fields, fields=list(VALUE_TYPE))


_ARROW_TYPES = {np.dtype(np.int64): pa.int64(), np.dtype(np.int32): pa.int32(), np.dtype(np.int8): pa.int8(),
                np.dtype(np.float64): pa.float64()}


def _arr(a: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """An Arrow array over a numpy array's memory, nulls where ``mask``.

    Built from buffers rather than with ``pa.array``, which imports pandas (a third
    of a second) the first time it is called, in every writer process."""
    a = np.ascontiguousarray(a)
    validity, nulls = None, 0
    if mask is not None and mask.any():
        validity = pa.py_buffer(np.packbits(~mask, bitorder="little"))
        nulls = int(mask.sum())
    return pa.Array.from_buffers(_ARROW_TYPES[a.dtype], len(a), [validity, pa.py_buffer(a)], null_count=nulls)


def _strings(values: list[str | None]) -> pa.Array:
    """A string array, nulls where None (see ``_arr`` for why not ``pa.array``)."""
    encoded = [b"" if v is None else v.encode() for v in values]
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    mask = np.array([v is None for v in values], dtype=bool)
    validity, nulls = None, int(mask.sum())
    if nulls:
        validity = pa.py_buffer(np.packbits(~mask, bitorder="little"))
    return pa.Array.from_buffers(pa.string(), len(values),
                                 [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))], null_count=nulls)


def _permute_parts(flat: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``flat`` is the concatenation of parts of the given lengths; return the parts
    concatenated in ``order``."""
    starts = _offsets(lengths)[:-1].astype(np.int64)[order]
    lens = lengths[order]
    if not len(lens) or not lens.sum():
        return flat[:0]
    # element k of the output comes from starts[part] + (k - first output position of part)
    first = np.cumsum(lens) - lens
    return flat[np.repeat(starts - first, lens) + np.arange(int(lens.sum()))]


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def _group_targets(present: np.ndarray, packed: np.ndarray, strings: list[str]) -> pa.Array:
    """A ``folded_group_targets`` column: the packed target ids (layout.py) of the rows
    where ``present``, as the targets' names, comma-separated; null elsewhere."""
    if not present.any():
        return pa.nulls(len(present), pa.string())
    mask = (1 << GROUP_TARGET_BITS) - 1
    out: list[str | None] = []
    for there, p in zip(present.tolist(), packed.tolist(), strict=True):
        names = []
        while there and p:
            names.append(strings[(p & mask) - 1])
            p >>= GROUP_TARGET_BITS
        out.append(",".join(names) if there else None)
    return _strings(out)


class RawBatch:
    """Complete top-level calls with their nested calls, as captured.

    Arguments were put when each call started, which is ``seq`` order; the rest of a
    row when it returned, which puts nested rows before their parent. ``to_table``
    sorts the returned-order columns back into ``seq`` order."""

    __slots__ = ("rows", "arg_count", "args", "result", "excs", "strings")

    def __init__(self, rows: Any, arg_count: Any, args: RawValues, result: RawValues,
                 excs: list[tuple[str, str]], strings: list[str]) -> None:
        self.rows, self.arg_count, self.args, self.result = rows, arg_count, args, result
        self.excs, self.strings = excs, strings

    def __getstate__(self) -> tuple[Any, ...]:
        return (pickle.PickleBuffer(self.rows), pickle.PickleBuffer(self.arg_count), self.args, self.result, self.excs,
                self.strings)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.rows, self.arg_count, self.args, self.result, self.excs, self.strings = state

    def __len__(self) -> int:
        return len(memoryview(self.rows).cast("B")) // (8 * ROW_WIDTH)

    def to_table(self) -> pa.Table:
        rows = np.frombuffer(self.rows, dtype=np.int64).reshape(-1, ROW_WIDTH)
        order = np.argsort(rows[:, 0], kind="stable")  # nested rows returned before their parent
        r = rows[order]
        strings = _strings(self.strings)
        exc = r[:, 7]
        if (exc >= 0).any():
            exc_type = _strings([None if e < 0 else self.excs[e][0] for e in exc])
            exc_msg = _strings([None if e < 0 else self.excs[e][1] for e in exc])
        else:
            exc_type = exc_msg = pa.nulls(len(r), pa.string())
        cols: dict[str, pa.Array] = {
            "seq": _arr(r[:, 0]),
            "parent": _arr(r[:, 1]),
            "depth": _arr(r[:, 2].astype(np.int8)),
            "target": strings.take(_arr(r[:, 3])),
            "method": strings.take(_arr(r[:, 4])),
            "t_start_ns": _arr(r[:, 5]),
            "t_end_ns": _arr(r[:, 6]),
            "result": self.result.struct(strings, with_names=False, order=order),
            "exc_type": exc_type,
            "exc_msg": exc_msg,
            "args": pa.ListArray.from_arrays(_arr(_offsets(np.frombuffer(self.arg_count, dtype=np.int64))),
                                             self.args.struct(strings, with_names=True)),
        }
        for k, name in enumerate(("available", "full_available", "swa_available")):
            c = r[:, 8 + k]
            cols[name] = _arr(c, mask=c == NULL)
        cols["folded_reads"] = _arr(np.ascontiguousarray(r[:, ROW_FOLD_COUNT]))
        cols["folded_pattern"] = _arr(r[:, ROW_FOLD_PATTERN].astype(np.int32))
        at = r[:, ROW_GROUP_AT]
        cols["folded_group_at"] = _arr(at.astype(np.int32), mask=at < 0)
        cols["folded_group_targets"] = _group_targets(at >= 0, r[:, ROW_GROUP_TARGETS], self.strings)
        bounds = r[:, ROW_BOUNDS]
        cols["folded_group_bounds"] = _arr(bounds.astype(np.int32), mask=bounds == 0)
        cols["folded_group_bounds_targets"] = _group_targets(bounds != 0, r[:, ROW_BOUNDS_TARGETS], self.strings)
        return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA)
