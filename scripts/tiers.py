"""What each test tier holds, from the markers on the tests themselves.

    python scripts/tiers.py [--out DIR]

Collects the tests once and prints each tier's count (the fast tier is the README's
test command: every test that no marker of tests/tier_markers.py keeps out, the tiers'
one declaration); with ``--out`` it writes
each tier's test ids to DIR/TIER.txt. .ci/run keeps those files as artefacts beside the
fast tier's time. The sglang, live, soak and vllm tiers' modules need their engines
installed: collected with an interpreter that lacks them, they hold nothing here, and
their tier scripts (scripts/sglang-tier.sh, scripts/vllm-tier.sh) list them as they run."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # as conftest.py imports it, so both read one table
from tier_markers import TIERS  # noqa: E402


class _Collected:
    def __init__(self) -> None:
        self.items: list[tuple[str, set[str]]] = []

    @pytest.hookimpl(trylast=True)  # after conftest.py has added the slow cases' markers
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.items = [(i.nodeid, {m.name for m in i.iter_markers()}) for i in items]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write each tier's test ids to OUT/TIER.txt")
    a = ap.parse_args()
    got = _Collected()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # only the tiers are news
        code = pytest.main(["--collect-only", "-qq", "-o", "addopts=", "-p", "no:cacheprovider",
                            str(ROOT / "tests")], plugins=[got])
    if code not in (0, 5):
        print(f"tiers: collecting the tests failed (pytest exit {code})", file=sys.stderr)
        return 1
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    for tier, takes in TIERS.items():
        ids = [nodeid for nodeid, marks in got.items if takes(marks)]
        print(f"{tier:8s} {len(ids):5d} tests", flush=True)
        if a.out:
            (a.out / f"{tier}.txt").write_text("".join(f"{i}\n" for i in ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
