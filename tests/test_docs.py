"""The docs keep up with the code: every checker rule has an explanation."""

from __future__ import annotations


def test_every_checker_rule_is_documented():
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    src = (root / "kvreplay" / "replayer" / "invariants.py").read_text()
    rules = set(re.findall(r'"(capacity|free-list|ownership|none-unchanged|swa-mapping|quiescence)", "([a-z-]+)"',
                           src))
    doc = (root / "docs" / "invariants.md").read_text()
    assert len(rules) >= 15
    for inv, rule in rules:
        assert f"`{inv}/{rule}`" in doc or (inv == "quiescence" and "`quiescence/*`" in doc), (inv, rule)
