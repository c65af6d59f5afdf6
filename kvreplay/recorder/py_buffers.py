"""Calls as the Python capture engine collects them, and the value encoder both
engines share.

The recording thread pays for every row, so it does the least work that keeps the
values as they were at the time of the call: each value becomes a fixed-width
header of seven integers and its elements are copied into one flat data buffer
(layout in layout.py). All buffers are ``array.array('q')``, which the
garbage collector does not scan: holding a few thousand rows of Python lists and
tensors made the collector walk them on every generation-2 pass and cost more than
the copying itself."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import torch

from kvreplay.recorder.layout import (
    K_BOOL,
    K_DEFERRED,
    K_FLOAT,
    K_INT,
    K_INTS,
    K_NONE,
    K_OPAQUE,
    K_SEGMENTS,
    K_STR,
    K_TENSOR,
    ROW_WIDTH,
)
from kvreplay.recorder.raw_batch import RawBatch, RawValues

SMALL_TENSOR = 64  # up to this many elements, tolist() is the cheapest copy
_INT64 = (-(2**63), 2**63 - 1)


class Names:
    """Strings a batch refers to by number (targets, methods, argument names, dtypes,
    devices). One per recording, shared by its batches; it only ever grows."""

    def __init__(self) -> None:
        self.strings: list[str] = []
        self.ids: dict[str, int] = {}
        self.dtypes: dict[torch.dtype, int] = {}
        self.devices: dict[torch.device, int] = {}
        # dtypes whose elements fit int64 losslessly; any other tensor is recorded as opaque
        self.int_dtypes = {d: self.dtype(d) for d in (torch.int64, torch.int32, torch.int16, torch.int8,
                                                      torch.uint8, torch.bool)}

    def id(self, s: str) -> int:
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.strings)
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

    def raw(self) -> RawValues:
        return RawValues(self.head, self.shape, self.data, self.objs)

    def put(self, v: Any, name: int = -1) -> None:
        """Append one value; the common kinds inline, the rest through ``encode``."""
        tp = type(v)
        if tp is torch.Tensor and v.is_cpu:
            dtype = self._int_dtypes.get(v.dtype)
            if dtype is not None:
                nd = v.dim()
                n = v.numel()
                self.head.extend((K_TENSOR, 0, dtype, self._cpu, nd, n, name))
                if nd != 1:
                    self.shape.extend(v.shape)
                    v = v.reshape(-1)
                if n <= SMALL_TENSOR:
                    self.data.extend(v.tolist())
                else:
                    self.data.frombytes(v.numpy().astype(np.int64, copy=False).tobytes())
                return
        elif v is None:
            self.head.extend((K_NONE, 0, -1, -1, 0, 0, name))
            return
        elif tp is int and _INT64[0] <= v <= _INT64[1]:
            self.head.extend((K_INT, v, -1, -1, 0, 0, name))
            return
        elif tp is str:
            self.head.extend((K_STR, len(self.objs), -1, -1, 0, 0, name))
            self.objs.append(v)
            return
        kind, i, dtype, device, nshape, n, extra, data, obj = encode(v, self.names)
        if obj is not None:
            i = len(self.objs)
            self.objs.append(obj)
        self.head.extend((kind, i, dtype, device, nshape, n, name))
        self.shape.extend(extra)
        self.data.frombytes(data)


Encoded = tuple[int, int, int, int, int, int, tuple[int, ...], bytes, Any]
_NO_DATA = b""
# Tests set this to send CPU tensors that take the encoder (not the inline copies)
# through the device-copy path too, so it is exercised without a GPU.
DEFER_ALL = False


class DeviceCopy:
    """An index tensor's value, copied off its device without making the caller wait.

    On CUDA: a non-blocking copy into pinned host memory, queued on the current
    stream, so it holds the value as of the call even if later kernels change the
    tensor, and an event recorded after it. ``device_values()`` waits on the event:
    the writer's thread calls it, never the recorded program's."""

    __slots__ = ("host", "event", "kind")

    def __init__(self, t: torch.Tensor, kind: int = K_TENSOR) -> None:
        self.kind = kind  # what the value becomes once its elements are in: a tensor or segments
        flat = t.detach().reshape(-1)
        if flat.device.type == "cuda":
            self.host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event: Any = torch.cuda.Event()
            self.event.record()
        else:  # CPU (DEFER_ALL in tests) or a device without events: an ordinary copy
            self.host = flat.to("cpu", copy=True)
            self.event = None

    def device_values(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy().astype(np.int64, copy=False)


def encode(v: Any, names: Names) -> Encoded:
    """Any value as (kind, i, dtype id, device id, shape length, data length, stored
    shape entries, int64 data bytes, object). ``obj`` (a float or a string) goes to
    the buffer's object list and ``i`` becomes its index. Both recorders use this for
    everything but their inlined kinds, so they encode alike."""
    tp = type(v)
    if isinstance(v, torch.Tensor):
        if tp is not torch.Tensor:  # a subclass (e.g. a Parameter): record the plain tensor
            v = v.as_subclass(torch.Tensor)
        dtype = names.int_dtypes.get(v.dtype)
        if dtype is None:  # floating point or complex: not an index tensor
            return (K_OPAQUE, 0, names.dtype(v.dtype), -1, 0, 0, (), _NO_DATA, f"{v.dtype} tensor {tuple(v.shape)}")
        nd = v.dim()
        if v.device.type != "cpu" or DEFER_ALL:  # no host sync: the writer collects the copy later
            return (K_DEFERRED, 0, dtype, names.device(v.device), nd, v.numel(),
                    () if nd == 1 else tuple(v.shape), _NO_DATA, DeviceCopy(v))
        host = v.detach().reshape(-1).cpu().numpy().astype(np.int64)
        return (K_TENSOR, 0, dtype, names.device(v.device), nd, len(host),
                () if nd == 1 else tuple(v.shape), host.tobytes(), None)
    if v is None:
        return (K_NONE, 0, -1, -1, 0, 0, (), _NO_DATA, None)
    if tp is bool:
        return (K_BOOL, int(v), -1, -1, 0, 0, (), _NO_DATA, None)
    if tp is int:
        if _INT64[0] <= v <= _INT64[1]:
            return (K_INT, v, -1, -1, 0, 0, (), _NO_DATA, None)
        return (K_OPAQUE, 0, -1, -1, 0, 0, (), _NO_DATA, repr(v))
    if tp is float:
        return (K_FLOAT, 0, -1, -1, 0, 0, (), _NO_DATA, v)
    if tp is str:
        return (K_STR, 0, -1, -1, 0, 0, (), _NO_DATA, v)
    if (tp is list or tp is tuple) and all(type(x) is int and _INT64[0] <= x <= _INT64[1] for x in v):
        return (K_INTS, int(tp is tuple), -1, -1, 1, len(v), (), np.asarray(v, dtype=np.int64).tobytes(), None)
    if (tp is list or tp is tuple) and v and all(
        isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], torch.Tensor) for x in v
    ):
        # (tensor, start_pos) pairs: the shape holds n0, start0, n1, start1, ...
        dtypes = [str(t.dtype) for t, _ in v]
        dtype = names.id(",".join(dtypes) if len(set(dtypes)) > 1 else dtypes[0])
        extra = tuple(x for t, start in v for x in (t.numel(), int(start)))
        device = v[0][0].device
        if (device.type != "cpu" or DEFER_ALL) and all(t.device == device for t, _ in v):
            # One int64 concatenation on the device (kernels queued, no wait), copied
            # off it like a single tensor; the starts are plain ints.
            flat = torch.cat([t.detach().reshape(-1).to(torch.int64) for t, _ in v])
            return (K_DEFERRED, 0, dtype, names.device(device), len(extra), flat.numel(), extra, _NO_DATA,
                    DeviceCopy(flat, K_SEGMENTS))
        parts = [t.detach().reshape(-1).cpu().numpy().astype(np.int64) for t, _ in v]
        data = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return (K_SEGMENTS, 0, dtype, names.device(v[0][0].device), len(extra), len(data), extra, data.tobytes(), None)
    return (K_OPAQUE, 0, -1, -1, 0, 0, (), _NO_DATA, repr(v)[:200])


class RowBatch:
    """Complete top-level calls (with their nested calls), as the Python engine
    appends them; ``raw()`` is what the writer takes."""

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

    def raw(self) -> RawBatch:
        return RawBatch(self.rows, self.arg_count, self.args.raw(), self.result.raw(), self.excs,
                        list(self.names.strings))

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
        self.rows.extend((seq, parent, depth, target, method, t0, t1, e, *counters, 0, 0, -1, 0, 0, 0))

    def mark(self) -> tuple[int, ...]:
        """Where every buffer ends now, for ``rewind``."""
        a, r = self.args, self.result
        return (len(self.rows), len(self.arg_count), len(a.head), len(a.shape), len(a.data), len(a.objs),
                len(r.head), len(r.shape), len(r.data), len(r.objs), len(self.excs))

    def rewind(self, m: tuple[int, ...]) -> None:
        """Forget every call put since ``mark()`` gave ``m``."""
        a, r = self.args, self.result
        for buf, n in zip((self.rows, self.arg_count, a.head, a.shape, a.data, a.objs, r.head, r.shape, r.data,
                           r.objs, self.excs), m, strict=True):
            del buf[n:]

