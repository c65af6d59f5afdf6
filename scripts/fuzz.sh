#!/usr/bin/env bash
# A long fuzz campaign over the trace reader, the replayer and the manifest reader:
#   scripts/fuzz.sh [CASES] [SEED]      (default 20000 traces, seed from the date)
# Every case must exit 0, 1, 2 or 125, with one line and nothing written on bad input.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVREPLAY_FUZZ_CASES="${1:-20000}"
export KVREPLAY_FUZZ_SEED="${2:-$(date +%Y%m%d)}"
exec python -m pytest -m slow -n 0 -s tests/test_fuzz.py -k traces_many
