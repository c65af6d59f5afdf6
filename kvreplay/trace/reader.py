"""Read a trace back one row group batch at a time, so a large file never has to
fit in memory; every problem with the file becomes a one-line TraceFormatError.

Opening a trace and scanning its columns needs no torch; decoding calls into
tensors (decode.py) imports it on first use, so commands that only look at a
trace (inspect, hashing, a git: build's parent process) start fast."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvreplay.errors import TraceFormatError
from kvreplay.trace.format import GAP_TARGET, PART_GLOB, SCHEMA, SCHEMA_VERSION, Call, TopCall, TraceMeta

if TYPE_CHECKING:
    import torch


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

    def count_calls(self) -> int:
        """Top-level calls (reports number them 1..N), by a scan of two columns."""
        n = 0
        for batch in self.iter_batches(columns=["depth", "target"]):
            top = pc.equal(batch.column(0), 0)
            n += int(pc.sum(pc.and_(top, pc.not_equal(batch.column(1), GAP_TARGET))).as_py() or 0)
        return n

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

    def top_calls(self, device: str | torch.device = "cpu") -> Iterator[TopCall]:
        """Top-level calls with the sub-allocator calls each made, numbered 1..N in
        trace order (gap rows, which stand for lost calls, are passed on unnumbered)."""
        current: TopCall | None = None
        number = 0
        for c in self.calls(device=device):
            if c.depth == 0:
                if current is not None:
                    yield current
                if c.target != GAP_TARGET:
                    number += 1
                current = TopCall(c, number if c.target != GAP_TARGET else 0)
            elif current is not None:
                current.nested.append(c)
        if current is not None:
            yield current

    def calls(self, *, top_level_only: bool = False, device: str | torch.device = "cpu",
              batch_size: int = 4096) -> Iterator[Call]:
        """Decoded calls in recorded order (nested rows follow their parent)."""
        from kvreplay.trace.decode import decode_batch

        for batch in self.iter_batches(batch_size=batch_size):
            try:
                yield from decode_batch(batch, top_level_only, device)
            except (pa.ArrowException, ValueError, IndexError, KeyError) as exc:
                raise TraceFormatError(f"{self.path}: corrupt trace data ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
