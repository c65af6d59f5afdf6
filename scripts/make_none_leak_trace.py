"""Write traces/sglang-0.5.23-decode-none-leak.parquet: the smallest call sequence
on which sglang 0.5.23's SWA alloc_decode returns None but keeps a full page.

Recorded on builtin:swa (which changes nothing when it returns None). One request
fills the SWA pool's every page; its next decode step needs a new page in both
sub-pools: the full pool has one, the SWA pool has none. 0.5.23 asks both anyway,
the full sub-allocator hands out its page, and the None return leaks it.

    python scripts/make_none_leak_trace.py [OUT]"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kvreplay.families.sglang.swa import SWAPool
from kvreplay.recorder.recording import record


def t(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def main(out: Path) -> None:
    pool = SWAPool(64, 16, 4, need_sort=False)  # full: 16 pages of 4, SWA: 4 pages of 4
    rec = record(pool, out, extra={"made_by": "scripts/make_none_leak_trace.py"})
    row = pool.alloc_extend(t(0), t(0), t(16), t(16), t(-1), 16)  # 16 tokens: every SWA page
    pool.available_size()
    assert pool.alloc_decode(t(17), t(17), row[-1:]) is None  # SWA has no page for token 17
    pool.available_size()
    pool.free(row)
    rec.close()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "traces/sglang-0.5.23-decode-none-leak.parquet"))
