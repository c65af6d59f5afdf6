"""Findings and counters that only this recording's writers can have written.

``kvreplay record --watch`` follows ``kvreplay-watch.jsonl`` and serves the
``.kvreplay-metrics-*.json`` files of its out directory, a directory other users of
the host may be able to write to. Whatever they put there must not become a
violation, an exit code, a reproducer or a counter. ``kvreplay record`` draws a key
for each run and hands it to its writers in their environment (``KVREPLAY_WATCH_KEY``,
which other users cannot read); a writer seals each document it writes with an HMAC
of its canonical JSON under that key, and ``kvreplay record`` reads back only the
documents whose seal it can verify. Copying a real finding again only repeats it.

Reading these files back is also bounded here: a regular file only (a FIFO, a device
or a link is skipped without blocking), at most ``MAX_DOC_BYTES`` read of it, and
JSON that is flat enough to parse without recursion trouble."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from kvreplay.errors import BadInput
from kvreplay.safe_files import read_regular, write_atomic

MAX_DOC_BYTES = 64 << 10  # a finding line is cut at 4 KB, a writer's counters are about 1 KB
MAX_DEPTH = 8  # a writer's documents nest three levels deep
MAC_KEY = "seal"


def new_key() -> str:
    return secrets.token_hex(32)


def _mac(doc: dict[str, Any], key: str) -> str:
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()


def seal(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """``doc`` with its seal under ``key`` (no key: as it is, unsealed)."""
    return {**doc, MAC_KEY: _mac(doc, key)} if key else dict(doc)


def opened(doc: Any, key: str) -> dict[str, Any] | None:
    """The document without its seal when the seal is this key's, else None."""
    if not isinstance(doc, dict) or not isinstance(doc.get(MAC_KEY), str):
        return None
    body = {k: v for k, v in doc.items() if k != MAC_KEY}
    try:
        good = hmac.compare_digest(doc[MAC_KEY], _mac(body, key))
    except (TypeError, ValueError):  # a value json cannot write back (a NaN is written back fine)
        return None
    return body if good else None


def parse(data: bytes) -> Any:
    """JSON from a file this run's writers write, or None: bounded depth and size, every
    number finite (a 400-digit integer is refused here, not later by float())."""
    if len(data) > MAX_DOC_BYTES or _too_deep(data):
        return None
    try:
        return json.loads(data, parse_constant=_refuse, parse_int=_int, parse_float=_float)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None


def _refuse(name: str) -> float:
    raise ValueError(f"{name} is not a number a writer writes")


def _float(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
        raise ValueError("a number past what a float holds")
    return f


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:  # past what a 64-bit counter holds
        raise ValueError("an integer longer than a counter")
    return int(text)


def _too_deep(data: bytes) -> bool:
    depth = 0
    for b in data:  # strings may hold brackets: counting them too only refuses more
        if b in b"[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif b in b"]}":
            depth -= 1
    return False


def read_small(path: Path, limit: int = MAX_DOC_BYTES) -> bytes | None:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes, else
    None (safe_files.read_regular: never follows a link, never blocks on a FIFO)."""
    try:
        return read_regular(path, limit, "writer's file", follow=False)
    except BadInput:
        return None


def open_append(path: Path) -> int | None:
    """A descriptor appending to ``path`` (made 0644 if missing) when it is a regular
    file, else None: a FIFO or a link planted in its place is never written to."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def replace_file(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` whole (safe_files.write_atomic: a new file beside it,
    never through a link, renamed into place); whether it was written."""
    try:
        write_atomic(path, data, sync=False)  # rewritten every second: losing one costs nothing
        return True
    except BadInput:
        return False
