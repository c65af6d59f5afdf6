"""Functions a reader can hold (issue 61): none in kvreplay/ runs over MAX_LINES lines,
counted from its ``def`` to its last line, signature and docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvreplay"
MAX_LINES = 80

def long_functions(root: Path = ROOT, max_lines: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for each function (method and nested function too)
    longer than ``max_lines``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > max_lines:
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_a_reader_can_hold():
    too_long = long_functions()
    assert too_long == [], f"over {MAX_LINES} lines (def to end); split them:\n" + "\n".join(too_long)


def test_the_count_runs_from_def_to_the_last_line(tmp_path):
    (tmp_path / "m.py").write_text("@decorated\ndef f(\n    a,\n):\n    return a\n\n\nclass C:\n"
                                   "    def g(self):\n        def h():\n" + "            pass\n" * 4)
    assert long_functions(tmp_path, 3) == ["m.py:2 f (4 lines)", "m.py:9 g (6 lines)", "m.py:10 h (5 lines)"]
