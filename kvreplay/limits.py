"""Bounds on what a trace can make kvreplay allocate, each overridable by an
environment variable for the rare user who needs more.

Every reader checks these before it allocates (trace/reader.py, trace/snapshot.py): a
trace from another machine may be damaged or hostile, and a 19 KB file can declare
10^8 indices. A family's record may add its own (a vLLM block pool's blocks)."""

from __future__ import annotations

import os


def limit(env: str, default: int) -> int:
    """``env``'s value when it is a positive whole number, else ``default``."""
    raw = os.environ.get(env, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else default


# A pool's slots: 2^27 tokens is several times the KV capacity of today's largest GPUs.
MAX_POOL_SLOTS = limit("KVREPLAY_MAX_POOL_SLOTS", 1 << 27)
