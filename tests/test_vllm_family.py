"""The vllm family without vLLM: kvreplay's own manager (builtin:vllm) driven by the
workload model (``synth vllm-prefix``), replayed, checked, set beside the live vLLM
server's trace in the corpus, and refused in one line where a command or a build does
not speak the family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvreplay.jobs.minimize import minimize
from kvreplay.replay.dispatch import replay
from kvreplay.trace.profile import profile
from kvreplay.workload.synth import SynthConfig, synthesize

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
LIVE = TRACES / "live-vllm-0.32.0-prefix-mooncake300.parquet"
MOONCAKE = ROOT / "workloads" / "mooncake" / "synthetic_trace.jsonl"


def _model(out: Path, requests: int, full_size: int, max_running: int) -> Path:
    """synth vllm-prefix on the live trace's Mooncake requests, blocks of 32."""
    synthesize(SynthConfig(scenario="vllm-prefix", out=out, requests=requests, workload=MOONCAKE, length_scale=0.03,
                           output_scale=0.5, block_tokens=32, full_size=full_size, max_running=max_running,
                           speedup=1e9))
    return out


@pytest.fixture(scope="module")
def model_trace(tmp_path_factory):
    """The live trace's requests and pool (1,024 blocks of 32), 16 running."""
    return _model(tmp_path_factory.mktemp("vllm") / "model.parquet", 300, 32768, 16)


@pytest.fixture(scope="module")
def profiles(model_trace):
    return profile(LIVE), profile(model_trace)


@pytest.fixture
def kvreplay(cli, monkeypatch):
    """``kvreplay(*args, cwd=None)``: the command run in this process (the cli fixture)."""
    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        if cwd is not None:
            monkeypatch.chdir(cwd)
        return cli(*args)
    return run


def test_the_model_replays_strict_clean_on_the_builtin_manager(model_trace):
    r = replay(model_trace, "builtin:vllm", mode="strict", device="cpu")
    assert r.status == "clean" and r.calls_replayed > 30_000, (r.first_divergence, r.first_violation)


@pytest.mark.slow
def test_the_live_server_trace_replays_strict_clean_on_the_builtin_manager():
    r = replay(LIVE, "builtin:vllm", mode="strict", device="cpu")
    assert r.status == "clean" and r.calls_replayed == 31_075, (r.first_divergence, r.first_violation)


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
@pytest.mark.parametrize("method", ["allocate_slots", "get_computed_blocks", "free_request", "new_step_starts"])
def test_the_model_makes_the_live_servers_calls_per_request_within_ten_percent(profiles, method):
    live, model = (p.per_request() for p in profiles)
    assert model[method] == pytest.approx(live[method], rel=0.10), (method, live[method], model[method])


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_the_model_shares_prefixes_as_the_live_server_does(profiles):
    live, model = profiles
    assert live.prefix_hit and model.prefix_hit == pytest.approx(live.prefix_hit, rel=0.10)
    assert model.decode_batch["mean"] == pytest.approx(live.decode_batch["mean"], rel=0.10)


def test_a_double_free_is_named_at_the_free_and_a_changed_free_order_at_its_call(tmp_path):
    small = tmp_path / "small.parquet"
    synthesize(SynthConfig(scenario="vllm-prefix", out=small, requests=40, workload=MOONCAKE, length_scale=0.03,
                           output_scale=0.2, block_tokens=32, full_size=32768, max_running=16, speedup=1e9))
    r = replay(small, "py:block_breakers:DoubleFreeManager", mode="strict", device="cpu")
    first = r.first_violation
    assert r.status == "violation" and (first.invariant, first.rule) == ("block-pool", "negative-ref-count")
    assert first.method == "free_request"
    (tmp_path / "forward.py").write_text(
        "from kvreplay.families.vllm.pool import BlockManager\n"
        "class Forward(BlockManager):\n"
        "    def _free(self, **wire):\n"
        "        blocks = self._pop(wire['request_id'])\n"
        "        self.wire_blocks.free_blocks([b.block_id for b in blocks])  # not the tail first\n")
    sys.path.insert(0, str(tmp_path))
    try:
        r = replay(small, "py:forward:Forward", mode="strict", device="cpu")
    finally:
        sys.path.remove(str(tmp_path))
    assert r.status == "divergence" and r.first_divergence.kind == "nested"
    assert r.first_divergence.method == "free_request"


def _with_ctor(src: Path, dst: Path, **changes: object) -> Path:
    table = pq.read_table(src)
    md = dict(table.schema.metadata)
    ctor = json.loads(md[b"kvreplay.ctor_args"])
    ctor.update(changes)
    md[b"kvreplay.ctor_args"] = json.dumps(ctor).encode()
    pq.write_table(table.replace_schema_metadata(md), dst)
    return dst


@pytest.mark.slow_cases(
    "changes3-watermark must be a number in 0..1",
    "changes4-use_eagle must be true or false",
    "changes1-num_blocks must be a whole number",
    "changes2-enable_caching must be true or false",
)
@pytest.mark.parametrize("changes, said", [
    ({"attention": ["full"]}, "attention must name the manager's attention kinds"),
    ({"num_blocks": -1}, "num_blocks must be a whole number"),
    ({"enable_caching": "yes"}, "enable_caching must be true or false"),
    ({"watermark": 7}, "watermark must be a number in 0..1"),
    ({"use_eagle": "yes"}, "use_eagle must be true or false"),
])
def test_damaged_constructor_arguments_are_one_line_errors(tmp_path, changes, said, kvreplay):
    bad = _with_ctor(LIVE, tmp_path / "bad.parquet", **changes)
    out = kvreplay("replay", str(bad), "--build", "builtin:vllm", "--no-store")
    assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.slow
def test_a_hybrid_managers_trace_reads_and_says_which_builds_cannot_take_it(tmp_path, kvreplay):
    hybrid = _with_ctor(LIVE, tmp_path / "hybrid.parquet", attention="FullAttentionSpec,SlidingWindowSpec")
    assert kvreplay("inspect", str(hybrid)).returncode == 0
    out = kvreplay("replay", str(hybrid), "--build", "builtin:vllm", "--no-store")
    assert out.returncode == 125 and "full attention only" in out.stderr, out.stderr


def test_block_ids_outside_the_pool_are_a_divergence_not_another_block(tmp_path, kvreplay):
    small = tmp_path / "small.parquet"  # the seeded stream: shared prefixes from the start
    synthesize(SynthConfig(scenario="vllm-prefix", out=small, requests=40, block_tokens=16, full_size=16384,
                           max_running=16))
    table = pq.read_table(small)
    rows = table.to_pylist()
    hit = next(i for i, r in enumerate(rows) if any(
        a["name"] == "new_computed_blocks" and a["data"] and a["data"][0] == 1 and len(a["data"]) > 2
        for a in r["args"]))
    rows = rows[:hit + 1]
    for a in rows[hit]["args"]:
        if a["name"] == "new_computed_blocks":
            a["data"] = [1, 1, -1]  # block -1: Python would take the pool's last block
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), bad)
    out = kvreplay("replay", str(bad), "--build", "builtin:vllm", "--no-store", "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["divergence_counts"].get("exception"), out.stdout


@pytest.mark.slow
def test_hash_words_that_make_no_whole_hash_are_a_divergence_not_a_crash(tmp_path, kvreplay):
    table = pq.read_table(LIVE).slice(0, 40)
    rows = table.to_pylist()
    for r in rows:
        for a in r["args"]:
            if a["name"] == "request_hash_len" and a["i"]:
                a["i"] = 40  # 5 words per hash: the recorded 4-word hashes make no whole one (a length
                # past any hash's, 7000, is refused before the replay: test_hostile_sizes.py)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), bad)
    out = kvreplay("replay", str(bad), "--build", "builtin:vllm", "--no-store", "--json")
    assert out.returncode == 1, out.stderr
    assert json.loads(out.stdout)["divergence_counts"].get("exception")


@pytest.mark.slow_cases("args2-the minimal trace itself is the reproducer", "args1-nothing to minimize")
@pytest.mark.parametrize("args, said", [
    (["replay", str(LIVE), "--build", "builtin:swa"], "records a vllm pool but builtin:swa is a swa pool"),
    (["minimize", str(LIVE), "-b", "builtin:vllm", "-o", "small.parquet"], "nothing to minimize"),
    (["minimize", str(LIVE), "-b", "builtin:vllm@pin-before-room-check", "-o", "small.parquet", "--emit-test",
      "t.py"], "the minimal trace itself is the reproducer"),
])
def test_what_does_not_speak_the_family_says_so_in_one_line(args, said, tmp_path, kvreplay):
    out = kvreplay(*args, *(["--no-store"] if args[0] == "replay" else []), cwd=tmp_path)
    assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.fixture(scope="module")
def crowded_trace(tmp_path_factory):
    """The live trace's requests on a pool of 256 blocks with 32 running: admissions wait for room."""
    return _model(tmp_path_factory.mktemp("vllm") / "crowded.parquet", 120, 8192, 32)


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_pinning_a_prefix_hit_before_the_room_check_is_named_at_that_allocate_slots(crowded_trace):
    """vLLM #11565: the leaked hit is found at the allocate_slots that returned None, in
    strict and in remap mode; the correct manager replays the same trace clean in both."""
    for mode in ("strict", "remap"):
        assert replay(crowded_trace, "builtin:vllm", mode=mode).status == "clean"
        r = replay(crowded_trace, "builtin:vllm@pin-before-room-check", mode=mode)
        first = r.first_violation
        assert first is not None and f"{first.invariant}/{first.rule}" == "block-pool/ref-count-not-owners"
        assert first.method == "allocate_slots" and first.detected_call == first.call


def test_remap_hands_a_request_the_builds_own_prefix_hit(crowded_trace, tmp_path):
    """Another manager finds other hits: remap gives allocate_slots the build's lookup,
    its tokens in place of the recorded ones, and the replay stays clean."""
    from kvreplay.families.vllm.replayer import BlockRemap

    remap = BlockRemap(32)

    class Call:
        method, target = "allocate_slots", "manager"
        args = {"request_id": "r", "num_new_tokens": 100, "num_new_computed_tokens": 64,
                "new_computed_blocks": (1, 2, 5, 6)}

    class Lookup:
        method, target, result = "get_computed_blocks", "manager", (64, 0, 1, 2, 5, 6)
        args = {"request_id": "r"}

    class Top:
        call, nested = Lookup, []

    remap.learn(Top, Lookup.args, (32, 0, 1, 1, 9), [])
    got = remap.args(Call)
    assert got["new_computed_blocks"] == (1, 1, 9) and got["num_new_computed_tokens"] == 32
    assert got["num_new_tokens"] == 132  # the request reaches the same length: 164 tokens


@pytest.mark.slow
def test_minimize_shrinks_a_vllm_trace_to_calls_that_still_leak(crowded_trace, tmp_path):
    out = tmp_path / "small.parquet"
    res = minimize(crowded_trace, "builtin:vllm@pin-before-room-check", out)
    assert res.calls_after < res.calls_before / 20
    assert "ref-count-not-owners" in res.shows
    assert replay(out, "builtin:vllm@pin-before-room-check").first_violation.rule == "ref-count-not-owners"
    # on the correct manager the kept calls break no rule (its answers differ from the recording's:
    # the recording is the leaking build's)
    assert not replay(out, "builtin:vllm").violation_counts


def test_synth_drives_the_manager_with_prefix_caching_off(tmp_path, cli):
    """Off, nothing is hashed or hit: the free queue's order alone decides which blocks
    come back, the behaviour vLLM 0.27 changed (traces/vllm-0.27-caching-off-free-order)."""
    out = tmp_path / "off.parquet"
    res = cli("synth", "vllm-prefix", "-n", "40", "--block-tokens", "16", "--full-size", "1024", "--max-running",
              "8", "--no-prefix-caching", "-o", str(out))
    assert res.returncode == 0, res.stderr
    from kvreplay.trace.reader import TraceReader

    reader = TraceReader(out)
    assert reader.meta.ctor_args["enable_caching"] is False
    touched = [c for c in reader.calls() if c.method == "touch"]
    assert touched == []  # no prefix hit ever pins a cached block
    assert replay(out, "builtin:vllm", device="cpu").status == "clean"
    res = cli("synth", "disagg-mtp", "-n", "4", "--no-prefix-caching", "-o", str(tmp_path / "x.parquet"))
    assert res.returncode == 2 and "an option of scenario vllm-prefix, not of" in res.stderr
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("attention, groups", [
    ("full", ("full",)), ("sliding_window:128", ("sliding_window:128",)),
    ("full,sliding_window:64", ("full", "sliding_window:64")),
    ("mamba_align,full", ("mamba_align", "full")), ("mamba_align:2,full", ("mamba_align:2", "full")),
    ("full,mamba", ("full", "mamba")), ("mamba_all", ("mamba_all",)),
    ("sliding_window:", None), ("sliding_window:-4", None), ("sliding_window:1e3", None), ("mamba_align:0", None),
    ("mamba_align:", None), ("mamba_sometimes", None), ("sliding_window", None),
    ("FullAttentionSpec,SlidingWindowSpec", None), ("full,MambaSpec", None), ("full,", None),
    (",".join(["full"] * 17), None),
])
def test_a_traces_attention_names_its_full_sliding_window_and_mamba_groups(attention, groups):
    from kvreplay.families.vllm.vocabulary import Group, check_attention, vllm_groups

    want = groups and tuple(Group(k, int(w or 0)) for k, _, w in (g.partition(":") for g in groups))
    assert vllm_groups(attention) == want
    if groups:
        check_attention(attention)  # a trace may carry every name a build constructs


def test_a_sliding_window_manager_is_vllms_own_and_the_builtin_one_says_so(tmp_path, cli):
    """--attention sliding drives a sliding-window group, which only vLLM's own manager
    builds: the builtin one refuses in one line and writes nothing; sglang's scenarios
    have their own SWA pool."""
    out = tmp_path / "swa.parquet"
    res = cli("synth", "vllm-prefix", "-n", "4", "--attention", "sliding", "--window", "64", "-o", str(out))
    assert res.returncode == 2 and "full attention only" in res.stderr and not out.exists(), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = cli("synth", "decode", "-n", "4", "--attention", "sliding", "-o", str(out))
    assert res.returncode == 2 and "option of scenario vllm-prefix, not of decode" in res.stderr and not out.exists()
    res = cli("synth", "vllm-prefix", "-n", "4", "--attention", "ring", "-o", str(out))
    assert res.returncode == 2 and "attention" in res.stderr and not out.exists(), res.stderr


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_the_corpus_skips_a_sliding_window_trace_on_the_builtin_manager(tmp_path, cli):
    """The corpus's sliding-window trace (vllm-0.33-null-block-ref-count) is for vLLM's
    releases; on builtin:vllm, which models full attention only, ci skips it, saying why."""
    res = cli("ci", str(TRACES), "--build", "builtin:vllm", "--db", f"sqlite:///{tmp_path / 'c.db'}", "--json")
    assert res.returncode == 0, res.stdout[-1000:] + res.stderr[-500:]
    cases = {c["case"]["trace"]: c for c in json.loads(res.stdout)["results"]}
    swa = cases["vllm-0.33-null-block-ref-count"]
    assert swa["outcome"] == "skip" and "full attention only" in " ".join(swa["problems"]), swa
    assert cases["live-vllm-0.32.0-prefix-mooncake300"]["outcome"] == "pass"


def test_synth_takes_the_schedulers_step_budget_and_the_managers_longest_sequence(tmp_path, cli):
    """--batch-tokens is the step's token budget (a long prompt goes in chunks of it) and
    the manager's in-flight bound; --max-model-len the longest sequence it serves. Both
    land in the trace's constructor arguments, and a full-attention pool too small for a
    sequence stops the model in one line instead of waiting forever."""
    out = tmp_path / "chunks.parquet"
    res = cli("synth", "vllm-prefix", "-n", "12", "--block-tokens", "16", "--full-size", "4096",
              "--max-model-len", "4096", "--batch-tokens", "256", "--workload", str(MOONCAKE), "--length-scale",
              "0.05", "-o", str(out))
    assert res.returncode == 0, res.stderr
    from kvreplay.trace.reader import TraceReader

    reader = TraceReader(out)
    assert reader.meta.ctor_args["max_in_flight_tokens"] == 256
    assert reader.meta.ctor_args["max_model_len"] == 4096
    chunks = [c.args["num_new_tokens"] for c in reader.calls() if c.method == "allocate_slots"]
    assert max(chunks) == 256  # prompts longer than a step go in budget-sized chunks
    assert replay(out, "builtin:vllm", device="cpu").status == "clean"
    small = tmp_path / "small.parquet"
    res = cli("synth", "vllm-prefix", "-n", "12", "--block-tokens", "16", "--full-size", "256", "--max-model-len",
              "8192", "--workload", str(MOONCAKE), "--length-scale", "0.1", "-o", str(small))
    assert res.returncode == 2 and "no progress" in res.stderr and not small.exists(), res.stderr
    for bad in (["--batch-tokens", "0"], ["--max-model-len", "4"]):
        res = cli("synth", "vllm-prefix", "-n", "4", *bad, "-o", str(small))
        assert res.returncode == 2 and "\n" not in res.stderr.strip() and not small.exists(), res.stderr
    res = cli("synth", "decode", "-n", "4", "--max-model-len", "4096", "-o", str(small))
    assert res.returncode == 2 and "an option of scenario vllm-prefix, not of" in res.stderr, res.stderr


def test_an_eagle_drafters_hits_give_up_their_last_block(tmp_path, cli):
    """--eagle: the manager is built with use_eagle, every allocation reserves the k draft
    tokens, and each prefix hit is a block shorter than the same workload's without it."""
    from kvreplay.trace.reader import TraceReader

    hits = {}
    for eagle in (False, True):
        out = tmp_path / f"e{eagle}.parquet"
        res = cli("synth", "vllm-prefix", "-n", "30", "--block-tokens", "16", "--full-size", "16384",
                  "--max-running", "1", *(["--eagle"] if eagle else []), "-o", str(out))
        assert res.returncode == 0, res.stderr
        reader = TraceReader(out)
        assert reader.meta.ctor_args.get("use_eagle", False) is eagle
        calls = list(reader.calls())
        assert all(c.args.get("num_lookahead_tokens", 0) == (3 if eagle else 0)
                   for c in calls if c.method == "allocate_slots")
        hits[eagle] = [c.result[0] for c in calls if c.method == "get_computed_blocks"]
        assert replay(out, "builtin:vllm", device="cpu").status == "clean"
    # one request at a time: the same lookups in the same order, each a block shorter with a drafter
    assert len(hits[True]) == len(hits[False]) and any(hits[False])
    assert all(e == max(0, p - 16) for p, e in zip(hits[False], hits[True], strict=True)), hits
    res = cli("synth", "decode", "-n", "4", "--eagle", "-o", str(tmp_path / "x.parquet"))
    assert res.returncode == 2 and "an option of scenario vllm-prefix, not of" in res.stderr, res.stderr


def test_the_caching_off_free_order_variant_parts_where_vllm_0_27_does():
    """builtin:vllm@tail-with-caching-off is 0.27's free_blocks on kvreplay's manager: with
    caching off the trace recorded on 0.32 parts at call #35 with the coldest blocks
    (0.27.1's own answer there; the vLLM tier compares every divergence), and with caching
    on it is the correct manager."""
    r = replay(ROOT / "traces" / "vllm-0.27-caching-off-free-order.parquet", "builtin:vllm@tail-with-caching-off")
    d = r.first_divergence
    assert (d.call, d.method, d.kind) == (35, "allocate_slots", "result") and d.actual[:4] == [1, 12, 197, 198], d
    assert not r.violation_counts  # nothing lost or shared: other blocks only
    assert replay(ROOT / "traces" / "vllm-11565-pin-before-room-check.parquet",
                  "builtin:vllm@tail-with-caching-off").status == "clean"
