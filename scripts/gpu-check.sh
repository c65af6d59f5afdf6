#!/usr/bin/env bash
# One short run on a machine with an NVIDIA GPU (rarely available: prepared on CPU,
# meant to finish in under 15 minutes). Prints one summary at the end.
#
#   scripts/gpu-check.sh            # uses .venv-sglang (sglang 0.5.23 + kvreplay), creates it if missing
#
# It does, in order, each step bounded by `timeout` so one hang cannot eat the rest:
#  1. kvreplay matrix of the corpus on --device cuda: the builtin pools and two sglang
#     releases whose paged allocators launch real Triton kernels (0.5.12, before the
#     CPU fallback) and 0.5.23; every run must say kernels: cuda where kernels ran.
#  2. bench/gpu_recorder.py (recorder overhead and host syncs per call on CUDA).
#  3. A real sglang server on a tiny Llama made here with random weights (scripts/tiny_model.py:
#     no download, no tokenizer), launched under `kvreplay record` with page size 16; 300
#     Mooncake requests from `kvreplay drive`; then every trace it left replays on
#     builtin:paged (or builtin:swa) and on the installed sglang.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${KVREPLAY_SGLANG_VENV:-.venv-sglang}
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
timeout 420 "$KV" matrix traces --builds builtin:swa,builtin:paged,sglang==0.5.12,sglang==0.5.23 \
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

# 3. A live server under kvreplay record (the same path as the CPU live tier, on CUDA).
MODEL="$OUT/tiny-llama"
"$PY" scripts/tiny_model.py "$MODEL" > /dev/null
TRACES="$OUT/live"
"$KV" record --out "$TRACES" -- "$PY" -m sglang.launch_server --model-path "$MODEL" --skip-tokenizer-init \
    --page-size 16 --port 31999 --mem-fraction-static 0.3 --disable-cuda-graph --log-level warning \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 180); do
    curl -sf localhost:31999/health > /dev/null && break
    sleep 1
done
timeout 240 "$KV" drive http://127.0.0.1:31999 -w workloads/mooncake/synthetic_trace.jsonl -n 300 \
    --length-scale 0.03 -c 32 > "$OUT/requests.txt" 2>&1
RESULT[requests]="exit $? $(tail -n 1 "$OUT/requests.txt")"
kill -INT "$SERVER" 2>/dev/null; wait "$SERVER"
REPLAYS=""
for t in "$TRACES"/*.parquet; do
    [ -e "$t" ] || continue
    fam=$("$KV" inspect "$t" --json | "$PY" -c "import json,sys; print(json.load(sys.stdin)['meta']['family'])")
    for b in "builtin:$fam" sglang; do
        timeout 120 "$KV" replay "$t" --build "$b" --device cuda --mode remap --json > "$OUT/replay.json" 2>/dev/null
        REPLAYS+="$(basename "$t") on $b: $("$PY" -c "import json; d=json.load(open('$OUT/replay.json')); print(d['status'], d['calls_replayed'], 'calls')" 2>/dev/null || echo failed); "
    done
done
RESULT[live]="${REPLAYS:-no traces recorded (see $OUT/server.log)}"

echo "=== gpu-check summary ($(cat "$OUT/gpu.txt")) ==="
for k in matrix gpu_recorder requests live; do echo "$k: ${RESULT[$k]}"; done
echo "files: $OUT"
