"""The workload model against the real thing: ``synth radix-swa --sglang-scheduler``
on the same 300 Mooncake requests and pool sizes as the live hybrid-SWA server whose
trace is in the corpus (traces/live-sglang-0.5.23-swa-mooncake300.parquet, recorded
from sglang 0.5.23 on CPU with 16 requests in flight: the model gets every request at
once and 16 running)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreplay.trace.profile import profile
from kvreplay.trace.reader import TraceReader
from kvreplay.workload.synth import SynthConfig, synthesize

ROOT = Path(__file__).resolve().parents[1]
LIVE = ROOT / "traces" / "live-sglang-0.5.23-swa-mooncake300.parquet"
MOONCAKE = ROOT / "workloads" / "mooncake" / "synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def live_and_model(tmp_path_factory):
    live = profile(LIVE)
    args = TraceReader(LIVE).meta.ctor_args  # the live pool's sizes
    out = tmp_path_factory.mktemp("model") / "synth.parquet"
    synthesize(SynthConfig(scenario="radix-swa", out=out, requests=300, workload=MOONCAKE, length_scale=0.03,
                           output_scale=0.5, page_size=args["page_size"], block_tokens=16, window=128,
                           full_size=args["size"], swa_size=args["size_swa"], max_running=16,
                           sglang_scheduler=True, speedup=1e9))
    return live.per_request(), profile(out).per_request()


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
@pytest.mark.parametrize("method", ["alloc_extend", "alloc_decode", "free_segments", "free_group_begin",
                                    "free_swa_segment", "free_segment", "free_full_segment"])
def test_the_main_methods_are_within_ten_percent_of_the_live_server(live_and_model, method):
    live, model = live_and_model
    assert model[method] == pytest.approx(live[method], rel=0.10), (method, live[method], model[method])


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_the_model_frees_as_the_live_tree_does(live_and_model):
    # The live tree frees a duplicated span per node (free_segment, free_full_segment) and
    # never calls free_full_segments or the mapping methods; the model before
    # --sglang-scheduler's tree rules called free_full_segments 0.39 times per request.
    live, model = live_and_model
    for method in ("free_full_segments", "free_swa", "set_full_to_swa_mapping", "clear_full_to_swa_mapping"):
        assert live.get(method, 0) == 0 and model.get(method, 0) == 0, method
    for method in ("free_segment", "free_full_segment"):
        assert 0 < model[method] < 0.05 and 0 < live[method] < 0.05, (method, live[method], model[method])


# The disaggregated decode server (traces/live-sglang-0.5.23-disagg-decode-mooncake300.parquet:
# the fake transfer backend, no speculation, 300 Mooncake requests, 16 in flight) against
# `synth disagg-mtp --k 0 --sglang-scheduler`. The live trace counts three requests of the
# server's own (its warm-up and two health checks): 303 admissions for 300 requests.
DISAGG = ROOT / "traces" / "live-sglang-0.5.23-disagg-decode-mooncake300.parquet"


@pytest.fixture(scope="module")
def disagg_live_and_model(tmp_path_factory):
    live = profile(DISAGG, requests=300)  # 2.5 million calls: seconds to read
    args = TraceReader(DISAGG).meta.ctor_args
    out = tmp_path_factory.mktemp("model") / "disagg.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=out, requests=300, workload=MOONCAKE, length_scale=0.03,
                           output_scale=0.5, page_size=args["page_size"], window=128, k=0,
                           full_size=args["size"], swa_size=args["size_swa"], max_running=16,
                           sglang_scheduler=True, speedup=1e9))
    return live, profile(out, requests=300)


@pytest.mark.slow
def test_the_disaggregated_decode_model_is_within_ten_percent_of_the_live_server(disagg_live_and_model):
    from kvreplay.trace.profile import compare

    live, model = disagg_live_and_model
    assert set(live.per_request()) == set(model.per_request())  # the same methods, no more
    for method, n in live.per_request().items():
        assert model.per_request()[method] == pytest.approx(n, rel=0.10), (method, n, model.per_request()[method])
    # and every other figure profile sets side by side (tokens per extend, batch sizes, slots per free, ...)
    for figure, x, y, ratio in compare(live, model).rows:
        assert ratio is None or abs(ratio - 1) <= 0.10, (figure, x, y)


# The speculative-decoding server (traces/live-sglang-0.5.23-swa-speculative-mooncake24.parquet:
# STANDALONE with one draft step, 24 Mooncake requests at a hundredth of their length, 8 in
# flight) against `synth radix-swa --speculative --k 1 --sglang-scheduler`: sglang 0.5.23's
# draft slots in batched alloc_extend, a row's overallocation freed in a call of its own.
SPEC = ROOT / "traces" / "live-sglang-0.5.23-swa-speculative-mooncake24.parquet"


@pytest.mark.slow
def test_the_speculative_model_is_within_ten_percent_of_the_live_server(tmp_path):
    from kvreplay.trace.profile import compare

    live = profile(SPEC, requests=24)
    args = TraceReader(SPEC).meta.ctor_args
    out = tmp_path / "spec.parquet"
    synthesize(SynthConfig(scenario="radix-swa", out=out, requests=24, workload=MOONCAKE, length_scale=0.01,
                           output_scale=0.25, page_size=args["page_size"], block_tokens=16, window=128,
                           full_size=args["size"], swa_size=args["size_swa"], max_running=8, speculative=True,
                           k=1, sglang_scheduler=True, speedup=1e9))
    model = profile(out, requests=24)
    assert set(live.per_request()) == set(model.per_request()) and "alloc_decode" not in live.per_request()
    for method, n in live.per_request().items():
        assert model.per_request()[method] == pytest.approx(n, rel=0.10), (method, n, model.per_request()[method])
    for figure, x, y, ratio in compare(live, model).rows:
        assert ratio is None or abs(ratio - 1) <= 0.10, (figure, x, y)


HYBRID = ROOT / "traces" / "live-sglang-0.5.23-lfm2-mamba-mooncake40.parquet"


def test_the_state_pool_model_is_within_ten_percent_of_the_live_server(tmp_path):
    """``synth hybrid-mamba --no-extra-buffer`` beside the live LFM2 server's state pool
    (40 Mooncake requests sent at once, 16 in flight; the server ran 8, its state slots'
    bound). Every method the live pool was called with at least five times is within 10%
    per request. Two were called once each live: one ``free_mamba_cache`` (a warm-up
    prompt the cache already held) and one ``set_request`` (a row re-allocated with its
    KV length); the model makes neither, and both stay rare in both."""
    live = profile(HYBRID)
    args = TraceReader(HYBRID).meta.ctor_args
    out = tmp_path / "hybrid.parquet"
    synthesize(SynthConfig(scenario="hybrid-mamba", out=out, requests=40, workload=MOONCAKE, length_scale=0.03,
                           output_scale=1.0, state_slots=args["mamba_size"], max_running=args["size"],
                           full_size=65536, batch_tokens=4096, no_extra_buffer=True, aborts=0.0, speedup=1e9))
    model = profile(out)
    assert live.requests and model.requests == 40
    busy = {m: n for m, n in live.per_request().items() if n * live.requests >= 5}
    assert {"alloc_reqs", "free_req", "state.alloc", "state.free", "state.alloc_group_begin"} <= set(busy)
    for method, n in busy.items():
        assert model.per_request().get(method, 0.0) == pytest.approx(n, rel=0.10), (method, n, model.per_request())
    for method in set(live.per_request()) | set(model.per_request()):
        if method not in busy:
            assert live.per_request().get(method, 0) < 0.05 and model.per_request().get(method, 0) < 0.05, method


TREE = ROOT / "traces" / "live-sglang-0.5.23-tree-mooncake60.parquet"


def test_the_tree_model_is_within_ten_percent_of_the_live_tree(tmp_path):
    """``synth prefix-tree`` beside the live sglang 0.5.23 server's own prefix cache (60
    Mooncake requests sent at once, 16 in flight, page size 1, a pool that never ran
    short). The server prefilled no prompt in chunks, so the model's chunk is a real
    server's (thousands of tokens), not its default; its client aborted none. Every
    method is within 10% per request."""
    live = profile(TREE)
    args = TraceReader(TREE).meta.ctor_args
    out = tmp_path / "tree.parquet"
    synthesize(SynthConfig(scenario="prefix-tree", out=out, requests=60, workload=MOONCAKE, length_scale=0.03,
                           output_scale=0.5, page_size=args["page_size"], block_tokens=16, full_size=args["size"],
                           max_running=16, speedup=1e9, params={"chunk": "8192", "abort_share": "0"}))
    model = profile(out)
    methods = ("match_prefix", "lock", "unlock", "extend", "checkpoint", "free_kv_row", "release", "kv.alloc")
    live_per, model_per = live.per_request(), model.per_request()
    for method in methods:
        assert model_per[method] == pytest.approx(live_per[method], rel=0.10), (method, live_per, model_per)
