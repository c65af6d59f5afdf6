"""Read a trace back one row group batch at a time, so a large file never has to
fit in memory; every problem with the file becomes a one-line TraceFormatError."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kvreplay.errors import TraceFormatError
from kvreplay.recorder.trace_format import (
    BOOL,
    COUNTERS,
    FLOAT,
    GAP_TARGET,
    INT,
    INTS,
    NONE,
    OPAQUE,
    PART_GLOB,
    SCHEMA,
    SCHEMA_VERSION,
    SEGMENTS,
    STR,
    TENSOR,
    Call,
    Opaque,
    TraceMeta,
)


class TraceReader:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceFormatError(f"{self.path}: no such file")
        if self.path.is_dir():
            self.parts = sorted(self.path.glob(PART_GLOB))
            if not self.parts:
                raise TraceFormatError(f"{self.path}: is a directory without trace parts ({PART_GLOB}), "
                                       "not a trace")
        else:
            self.parts = [self.path]
        self._files = [self._open(p) for p in self.parts]
        first = self._files[0]
        md = first.schema_arrow.metadata or {}
        try:
            self.meta = TraceMeta.from_parquet_metadata(md)
        except (KeyError, ValueError, UnicodeDecodeError):
            raise TraceFormatError(
                f"{self.path}: a Parquet file but not a kvreplay trace (no kvreplay metadata)"
            ) from None
        if self.meta.schema_version > SCHEMA_VERSION:
            raise TraceFormatError(
                f"{self.path}: trace schema version {self.meta.schema_version} is newer than this "
                f"kvreplay reads (up to {SCHEMA_VERSION}); upgrade kvreplay"
            )
        for part, f in zip(self.parts, self._files, strict=True):
            missing = [fl.name for fl in SCHEMA if fl.name not in f.schema_arrow.names]
            if missing:
                raise TraceFormatError(f"{part}: trace lacks columns {', '.join(missing)}")

    def _open(self, part: Path) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(str(part))
        except (pa.ArrowException, OSError) as exc:
            raise TraceFormatError(f"{part}: not a readable Parquet file ({_first_line(exc)})") from None

    @property
    def num_rows(self) -> int:
        return sum(f.metadata.num_rows for f in self._files)

    @property
    def file_size(self) -> int:
        return sum(p.stat().st_size for p in self.parts)

    def iter_batches(self, columns: list[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
        try:
            for f in self._files:
                yield from f.iter_batches(batch_size=batch_size, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise TraceFormatError(f"{self.path}: corrupt trace data ({_first_line(exc)})") from None

    def gaps(self) -> list[Call]:
        """The gap rows (where the recorder lost calls), in order; a cheap column scan
        first, since almost every trace has none."""
        found = False
        for batch in self.iter_batches(columns=["target"]):
            if GAP_TARGET in batch.column(0).to_pylist():
                found = True
                break
        if not found:
            return []
        return [c for c in self.calls(top_level_only=True) if c.target == GAP_TARGET]

    def calls(self, *, top_level_only: bool = False, device: str | torch.device = "cpu",
              batch_size: int = 4096) -> Iterator[Call]:
        """Decoded calls in recorded order (nested rows follow their parent)."""
        for batch in self.iter_batches(batch_size=batch_size):
            try:
                yield from _decode_batch(batch, top_level_only, device)
            except (pa.ArrowException, ValueError, IndexError, KeyError) as exc:
                raise TraceFormatError(f"{self.path}: corrupt trace data ({_first_line(exc)})") from None


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


def _decode_batch(batch: pa.RecordBatch, top_level_only: bool, device: str | torch.device) -> Iterator[Call]:
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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
