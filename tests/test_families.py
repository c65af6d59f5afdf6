"""A pool family is one record (kvreplay/contract/) and one folder (kvreplay/families/):
no module outside the families' folders branches on a family's or engine's name, and a toy third family, kept in the
tests alone (tests/toyfam/), goes through every command."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest
import toyfam

from kvreplay.contract import registry

PKG = Path(__file__).resolve().parents[1] / "kvreplay"
TESTS = Path(__file__).resolve().parent


def _names_compared(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Where a string naming one of ``names`` is compared with something, tested for
    membership, or keys a dict: a branch on it."""
    found = []
    for node in ast.walk(tree):
        consts: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                consts += list(c.elts) if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
        elif isinstance(node, ast.Dict):
            consts = [k for k in node.keys if k is not None]
        found += [(node.lineno, c.value) for c in consts if isinstance(c, ast.Constant) and c.value in names]
    return found


def test_no_module_outside_the_families_branches_on_a_family_or_engine_name():
    names = {f.name for f in registry.families()} | {e.name for e in registry.engines()}
    assert {"swa", "vllm", "sglang"} <= names
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        if path.is_relative_to(PKG / "families"):
            continue
        hits += [f"{path.relative_to(PKG.parent)}:{line}: {name!r}"
                 for line, name in _names_compared(ast.parse(path.read_text()), names)]
    assert hits == [], "family knowledge outside kvreplay/families/ (ask the record instead):\n" + "\n".join(hits)


def test_the_name_check_finds_a_branch():
    tree = ast.parse('if meta.family == "swa":\n    pass\nx = {"vllm": 1}\ny = f in ("token", "other")\n')
    assert [n for _, n in _names_compared(tree, {"swa", "vllm", "token"})] == ["swa", "vllm", "token"]


@pytest.fixture
def toy(monkeypatch):
    """The toy family, registered here and named to every process kvreplay starts."""
    monkeypatch.setenv(registry.FAMILIES_ENV, "toyfam")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    registry.register(toyfam.TOY)
    yield toyfam.TOY
    registry.unregister("toy")


def _json(res):
    assert res.returncode in (0, 1), res.stderr
    return json.loads(res.stdout)


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_toy_family_from_the_tests_goes_through_every_command(toy, tmp_path, cli):
    db = f"sqlite:///{tmp_path / 'k.db'}"
    builds = _json(cli("builds", "--json"))
    listed = {b["build"]: b["family"] for b in builds["builtin"]} if isinstance(builds, dict) else \
        {b["build"]: b["family"] for b in builds}
    assert listed["builtin:toy"] == "toy" and listed["builtin:toy@highest-first"] == "toy"

    trace = tmp_path / "toy.parquet"
    res = cli("synth", "toy-churn", "-n", "300", "--full-size", "64", "-o", str(trace))
    assert res.returncode == 0, res.stderr
    info = _json(cli("inspect", str(trace), "--json"))
    assert info["meta"]["family"] == "toy"
    assert _json(cli("profile", str(trace), "--json"))["family"] == "toy"

    clean = cli("replay", str(trace), "--build", "builtin:toy", "--db", db, "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    bad = _json(cli("replay", str(trace), "--build", "builtin:toy@highest-first", "--mode", "remap", "--db", db,
                    "--json"))
    assert bad["first_violation"]["invariant"] == "toy-order"
    assert bad["first_violation"]["rule"] == "not-lowest-first"

    diff = cli("diff", str(trace), "--base", "builtin:toy", "--candidate", "builtin:toy@highest-first", "--json")
    assert diff.returncode == 1 and json.loads(diff.stdout)["differing_calls"] > 0, diff.stdout + diff.stderr

    small = tmp_path / "small.parquet"
    mini = _json(cli("minimize", str(trace), "--build", "builtin:toy@highest-first", "-o", str(small), "--json"))
    assert mini["calls_after"] < mini["calls_before"]
    again = _json(cli("replay", str(small), "--build", "builtin:toy@highest-first", "--mode", "remap",
                      "--no-store", "--json"))
    assert again["first_violation"]["rule"] == "not-lowest-first"

    matrix = cli("matrix", str(trace), "--builds", "builtin:toy,builtin:toy@highest-first", "--mode", "remap",
                 "--db", db, "--json")
    assert matrix.returncode == 1, matrix.stderr
    assert "toy-order" in matrix.stdout

    found = _json(cli("bisect", str(trace), "--builds", "builtin:toy,builtin:toy,builtin:toy@highest-first",
                      "--mode", "remap", "--db", db, "--json"))
    assert found["first_bad"]["spec"] == "builtin:toy@highest-first" and found["target"]["id"] == "toy-order"

    page_path = tmp_path / "r.html"
    res = cli("report", str(bad["run_id"]), "--db", db, "-o", str(page_path))
    assert res.returncode == 0, res.stderr
    page = page_path.read_text()
    assert "not-lowest-first" in page and "toy" in page


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_recorded_program_of_the_toy_family_replays(toy, tmp_path, cli):
    prog = ("from toyfam.pool import StackPool\n"
            "p = StackPool(32)\n"
            "held = [p.alloc(3) for _ in range(5)]\n"
            "p.free_group_begin(); p.free(held[1]); p.free(held[3]); p.free_group_end()\n"
            "p.available_size(); p.alloc(2)\n")
    out = tmp_path / "rec"
    res = cli("record", "-o", str(out), "--part-s", "0", "--part-rows", "0", "--", sys.executable, "-c", prog)
    assert res.returncode == 0, res.stderr
    traces = sorted(out.glob("kvreplay-*.parquet"))
    assert len(traces) == 1, list(out.iterdir())
    res = _json(cli("replay", str(traces[0]), "--build", "builtin:toy", "--no-store", "--json"))
    assert res["status"] == "clean" and res["calls_replayed"] >= 10, res
