"""The docs keep up with the code: every checker rule is in the rules table and
explained, and nothing in the repository points outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kvreplay.check.rules import RULES

ROOT = Path(__file__).parents[1]


def test_every_rule_in_the_table_is_documented():
    # That the checker fires exactly the table's rules is held by construction
    # (InvariantChecker._flag refuses any other) and tests/test_rules.py (a case per rule).
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


def test_every_docs_pointer_in_the_code_leads_to_a_page_and_its_section():
    """A docstring or message that names a page of docs/ (and "Section") names one that
    exists, and a heading of it."""
    import re

    cited = re.compile(r'docs/([\w.-]+\.md)(?:, "([^"]+)")?')
    found = 0
    for folder in ("kvreplay", "scripts", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for page, section in cited.findall(path.read_text()):
                found += 1
                doc = ROOT / "docs" / page
                assert doc.is_file(), f"{path.relative_to(ROOT)} points to docs/{page}"
                if section:
                    headings = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
                    assert any(h.startswith(section) for h in headings), \
                        f"{path.relative_to(ROOT)} points to docs/{page}, \"{section}\""
    assert found >= 10


def _repo_files() -> set[str]:
    skip = (".venv", "build", "site", ".git", ".hypothesis", "node_modules")
    return {str(p.relative_to(ROOT)) + ("/" if p.is_dir() else "") for p in ROOT.rglob("*")
            if not p.relative_to(ROOT).parts[0].startswith(skip) and "__pycache__" not in p.parts}


def test_every_module_the_layout_docs_name_exists():
    """docs/design.md's tables and text name modules and folders; each must exist, so a
    move that forgets the docs fails here. docs/layout.md's tree is held closer, both
    ways, by tests/test_docs_layout.py (every module named, nothing named that is gone)."""
    files = _repo_files()
    missing = []
    for name in re.findall(r"`([a-z_/]+(?:\.py|\.c|/))`", (ROOT / "docs" / "design.md").read_text()):
        if not any(f == name or f.endswith("/" + name) or f == "kvreplay/" + name for f in files):
            missing.append(f"design.md: {name}")
    assert missing == [], missing
