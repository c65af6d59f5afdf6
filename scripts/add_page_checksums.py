"""Rewrite traces with a checksum per data page (what kvreplay's writer does since the
first hostile-input round), keeping every row and the footer as they are:

    python scripts/add_page_checksums.py traces/*.parquet    # then update the manifest's sha256

A trace without page checksums lets a flipped bit through as a plausible call with
other slots; with them, reading refuses the damaged page."""

from __future__ import annotations

import os
import sys

import pyarrow.parquet as pq

from kvreplay.trace.format import PARQUET_OPTIONS


def rewrite(path: str) -> None:
    table = pq.read_table(path)
    tmp = path + ".tmp"
    pq.write_table(table, tmp, **PARQUET_OPTIONS, row_group_size=16384)
    os.replace(tmp, path)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        rewrite(p)
        print(p)
