"""The builtin pools against the real sglang 0.5.23 allocators (skipped without sglang).

Run where sglang is installed: every corpus trace recorded on a builtin pool replays
on sglang's own class in strict mode with identical results, counters and nested
calls, except where 0.5.23 is known to differ (#38519, see traces/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.allocator.swa", reason="sglang not installed")

from kvreplay.replayer.engine import replay  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "traces"


@pytest.mark.parametrize("trace, build", [
    ("decode-1000", "py:sglang_standin:SglangPaged"),
    ("disagg-mtp-2000", "py:sglang_standin:SglangSWA"),
    ("disagg-mtp-azure-1000", "py:sglang_standin:SglangSWA"),
])
def test_builtin_pools_choose_the_same_slots_as_sglang(trace, build):
    r = replay(CORPUS / f"{trace}.parquet", build, mode="strict", device="cpu")
    assert r.status == "clean", (r.first_divergence, r.first_violation)


def test_sglang_0_5_23_frees_swa_page_0_like_the_unfiltered_page0_variant():
    real = replay(CORPUS / "radix-swa-800.parquet", "py:sglang_standin:SglangSWA", device="cpu")
    variant = replay(CORPUS / "radix-swa-800.parquet", "builtin:swa@unfiltered-page0", device="cpu")
    assert real.first_violation.seq == variant.first_violation.seq == 235
    assert real.first_violation.method == "free_swa_segment"
