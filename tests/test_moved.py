"""Import paths that moved keep working (they are API): each old name imports the module
at its new place, the same object, with one FutureWarning naming the new path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvreplay.moved import MOVED, new_name

# one fresh interpreter for every move (each import is the first of its name there)
PROBE = """
import importlib, json, sys, warnings
out = {}
for old, new in json.loads(sys.argv[1]):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    out[old] = {"same": module is importlib.import_module(new),
                "warnings": [str(w.message) for w in caught if w.category is FutureWarning]}
print(json.dumps(out))
"""


def _probe(pairs: list[tuple[str, str]]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(pairs)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_an_old_path_is_the_new_module_and_says_where_it_went():
    # a moved package's submodule first: its package warns, once, for both
    got = _probe([("kvreplay.family.record", "kvreplay.contract.record"), *sorted(MOVED.items())])
    sub = got.pop("kvreplay.family.record")
    assert sub["same"] and len(sub["warnings"]) == 1 and "kvreplay.family moved" in sub["warnings"][0]
    for old, seen in got.items():
        assert seen["same"], old
        if old != "kvreplay.family":  # imported above, with its submodule
            assert seen["warnings"] == [f"{old} moved to {MOVED[old]}; import it from there (the old path will go)"]


def test_a_name_that_did_not_move_is_left_to_the_import_system():
    assert new_name("kvreplay.trace.reader") is None
    with pytest.raises(ModuleNotFoundError):
        __import__("kvreplay.no_such_module")
