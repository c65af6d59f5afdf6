"""A trace's content hash: what the store and the corpus manifest know a trace by.

A single file hashes as its bytes; a rotated trace (a directory of parts) as each
part's name and bytes in order, so renaming the directory changes nothing and
changing any part changes the hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvreplay.errors import TraceFormatError
from kvreplay.trace.format import PART_GLOB

CHUNK = 1 << 20


def content_hash(path: str | Path) -> str:
    """sha256 of a trace file, or of a rotated trace's parts in order."""
    path = Path(path)
    rotated = path.is_dir()
    h = hashlib.sha256()
    try:
        for part in sorted(path.glob(PART_GLOB)) if rotated else [path]:
            if not part.is_file():  # a FIFO or a device would block or never end
                raise TraceFormatError(f"{part}: not a regular file")
            if rotated:
                h.update(part.name.encode() + b"\0")
            with open(part, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    h.update(chunk)
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    return h.hexdigest()
