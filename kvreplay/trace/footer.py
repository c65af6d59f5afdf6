"""A Parquet footer read by kvreplay itself, for the counts a reader must check before
it decodes anything.

pyarrow builds a column chunk's metadata object eagerly, size statistics and all, and
some damaged footers make that constructor throw where nothing catches it: the
process aborts (seen with pyarrow 26: a flipped byte in a definition-level
histogram). Reading the few fields the size check needs from the footer's Thrift
bytes here cannot abort; a damaged footer is a ValueError like any other."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

_MAGIC = b"PAR1"
_MAX_DEPTH = 24  # Parquet's metadata nests a handful of levels; deeper is damage

# Thrift compact protocol type codes
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT, _UUID = range(14)


@dataclass(frozen=True)
class RowGroupCounts:
    num_rows: int
    values: dict[str, int]  # column path (dotted) -> values the chunk lists
    # column path -> bytes its pages hold uncompressed (what reading the chunk allocates)
    sizes: dict[str, int] = field(default_factory=dict)


class _Compact:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            raise ValueError("footer ends inside a value")
        b = self.data[self.at]
        self.at += 1
        return b

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise ValueError("footer names more bytes than it holds")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def varint(self) -> int:
        out = shift = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 63:
                raise ValueError("footer holds an integer longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int, depth: int) -> object:
        if depth > _MAX_DEPTH:
            raise ValueError("footer nests deeper than Parquet metadata does")
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            return struct.unpack("<d", self.take(8))[0]
        if kind == _BINARY:
            return self.take(self.varint())
        if kind == _UUID:
            return self.take(16)
        if kind in (_LIST, _SET):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if size > len(self.data) - self.at:  # every element takes a byte at least
                raise ValueError("footer lists more elements than it has bytes")
            if elem in (_TRUE, _FALSE):  # booleans in a list are a byte each
                return [self.byte() == 1 for _ in range(size)]
            return [self.value(elem, depth + 1) for _ in range(size)]
        if kind == _MAP:
            size = self.varint()
            if size == 0:
                return {}
            if 2 * size > len(self.data) - self.at:
                raise ValueError("footer maps more entries than it has bytes")
            types = self.byte()
            return [(self.value(types >> 4, depth + 1), self.value(types & 0x0F, depth + 1)) for _ in range(size)]
        if kind == _STRUCT:
            return self.fields(depth + 1)
        raise ValueError(f"footer holds an unknown Thrift type {kind}")

    def fields(self, depth: int) -> dict[int, object]:
        out: dict[int, object] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == _STOP:
                return out
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            out[last] = self.value(kind, depth)


def footer_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        if size < 12:
            raise ValueError("too short for a Parquet file")
        f.seek(size - 8)
        tail = f.read(8)
        if tail[4:] != _MAGIC:
            raise ValueError("no Parquet footer (an encrypted or damaged file)")
        length = int.from_bytes(tail[:4], "little")
        if length > size - 12:
            raise ValueError("footer length larger than the file")
        f.seek(size - 8 - length)
        return f.read(length)


def row_group_counts(path: Path) -> list[RowGroupCounts]:
    """Each row group's rows and, per column chunk, the values it lists and its bytes."""
    meta = _Compact(footer_bytes(path)).fields(0)
    groups = meta.get(4, [])
    if not isinstance(groups, list):
        raise ValueError("footer's row groups are not a list")
    out = []
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get(1), list) or not isinstance(g.get(3), int):
            raise ValueError("footer holds a row group without columns or rows")
        values: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for chunk in g[1]:
            cmeta = chunk.get(3) if isinstance(chunk, dict) else None
            if not isinstance(cmeta, dict) or not isinstance(cmeta.get(3), list) or not isinstance(cmeta.get(5), int):
                raise ValueError("footer holds a column chunk without its path or value count")
            try:
                name = ".".join(p.decode() for p in cmeta[3])
            except (AttributeError, UnicodeDecodeError):
                raise ValueError("footer names a column in bytes that are not UTF-8") from None
            values[name] = values.get(name, 0) + cmeta[5]
            if isinstance(cmeta.get(6), int):  # total_uncompressed_size
                sizes[name] = sizes.get(name, 0) + cmeta[6]
        out.append(RowGroupCounts(g[3], values, sizes))
    return out
