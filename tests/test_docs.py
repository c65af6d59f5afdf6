"""The docs keep up with the code: every checker rule is in the rules table and
explained, and nothing in the repository points outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kvreplay.check.rules import RULES

ROOT = Path(__file__).parents[1]


def test_every_rule_the_checker_flags_is_in_the_table_and_documented():
    src = (ROOT / "kvreplay" / "check" / "checker.py").read_text()
    flagged = set(re.findall(r'"(capacity|free-list|ownership|none-unchanged|swa-mapping)", "([a-z-]+)"', src))
    flagged |= {("quiescence", rule) for rule in re.findall(r'"quiescence" if final else "[a-z-]+", "([a-z-]+)"', src)}
    assert len(flagged) >= 15
    assert {f"{i}/{r}" for i, r in flagged} == set(RULES)
    doc = (ROOT / "docs" / "invariants.md").read_text()
    for rule_id in RULES:
        assert f"`{rule_id}`" in doc, rule_id


def test_nothing_in_the_repository_points_outside_it():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        path = ROOT / name
        if path.suffix in (".parquet", ".so") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for outside in ("DESIGN" + ".md", "../" + "shared"):
            assert outside not in text, (name, outside)
