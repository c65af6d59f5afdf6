"""vLLM managers of several KV-cache groups and sliding windows, on the installed vLLM
(the vLLM tier, marker ``vllm``): recorded through the wire by synth, rebuilt from the
trace's ``attention`` by ``--build vllm``, replayed strict."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM not installed")

from kvreplay.replay.dispatch import replay  # noqa: E402
from kvreplay.trace.reader import TraceReader  # noqa: E402
from kvreplay.workload.synth import SynthConfig, synthesize  # noqa: E402

pytestmark = pytest.mark.vllm
WORKLOAD = "workloads/mooncake/synthetic_trace.jsonl"


def _synth(tmp_path, attention: str, window: int = 64):
    out = tmp_path / f"{attention}.parquet"
    synthesize(SynthConfig(scenario="vllm-prefix", out=out, requests=60, workload=WORKLOAD, build="vllm",
                           attention=attention, window=window, length_scale=0.03, output_scale=0.5,
                           block_tokens=16, full_size=4096, max_running=32, speedup=1e6))
    return out


def test_the_wire_names_each_group_of_a_live_manager_in_order():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvreplay.families.vllm.wire import attention_of

    shape = dict(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    assert attention_of([FullAttentionSpec(**shape)]) == "full"
    assert attention_of([FullAttentionSpec(**shape), SlidingWindowSpec(**shape, sliding_window=128)]) == \
        "full,sliding_window:128"
    # groups of two block sizes are named by kind: no build constructs them yet
    other = dict(shape, block_size=32)
    assert attention_of([FullAttentionSpec(**shape), SlidingWindowSpec(**other, sliding_window=128)]) == \
        "FullAttentionSpec,SlidingWindowSpec"
    # a hybrid state-space model's Mamba group, by its cache mode and its drafter's blocks
    from vllm.v1.kv_cache_interface import MambaSpec

    state = dict(block_size=16, shapes=((1,),), dtypes=(torch.float32,))
    assert attention_of([MambaSpec(**state, mamba_cache_mode="align"), FullAttentionSpec(**shape)]) == \
        "mamba_align,full"
    assert attention_of([MambaSpec(**state, mamba_cache_mode="all", num_speculative_blocks=2)]) == "mamba_all:2"
    # prefill checkpoints (Mamba2 models): no build constructs them yet
    assert attention_of([MambaSpec(**state, mamba_cache_mode="align", num_prefill_checkpoint_blocks=1)]) == \
        "MambaSpec"


@pytest.mark.parametrize("attention", ["sliding", "hybrid"])
def test_a_sliding_window_manager_replays_on_the_vllm_that_made_it(tmp_path, attention):
    """Every block id, free count and block-pool call again; the one finding is the null
    block's count, which this vLLM (0.32) drives below zero at the first free of a request
    whose window slid (fixed in 0.33: traces/vllm-0.33-null-block-ref-count)."""
    trace = _synth(tmp_path, attention)
    reader = TraceReader(trace)
    want = {"sliding": "sliding_window:64", "hybrid": "full,sliding_window:64"}[attention]
    assert reader.meta.ctor_args["attention"] == want
    groups = {c.result[0] for c in reader.calls() if c.method == "allocate_slots" and c.result}
    assert groups - {-1} == {want.count(",") + 1}  # each group's blocks (-1: the shared empty answer)
    r = replay(trace, "vllm", device="cpu")
    assert r.first_divergence is None, r.first_divergence
    assert {v.rule for v in r.violations} == {"null-block-ref-count"}, r.violations
    assert r.first_violation.method == "free_request"


def test_an_eagle_managers_prefix_hits_give_up_a_block_on_vllm_and_on_builtin(tmp_path):
    """--eagle drives a manager built with an EAGLE drafter (use_eagle): every prefix hit
    gives up its last block and every allocation reserves the draft tokens. kvreplay's
    manager answers every call of vLLM's own, so its drop is vLLM's."""
    out = tmp_path / "eagle.parquet"
    synthesize(SynthConfig(scenario="vllm-prefix", out=out, requests=60, workload=WORKLOAD, build="vllm",
                           eagle=True, length_scale=0.03, output_scale=0.5, block_tokens=16, full_size=8192,
                           max_running=32, speedup=1e6))
    reader = TraceReader(out)
    assert reader.meta.ctor_args["use_eagle"] is True
    calls = list(reader.calls())
    assert all(c.args.get("num_lookahead_tokens") == 3 for c in calls if c.method == "allocate_slots")
    assert sum(1 for c in calls if c.method == "get_computed_blocks" and c.result[0] > 0) >= 5
    for build in ("vllm", "builtin:vllm"):
        r = replay(out, build, device="cpu")
        assert r.status == "clean", (build, r.status, r.first_divergence, r.first_violation)


def test_a_mamba_group_prefills_in_aligned_chunks_and_replays_without_growth(tmp_path):
    """--attention mamba: a hybrid model's state group in align mode beside full attention.
    The modelled scheduler ends each prefill chunk where a state can be cached (a block
    boundary, or one token short of the prompt), as vLLM's does. Replay drains what vLLM's
    scheduler takes from the manager every step (blocks to zero): the trace is long enough
    that, left in place, that list would pass the growth rule's bound."""
    out = tmp_path / "mamba.parquet"
    synthesize(SynthConfig(scenario="vllm-prefix", out=out, requests=300, workload=WORKLOAD, build="vllm",
                           attention="mamba", length_scale=0.015, output_scale=0.5, block_tokens=16,
                           full_size=2048, max_model_len=1024, batch_tokens=512, max_running=32, speedup=1e6))
    reader = TraceReader(out)
    assert reader.meta.ctor_args["attention"] == "mamba_align,full"
    calls = list(reader.calls())
    steps = sum(1 for c in calls if c.method == "new_step_starts")
    assert steps > 4 * reader.meta.ctor_args["num_blocks"] + 1024
    for c in calls:
        if c.method == "allocate_slots" and c.result is not None:
            start = c.args["request_num_computed_tokens"] + c.args.get("num_new_computed_tokens", 0)
            end, prompt = start + c.args["num_new_tokens"], c.args["request_num_prompt_tokens"]
            if end < prompt:  # a prefill chunk short of the prompt's end
                assert end % 16 == 0 or end == (prompt - 1) // 16 * 16, (start, end, prompt)
    r = replay(out, "vllm", device="cpu")
    assert r.first_divergence is None, r.first_divergence
    # this vLLM's (0.32) null-block count, fixed in 0.33; nothing grows
    assert {v.rule for v in r.violations} == {"null-block-ref-count"}, r.violations
