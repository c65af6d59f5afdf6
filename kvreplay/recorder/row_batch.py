"""Calls as the recorder captures them: flat int64 buffers, turned into Arrow later.

The recording thread pays for every row, so it does the least work that keeps the
values as they were at the time of the call: each value becomes a fixed-width
header of seven integers and its elements are copied into one flat data buffer.
All buffers are ``array.array('q')``, which the garbage collector does not scan:
holding a few thousand rows of Python lists and tensors made the collector walk
them on every generation-2 pass and cost more than the copying itself. Everything
else (names, null masks, list offsets, the Arrow struct arrays) is built by
``to_table`` on the writer thread with numpy, a handful of operations per batch
rather than per row."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from kvreplay.recorder.trace_format import ARG_TYPE, SCHEMA, VALUE_KINDS, VALUE_TYPE

# Value kind codes: positions in VALUE_KINDS.
K_NONE, K_BOOL, K_INT, K_FLOAT, K_STR, K_TENSOR, K_INTS, K_SEGMENTS, K_OPAQUE = range(9)
assert VALUE_KINDS[K_OPAQUE] == "opaque" and VALUE_KINDS[K_TENSOR] == "tensor"

VALUE_WIDTH = 7  # kind, i, dtype id, device id, shape length, data length, name id
ROW_WIDTH = 11  # seq, parent, depth, target id, method id, t0, t1, exception id, three counters
NULL = -(2**63)  # a counter that was not read
SMALL_TENSOR = 64  # up to this many elements, tolist() is the cheapest copy
_INT64 = (-(2**63), 2**63 - 1)
_I_IS_VALUE = (K_BOOL, K_INT, K_INTS)


class Names:
    """Strings a batch refers to by number (targets, methods, argument names, dtypes,
    devices). One per recording, shared by its batches; it only ever grows."""

    def __init__(self) -> None:
        self.strings: list[str] = []
        self._ids: dict[str, int] = {}
        self.dtypes: dict[torch.dtype, int] = {}
        self.devices: dict[torch.device, int] = {}
        # dtypes whose elements fit int64 losslessly; any other tensor is recorded as opaque
        self.int_dtypes = {d: self.dtype(d) for d in (torch.int64, torch.int32, torch.int16, torch.int8,
                                                      torch.uint8, torch.bool)}

    def id(self, s: str) -> int:
        i = self._ids.get(s)
        if i is None:
            i = self._ids[s] = len(self.strings)
            self.strings.append(s)
        return i

    def dtype(self, d: torch.dtype) -> int:
        i = self.dtypes.get(d)
        if i is None:
            i = self.dtypes[d] = self.id(str(d))
        return i

    def device(self, d: torch.device) -> int:
        i = self.devices.get(d)
        if i is None:
            i = self.devices[d] = self.id(str(d))
        return i


class ValueBuffer:
    """One struct column of values (argument elements or results)."""

    __slots__ = ("head", "shape", "data", "objs", "names", "_int_dtypes", "_cpu")

    def __init__(self, names: Names) -> None:
        self.head = array("q")
        self.shape = array("q")  # shape entries of values whose shape is not just (n,)
        self.data = array("q")
        self.objs: list[Any] = []  # floats and strings, referred to by the header's i
        self.names = names
        self._int_dtypes = names.int_dtypes
        self._cpu = names.device(torch.device("cpu"))

    def __len__(self) -> int:
        return len(self.head) // VALUE_WIDTH

    def put(self, v: Any, name: int = -1) -> None:
        tp = type(v)
        if tp is torch.Tensor:
            dtype = self._int_dtypes.get(v.dtype)
            if dtype is None:  # floating point or complex: not an index tensor
                self._opaque(f"{v.dtype} tensor {tuple(v.shape)}", name, self.names.dtype(v.dtype))
                return
            nd = v.dim()
            n = v.numel()
            if v.is_cpu:
                self.head.extend((K_TENSOR, 0, dtype, self._cpu, nd, n, name))
            else:
                self.head.extend((K_TENSOR, 0, dtype, self.names.device(v.device), nd, n, name))
                v = v.cpu()
            if nd != 1:
                self.shape.extend(v.shape)
                v = v.reshape(-1)
            if n <= SMALL_TENSOR:
                self.data.extend(v.tolist())
            else:
                self.data.frombytes(v.numpy().astype(np.int64, copy=False).tobytes())
        elif v is None:
            self.head.extend((K_NONE, 0, -1, -1, 0, 0, name))
        elif tp is int:
            if _INT64[0] <= v <= _INT64[1]:
                self.head.extend((K_INT, v, -1, -1, 0, 0, name))
            else:
                self._opaque(repr(v), name)
        elif tp is bool:
            self.head.extend((K_BOOL, v, -1, -1, 0, 0, name))
        elif tp is float:
            self.head.extend((K_FLOAT, len(self.objs), -1, -1, 0, 0, name))
            self.objs.append(v)
        elif tp is str:
            self.head.extend((K_STR, len(self.objs), -1, -1, 0, 0, name))
            self.objs.append(v)
        elif (tp is list or tp is tuple) and all(type(x) is int and _INT64[0] <= x <= _INT64[1] for x in v):
            self.head.extend((K_INTS, tp is tuple, -1, -1, 1, len(v), name))
            self.data.extend(v)
        elif (tp is list or tp is tuple) and v and all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], torch.Tensor) for x in v
        ):
            self._segments(v, name)
        elif isinstance(v, torch.Tensor):  # a tensor subclass (e.g. a Parameter)
            self.put(v.as_subclass(torch.Tensor), name)
        else:
            self._opaque(repr(v)[:200], name)

    def _opaque(self, text: str, name: int, dtype: int = -1) -> None:
        self.head.extend((K_OPAQUE, len(self.objs), dtype, -1, 0, 0, name))
        self.objs.append(text)

    def _segments(self, v: Any, name: int) -> None:
        # (tensor, start_pos) pairs: shape holds n0, start0, n1, start1, ...
        names = self.names
        dtypes = [str(t.dtype) for t, _ in v]
        dtype = names.id(",".join(dtypes) if len(set(dtypes)) > 1 else dtypes[0])
        parts = [t.detach().reshape(-1).cpu().numpy().astype(np.int64) for t, _ in v]
        total = sum(len(p) for p in parts)
        self.head.extend((K_SEGMENTS, 0, dtype, names.device(v[0][0].device), 2 * len(v), total, name))
        for p, (_, start) in zip(parts, v, strict=True):
            self.shape.extend((len(p), int(start)))
            self.data.frombytes(p.tobytes())

    def struct(self, with_names: bool) -> pa.StructArray:
        """The Arrow struct array of every value, in the order they were put."""
        strings = pa.array(self.names.strings, pa.string())
        h = np.frombuffer(self.head, dtype=np.int64).reshape(-1, VALUE_WIDTH)
        kind, ival, dtype, device, nshape, ndata = (h[:, k] for k in range(6))
        n = len(h)
        kinds = pa.array(VALUE_KINDS, pa.string()).take(pa.array(kind))

        i = pa.array(ival, pa.int64(), mask=~np.isin(kind, _I_IS_VALUE))
        fvals, svals = [None] * n, [None] * n
        for row in np.flatnonzero(np.isin(kind, (K_FLOAT, K_STR, K_OPAQUE))):
            (fvals if kind[row] == K_FLOAT else svals)[row] = self.objs[ival[row]]
        f = pa.array(fvals, pa.float64())
        s = pa.array(svals, pa.string())

        def named(ids: np.ndarray) -> pa.Array:
            return strings.take(pa.array(ids, pa.int64(), mask=ids < 0))

        # A 1-D tensor or int list has shape (n,) and keeps nothing in self.shape.
        implied = (nshape == 1) & ((kind == K_TENSOR) | (kind == K_INTS))
        shape_off = _offsets(nshape)
        shape_vals = np.empty(int(shape_off[-1]), dtype=np.int64)
        at_implied = shape_off[:-1][implied]
        shape_vals[at_implied] = ndata[implied]
        rest = np.ones(len(shape_vals), dtype=bool)
        rest[at_implied] = False
        shape_vals[rest] = np.frombuffer(self.shape, dtype=np.int64)
        fields = [
            kinds, i, f, s, named(dtype), named(device),
            pa.ListArray.from_arrays(pa.array(shape_off), pa.array(shape_vals)),
            pa.ListArray.from_arrays(pa.array(_offsets(ndata)), pa.array(np.frombuffer(self.data, dtype=np.int64))),
        ]
        if with_names:
            return pa.StructArray.from_arrays([named(h[:, 6]), *fields], fields=list(ARG_TYPE))
        return pa.StructArray.from_arrays(fields, fields=list(VALUE_TYPE))


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


class RowBatch:
    """Complete top-level calls (with their nested calls).

    Arguments are put when a call starts, which is ``seq`` order; the rest of a row
    when it returns, which puts nested rows before their parent. ``to_table`` sorts
    the returned-order columns back into ``seq`` order."""

    __slots__ = ("names", "rows", "arg_count", "args", "result", "excs")

    def __init__(self, names: Names | None = None) -> None:
        self.names = names or Names()
        self.rows = array("q")
        self.arg_count = array("q")
        self.args = ValueBuffer(self.names)
        self.result = ValueBuffer(self.names)
        self.excs: list[tuple[str, str]] = []

    def __len__(self) -> int:
        return len(self.rows) // ROW_WIDTH

    def begin(self, values: tuple[Any, ...], names: tuple[int, ...], kwargs: dict[str, Any] | None = None) -> None:
        """Put a call's arguments (positional with their name ids, then keywords)."""
        put = self.args.put
        for v, name in zip(values, names):  # noqa: B905 - names is at least as long
            put(v, name)
        count = len(values)
        if kwargs:
            for k, v in kwargs.items():
                put(v, self.names.id(k))
            count += len(kwargs)
        self.arg_count.append(count)

    def add(self, seq: int, parent: int, depth: int, target: int, method: int, t0: int, t1: int, result: Any,
            exc: BaseException | None, counters: tuple[int, int, int]) -> None:
        """Append the returned-order part of a row; target and method are name ids."""
        self.result.put(result)
        e = -1
        if exc is not None:
            e = len(self.excs)
            self.excs.append((type(exc).__name__, str(exc)[:1000]))
        self.rows.extend((seq, parent, depth, target, method, t0, t1, e, *counters))

    def to_table(self) -> pa.Table:
        r = np.frombuffer(self.rows, dtype=np.int64).reshape(-1, ROW_WIDTH)
        order = pa.array(np.argsort(r[:, 0], kind="stable"))
        strings = pa.array(self.names.strings, pa.string())
        exc = r[:, 7]
        exc_type = pa.array([None if e < 0 else self.excs[e][0] for e in exc], pa.string())
        exc_msg = pa.array([None if e < 0 else self.excs[e][1] for e in exc], pa.string())
        cols: dict[str, pa.Array] = {
            "seq": pa.array(r[:, 0]),
            "parent": pa.array(r[:, 1]),
            "depth": pa.array(r[:, 2].astype(np.int8)),
            "target": strings.take(pa.array(r[:, 3])),
            "method": strings.take(pa.array(r[:, 4])),
            "t_start_ns": pa.array(r[:, 5]),
            "t_end_ns": pa.array(r[:, 6]),
            "result": self.result.struct(with_names=False),
            "exc_type": exc_type,
            "exc_msg": exc_msg,
        }
        for k, name in enumerate(("available", "full_available", "swa_available")):
            c = r[:, 8 + k]
            cols[name] = pa.array(c, pa.int64(), mask=c == NULL)
        cols = {k: v.take(order) for k, v in cols.items()}
        cols["args"] = pa.ListArray.from_arrays(
            pa.array(_offsets(np.frombuffer(self.arg_count, dtype=np.int64))), self.args.struct(with_names=True)
        )
        return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA)
