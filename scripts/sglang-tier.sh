#!/usr/bin/env bash
# The integration tier: tests marked `sglang`, run against a real sglang install, then the
# live tier (tests marked `live`: real servers on CPU, recorded and replayed).
#
#   scripts/sglang-tier.sh            # creates its venv on first use (~10 min, ~11 GB), then reuses it
#
# The venv lives in the user's cache (~/.cache/kvreplay/venvs/sglang-VERSION), not in the
# checkout, so a CI run on a fresh clone reuses the last run's install; kvreplay itself is
# installed into it from this checkout every run (editable, seconds).
#   KVREPLAY_SGLANG_VENV=/path/venv scripts/sglang-tier.sh     # use (or create) another venv
#   SGLANG_VERSION=0.5.23 (default)
#   scripts/sglang-tier.sh install    # only the venv and kvreplay in it
#   scripts/sglang-tier.sh soak       # only the soak: a server recorded for KVREPLAY_SOAK_S (1800) seconds
#   scripts/sglang-tier.sh releases   # only the tests on sglang releases and the docs' sglang commands
#   scripts/sglang-tier.sh live       # only the live tier (real servers)
#   KVREPLAY_TIER_INSTALLED=1         # kvreplay is already installed in the venv (a soak runs there now)
#
# Exit codes: 0 passed, 1 a test failed, 3 sglang could not be installed (no network,
# no disk): the tier did not run, which is not the same as passing.
set -uo pipefail
cd "$(dirname "$0")/.."

VERSION=${SGLANG_VERSION:-0.5.23}
VENV=${KVREPLAY_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvreplay/venvs/sglang-$VERSION}
PY="$VENV/bin/python"

have_sglang() {
    "$PY" -c "import sglang, sys; sys.exit(sglang.__version__ != '$VERSION')" 2>/dev/null
}

if ! have_sglang; then
    echo "sglang-tier: installing sglang==$VERSION into $VENV (about 10 minutes)"
    python3 -m venv "$VENV" && "$VENV/bin/pip" install --quiet "sglang==$VERSION"
    if ! have_sglang; then
        echo "sglang-tier: could not install sglang==$VERSION; the integration tier did not run" >&2
        exit 3
    fi
fi
# kvreplay itself, against the torch sglang brought (any torch >= 2.1 will do). Not again
# while a soak runs from the same venv: rebuilding the native recorder under it is no test.
if [ "${KVREPLAY_TIER_INSTALLED:-0}" != 1 ] && ! "$VENV/bin/pip" install --quiet -e ".[dev]"; then
    echo "sglang-tier: could not install kvreplay into $VENV" >&2
    exit 3
fi
case "${1:-all}" in
    install) exit 0 ;;
    # The soak: one server, recorded and watched for half an hour of steady traffic; light
    # enough (the server sleeps when idle, two requests in flight) to run beside CI's other steps.
    soak) exec timeout "$(( ${KVREPLAY_SOAK_S:-1800} + 1200 ))" "$PY" -m pytest -m soak -n 0 -s tests/test_soak.py ;;
    all|releases|live) ;;
    *) echo "sglang-tier: unknown step ${1} (install, soak, releases, live, or nothing for the whole tier)" >&2
       exit 2 ;;
esac
step=${1:-all}
if [ "$step" != live ]; then
    # What this tier holds, collected where its engine is installed (scripts/tiers.py).
    "$PY" scripts/tiers.py | grep -E "^(sglang|live|soak|mamba) "
    "$PY" -m pytest -m "sglang and not mamba" -n 2 --durations=15 --durations-min=15 tests/test_docs_sglang.py tests/test_sglang_releases.py \
        tests/test_sglang_parity.py || exit 1
fi
[ "$step" != releases ] || exit 0
# The live tier: real sglang servers on CPU under kvreplay record, driven with Mooncake
# requests, stopped by Ctrl-C, SIGTERM and a SIGKILL of the scheduler, then replayed.
# One server at a time (each takes a core); bounded as a whole.
timeout "${KVREPLAY_LIVE_BUDGET_S:-1800}" "$PY" -m pytest -m "live and not mamba" -n 0 --durations=15 --durations-min=15 tests/test_live_server.py tests/test_live_tree.py
