#!/usr/bin/env bash
# One short run on a machine with an NVIDIA GPU (rarely available: prepared on CPU,
# meant to finish in under 15 minutes). Prints one summary at the end.
#
#   scripts/gpu-check.sh            # uses the sglang tier's venv (sglang 0.5.23 + kvreplay), creates it if missing
#
# It does, in order, each step bounded by `timeout` so one hang cannot eat the rest:
#  1. kvreplay matrix of the corpus on --device cuda: the builtin pools and two sglang
#     releases whose paged allocators launch real Triton kernels (0.5.12, before the
#     CPU fallback) and 0.5.23; every run must say kernels: cuda where kernels ran.
#  2. bench/gpu_recorder.py (recorder overhead and host syncs per call on CUDA).
#  3. Real sglang servers on tiny models made here with random weights (scripts/tiny_model.py:
#     no download, no tokenizer), each launched under `kvreplay record` with page size 16,
#     driven with Mooncake requests by `kvreplay drive`, stopped with Ctrl-C; every trace
#     each left replays on its builtin pool and on the installed sglang:
#     live        a plain Llama, radix cache on (the CPU live tier's path, on CUDA);
#     disagg      the seed's setting: a hybrid sliding-window model as a disaggregated decode
#                 server (--disaggregation-mode decode, fake transfer backend: no prefill
#                 server needed; drive --disagg-decode names the fake prefill side), whose
#                 SWA pool preallocates through alloc_extend_swa_tail; also on CPU (live tier);
#     seed        the seed's exact setting: that server with speculative decoding
#                 (STANDALONE, three draft steps), which CPU cannot run; its trace also
#                 replays on sglang==0.5.12 and 0.5.12.post1 (remap): the seed bug from a real
#                 scheduler, flagged at its source call on 0.5.12, fixed in 0.5.12.post1?
#     spec        speculative decoding: STANDALONE with the tiny Llama as its own draft (three
#                 draft steps: on CPU only one runs, under --cpu-compat), and NGRAM (no draft
#                 model; dies on CPU). See docs/recording.md.
#     mamba       a tiny hybrid Qwen3-Next (gated delta net and full attention) with the
#                 extra buffer, which sglang allows on GPUs only: its state pool's trace
#                 replays on builtin:mamba, its variant and sglang 0.5.12 / 0.5.13 (remap).
#     mamba-unified  that model with --enable-unified-memory (tokens and state slots from one
#                 buffer), which no CPU server builds: which pools the recorder is handed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${KVREPLAY_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvreplay/venvs/sglang-0.5.23}
OUT=${OUT:-$(mktemp -d)}/gpu-check
mkdir -p "$OUT"
export KVREPLAY_DB="sqlite:///$OUT/kvreplay.db" KVREPLAY_PROGRESS_S=30
declare -A RESULT

if ! "$VENV/bin/python" -c "import sglang, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    if ! "$VENV/bin/python" -c "import sglang" 2>/dev/null; then
        python3 -m venv "$VENV" && "$VENV/bin/pip" install --quiet "sglang==0.5.23" || { echo "no sglang"; exit 3; }
    fi
    "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available()" || { echo "gpu-check: no CUDA device"; exit 3; }
fi
"$VENV/bin/pip" install --quiet -e ".[dev]" || exit 3
PY="$VENV/bin/python"; KV="$VENV/bin/kvreplay"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# 1. The corpus on CUDA.
timeout 300 "$KV" matrix traces --builds builtin:swa,builtin:paged,sglang==0.5.12,sglang==0.5.23 \
    --device cuda --mode remap -j 4 --json > "$OUT/matrix.json" 2> "$OUT/matrix.err"
RESULT[matrix]="exit $? $("$PY" - "$OUT/matrix.json" <<'PY'
import collections, json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:
    print(f"(no result: {exc})"); sys.exit()
by = collections.Counter((c["build"], c["status"], c["kernels"]) for c in d["cells"])
print("; ".join(f"{b} {s} kernels={k} x{n}" for (b, s, k), n in sorted(by.items())))
PY
)"

# 2. Recorder overhead on CUDA.
timeout 180 "$PY" bench/gpu_recorder.py --requests 1000 --repeat 3 > "$OUT/gpu_recorder.txt" 2>&1
RESULT[gpu_recorder]="exit $? $(tail -n 3 "$OUT/gpu_recorder.txt" | tr '\n' ' ')"

# 3. Live servers under kvreplay record (the CPU live tier's path, on CUDA, and what CPU cannot run).
"$PY" scripts/tiny_model.py "$OUT/tiny-llama" > /dev/null
"$PY" scripts/tiny_model.py "$OUT/tiny-swa" --swa 128 > /dev/null
"$PY" scripts/tiny_model.py "$OUT/tiny-gdn" --gdn > /dev/null
live_step() {  # NAME MODEL REQUESTS EXTRA_REPLAY_BUILDS [server args...]
    local name=$1 model=$2 n=$3 extra=$4; shift 4
    local traces="$OUT/$name" port=31999
    "$KV" record --out "$traces" -- "$PY" -m sglang.launch_server --model-path "$model" --skip-tokenizer-init \
        --page-size 16 --port $port --mem-fraction-static 0.3 --disable-cuda-graph --log-level warning "$@" \
        > "$OUT/$name-server.log" 2>&1 &
    local server=$!
    for _ in $(seq 1 240); do
        curl -sf localhost:$port/health > /dev/null && break
        kill -0 $server 2>/dev/null || break
        sleep 1
    done
    timeout 240 "$KV" drive http://127.0.0.1:$port -w workloads/mooncake/synthetic_trace.jsonl -n "$n" \
        --length-scale 0.03 -c 32 ${DRIVE_EXTRA:-} > "$OUT/$name-requests.txt" 2>&1
    local drove="exit $? $(tail -n 1 "$OUT/$name-requests.txt")"
    kill -INT $server 2>/dev/null; wait $server
    local replays=""
    for t in "$traces"/*.parquet; do
        [ -e "$t" ] || continue
        local fam
        fam=$("$KV" inspect "$t" --json | "$PY" -c "import json,sys; print(json.load(sys.stdin)['meta']['family'])")
        for b in "builtin:$fam" sglang $extra; do
            timeout 300 "$KV" replay "$t" --build "$b" --device cuda --mode remap --json > "$OUT/replay.json" 2> "$OUT/replay.err"
            replays+="$(basename "$t") on $b: $("$PY" -c "import json; d=json.load(open('$OUT/replay.json')); print(d['status'], d['calls_replayed'], 'calls', d['first_violation'] and d['first_violation']['rule'] or '')" 2>/dev/null || echo "failed: $(tail -n 1 "$OUT/replay.err")"); "
        done
    done
    RESULT[$name]="requests: $drove; ${replays:-no traces recorded (see $OUT/$name-server.log: $(grep -E '^[A-Za-z_.]*(Error|Exception):' "$OUT/$name-server.log" | tail -n 1))}"
}
live_step live "$OUT/tiny-llama" 300 ""
DISAGG=(--disaggregation-mode decode --disaggregation-transfer-backend fake)
DRIVE_EXTRA=--disagg-decode live_step disagg "$OUT/tiny-swa" 300 "sglang==0.5.12 sglang==0.5.12.post1" "${DISAGG[@]}"
DRIVE_EXTRA=--disagg-decode live_step seed "$OUT/tiny-swa" 300 "sglang==0.5.12 sglang==0.5.12.post1" "${DISAGG[@]}" \
    --speculative-algorithm STANDALONE --speculative-draft-model-path "$OUT/tiny-swa" --speculative-num-steps 3 \
    --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
live_step spec-standalone "$OUT/tiny-llama" 100 "" --speculative-algorithm STANDALONE \
    --speculative-draft-model-path "$OUT/tiny-llama" --speculative-num-steps 3 --speculative-eagle-topk 1 \
    --speculative-num-draft-tokens 4
live_step spec-ngram "$OUT/tiny-llama" 100 "" --speculative-algorithm NGRAM --speculative-ngram-max-bfs-breadth 1 \
    --speculative-num-draft-tokens 4
# The state pool with the extra buffer (a tracking pair per request, donation to the cache,
# free_mamba_cache keeping an entry), which sglang allows on a GPU only: the mamba family's
# live path that CPU cannot take (docs/mamba.md).
live_step mamba "$OUT/tiny-gdn" 200 "builtin:mamba@stale-ping-pong sglang==0.5.12 sglang==0.5.13" \
    --mamba-radix-cache-strategy extra_buffer --max-mamba-cache-size 96
# The unified budget (--enable-unified-memory: KV tokens and state slots carved from one
# buffer, UnifiedMambaTokenToKVPoolAllocator), which no CPU server builds: it needs a
# stride-aware attention backend (fa3, fa4, flashinfer, triton, trtllm_mha; the CPU has
# torch_native, and the tiny LFM2 refuses triton). What it records is not yet replayed:
# the step says which pools a real server hands the recorder.
live_step mamba-unified "$OUT/tiny-gdn" 100 "" --enable-unified-memory --max-mamba-cache-size 96

echo "=== gpu-check summary ($(cat "$OUT/gpu.txt")) ==="
for k in matrix gpu_recorder live disagg seed spec-standalone spec-ngram mamba mamba-unified; do echo "$k: ${RESULT[$k]}"; done
echo "files: $OUT"
