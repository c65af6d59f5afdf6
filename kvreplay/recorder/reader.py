"""Read a trace back one row group batch at a time, so a large file never has to
fit in memory; every problem with the file becomes a one-line TraceFormatError."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kvreplay.errors import TraceFormatError
from kvreplay.recorder.trace_format import COUNTERS, OPAQUE, SCHEMA, SCHEMA_VERSION, Call, TraceMeta, decode_value


class TraceReader:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceFormatError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise TraceFormatError(f"{self.path}: is a directory, not a trace file")
        try:
            self._file = pq.ParquetFile(str(self.path))
        except (pa.ArrowException, OSError) as exc:
            raise TraceFormatError(f"{self.path}: not a readable Parquet file ({_first_line(exc)})") from None
        md = self._file.schema_arrow.metadata or {}
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
        missing = [f.name for f in SCHEMA if f.name not in self._file.schema_arrow.names]
        if missing:
            raise TraceFormatError(f"{self.path}: trace lacks columns {', '.join(missing)}")

    @property
    def num_rows(self) -> int:
        return self._file.metadata.num_rows

    @property
    def file_size(self) -> int:
        return self.path.stat().st_size

    def iter_batches(self, columns: list[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
        try:
            yield from self._file.iter_batches(batch_size=batch_size, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise TraceFormatError(f"{self.path}: corrupt trace data ({_first_line(exc)})") from None

    def calls(self, *, top_level_only: bool = False, device: str | torch.device = "cpu",
              batch_size: int = 4096) -> Iterator[Call]:
        """Decoded calls in recorded order (nested rows follow their parent)."""
        for batch in self.iter_batches(batch_size=batch_size):
            for r in batch.to_pylist():
                if top_level_only and r["depth"] != 0:
                    continue
                yield Call(
                    seq=r["seq"], parent=r["parent"], depth=r["depth"], target=r["target"],
                    method=r["method"],
                    args={a["name"]: decode_value(a, device) for a in r["args"]},
                    has_opaque=any(a["kind"] == OPAQUE for a in r["args"]),
                    result=decode_value(r["result"], device),
                    exc_type=r["exc_type"], exc_msg=r["exc_msg"],
                    counters={k: r[k] for k in COUNTERS},
                    t_start_ns=r["t_start_ns"], t_end_ns=r["t_end_ns"],
                )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
