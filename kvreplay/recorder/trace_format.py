"""The one place that defines a kvreplay trace on disk (docs/trace-format.md explains it).

A trace is a Parquet file with one row per allocator call (top-level and nested), in
call-start order. Argument and result values share one struct type, so a value of
any kind (None, bool, int, float, str, integer/bool tensor, list of ints, list of
``(tensor, start_pos)`` segments) round-trips losslessly."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

SCHEMA_VERSION = 1
META_PREFIX = "kvreplay."

# Value kinds. Tensors keep dtype, shape and device; their elements go to ``data``.
NONE, BOOL, INT, FLOAT, STR, TENSOR, INTS, SEGMENTS, OPAQUE = (
    "none", "bool", "int", "float", "str", "tensor", "ints", "segments", "opaque",
)

_VALUE_FIELDS = [
    pa.field("kind", pa.string(), nullable=False),
    pa.field("i", pa.int64()),
    pa.field("f", pa.float64()),
    pa.field("s", pa.string()),
    pa.field("dtype", pa.string()),
    pa.field("device", pa.string()),
    pa.field("shape", pa.list_(pa.int64())),
    pa.field("data", pa.list_(pa.int64())),
]
VALUE_TYPE = pa.struct(_VALUE_FIELDS)
ARG_TYPE = pa.struct([pa.field("name", pa.string(), nullable=False), *_VALUE_FIELDS])

SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("parent", pa.int64(), nullable=False),
        pa.field("depth", pa.int8(), nullable=False),
        pa.field("target", pa.string(), nullable=False),
        pa.field("method", pa.string(), nullable=False),
        pa.field("t_start_ns", pa.int64(), nullable=False),
        pa.field("t_end_ns", pa.int64(), nullable=False),
        pa.field("args", pa.list_(ARG_TYPE), nullable=False),
        pa.field("result", VALUE_TYPE),
        pa.field("exc_type", pa.string()),
        pa.field("exc_msg", pa.string()),
        pa.field("available", pa.int64()),
        pa.field("full_available", pa.int64()),
        pa.field("swa_available", pa.int64()),
    ]
)

# Columns that must be identical for two runs of the same seeded workload.
CALL_COLUMNS = [f.name for f in SCHEMA if f.name not in ("t_start_ns", "t_end_ns")]
COUNTERS = ("available", "full_available", "swa_available")

# Parquet settings: delta-encode index data (runs of consecutive slots shrink to a
# few bits) and dictionary-encode the small string columns.
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": ["target", "method", "exc_type", "args.list.element.name",
                       "args.list.element.kind", "args.list.element.dtype",
                       "args.list.element.device", "result.kind", "result.dtype", "result.device"],
    "column_encoding": {
        "args.list.element.data.list.element": "DELTA_BINARY_PACKED",
        "result.data.list.element": "DELTA_BINARY_PACKED",
        "seq": "DELTA_BINARY_PACKED",
        "t_start_ns": "DELTA_BINARY_PACKED",
        "t_end_ns": "DELTA_BINARY_PACKED",
    },
    "write_statistics": False,
}


@dataclass
class TraceMeta:
    """File-level metadata: what pool was recorded, where and when."""

    pool_class: str
    family: str
    ctor_args: dict[str, Any]
    source_version: dict[str, str] = field(default_factory=dict)
    host: str = ""
    pid: int = 0
    rank: str = ""
    start_time: str = ""
    initial_state: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_parquet_metadata(self) -> dict[bytes, bytes]:
        plain = {
            "schema_version": str(self.schema_version),
            "pool_class": self.pool_class,
            "family": self.family,
            "host": self.host,
            "pid": str(self.pid),
            "rank": self.rank,
            "start_time": self.start_time,
        }
        as_json = {
            "ctor_args": self.ctor_args,
            "source_version": self.source_version,
            "extra": self.extra,
        }
        if self.initial_state is not None:
            as_json["initial_state"] = self.initial_state
        out = {(META_PREFIX + k).encode(): v.encode() for k, v in plain.items()}
        out.update({(META_PREFIX + k).encode(): json.dumps(v, sort_keys=True).encode() for k, v in as_json.items()})
        return out

    @classmethod
    def from_parquet_metadata(cls, md: dict[bytes, bytes]) -> TraceMeta:
        """Parse footer metadata; KeyError/ValueError mean it is not a kvreplay trace."""
        get = {k.decode()[len(META_PREFIX):]: v.decode() for k, v in md.items() if k.startswith(META_PREFIX.encode())}
        return cls(
            pool_class=get["pool_class"],
            family=get["family"],
            ctor_args=json.loads(get["ctor_args"]),
            source_version=json.loads(get.get("source_version", "{}")),
            host=get.get("host", ""),
            pid=int(get.get("pid", "0") or 0),
            rank=get.get("rank", ""),
            start_time=get.get("start_time", ""),
            initial_state=json.loads(get["initial_state"]) if "initial_state" in get else None,
            extra=json.loads(get.get("extra", "{}")),
            schema_version=int(get["schema_version"]),
        )


@dataclass
class Call:
    """One recorded allocator call, decoded."""

    seq: int
    parent: int
    depth: int
    target: str
    method: str
    args: dict[str, Any]
    result: Any
    exc_type: str | None
    exc_msg: str | None
    counters: dict[str, int | None]
    t_start_ns: int
    t_end_ns: int
    has_opaque: bool = False  # an argument could not be recorded losslessly

    @property
    def top_level(self) -> bool:
        return self.depth == 0


# -- encoding ---------------------------------------------------------------------

class TensorSnap(NamedTuple):
    """A tensor as it was at call time: flat host copy of its elements."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    device: str


class OpaqueSnap(NamedTuple):
    """A value kvreplay does not store, only describes (e.g. a float tensor)."""

    text: str


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_DEVICE_NAMES: dict[torch.device, str] = {}


def _tensor_snap(t: torch.Tensor) -> TensorSnap | OpaqueSnap:
    dtype = t.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return OpaqueSnap(f"{name} tensor {tuple(t.shape)}")
    dev = t.device
    dname = _DEVICE_NAMES.get(dev)
    if dname is None:
        dname = _DEVICE_NAMES[dev] = str(dev)
    flat = t.detach().reshape(-1)
    # A host copy: later in-place changes by the caller cannot reach the record.
    data = flat.numpy().copy() if dev.type == "cpu" else flat.cpu().numpy()
    return TensorSnap(name, tuple(t.shape), data, dname)


def snapshot(value: Any) -> Any:
    """Freeze a value as it is at call time (tensors become TensorSnap)."""
    tp = type(value)
    if tp is torch.Tensor or isinstance(value, torch.Tensor):
        return _tensor_snap(value)
    if (tp is list or tp is tuple) and value and isinstance(value[0], (list, tuple)):
        return [(snapshot(t), s) for t, s in value]
    return value


class ColumnBuilder:
    """Accumulates values column-wise; one instance per value column. Takes plain
    values, torch tensors and TensorSnaps (what the recorder hands over)."""

    def __init__(self) -> None:
        self.kind: list[str] = []
        self.i: list[int | None] = []
        self.f: list[float | None] = []
        self.s: list[str | None] = []
        self.dtype: list[str | None] = []
        self.device: list[str | None] = []
        self.shape_len: list[int] = []
        self.shape: list[int] = []
        self.data_len: list[int] = []
        self.data: list[np.ndarray] = []

    def _row(self, kind: str, i: Any = None, f: Any = None, s: Any = None, dtype: Any = None,
             device: Any = None) -> None:
        self.kind.append(kind)
        self.i.append(i)
        self.f.append(f)
        self.s.append(s)
        self.dtype.append(dtype)
        self.device.append(device)

    def add(self, value: Any) -> None:
        tp = type(value)
        if tp is TensorSnap:
            self._row(TENSOR, dtype=value.dtype, device=value.device)
            self.shape_len.append(len(value.shape))
            self.shape.extend(value.shape)
            self.data_len.append(len(value.data))
            self.data.append(value.data)
            return
        if value is None:
            self._row(NONE)
        elif tp is OpaqueSnap:
            self._row(OPAQUE, s=value.text)
        elif tp is bool:
            self._row(BOOL, i=int(value))
        elif tp is int:
            self._row(INT, i=value)
        elif tp is float:
            self._row(FLOAT, f=value)
        elif tp is str:
            self._row(STR, s=value)
        elif isinstance(value, torch.Tensor):
            self.add(snapshot(value))
            return
        elif tp in (list, tuple) and all(type(v) is int for v in value):
            self._row(INTS, i=int(tp is tuple))
            self.shape_len.append(1)
            self.shape.append(len(value))
            self.data_len.append(len(value))
            self.data.append(np.asarray(value, dtype=np.int64))
            return
        elif tp in (list, tuple) and value and all(
            isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], (torch.Tensor, TensorSnap))
            for v in value
        ):
            self._add_segments(value)
            return
        else:
            self._row(OPAQUE, s=repr(value)[:200])
        self.shape_len.append(0)
        self.data_len.append(0)

    def _add_segments(self, value: Any) -> None:
        # (tensor, start_pos) pairs: shape holds n0, start0, n1, start1, ...
        snaps = [(t if type(t) is TensorSnap else snapshot(t), int(s)) for t, s in value]
        dtypes = [t.dtype for t, _ in snaps]
        # One dtype name when they agree (the usual case), else one per segment.
        dtype = ",".join(dtypes) if len(set(dtypes)) > 1 else dtypes[0]
        self._row(SEGMENTS, dtype=dtype, device=snaps[0][0].device)
        self.shape_len.append(2 * len(snaps))
        for t, start in snaps:
            self.shape.extend((len(t.data), start))
            self.data.append(t.data)
        self.data_len.append(sum(len(t.data) for t, _ in snaps))

    def fields(self) -> list[pa.Array]:
        shape = pa.ListArray.from_arrays(list_offsets(self.shape_len), pa.array(self.shape, pa.int64()))
        flat = np.concatenate(self.data, dtype=np.int64) if self.data else np.empty(0, dtype=np.int64)
        data = pa.ListArray.from_arrays(list_offsets(self.data_len), pa.array(flat, pa.int64()))
        return [
            pa.array(self.kind, pa.string()),
            pa.array(self.i, pa.int64()),
            pa.array(self.f, pa.float64()),
            pa.array(self.s, pa.string()),
            pa.array(self.dtype, pa.string()),
            pa.array(self.device, pa.string()),
            shape,
            data,
        ]


def list_offsets(lengths: Sequence[int]) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32))


# -- decoding ---------------------------------------------------------------------

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


def _tensor(data: list[int], dtype: str, device: str | torch.device) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.int64, device=device).to(_DTYPES.get(dtype, torch.int64))


@dataclass(frozen=True)
class Opaque:
    """A value kvreplay could not record losslessly; replay refuses to pass it on."""

    text: str
