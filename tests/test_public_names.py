"""``from kvreplay import X`` gives the API's object whatever was imported before it,
for every public name: a module of the same name (kvreplay.replay, kvreplay.jobs.minimize,
kvreplay.jobs.bisect) imported first does not take the name's place."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvreplay

# In a fresh process: import every module of the package first, then each public name.
PROG = """
import importlib, json, pkgutil
import kvreplay
for m in pkgutil.walk_packages(kvreplay.__path__, "kvreplay."):
    if m.name.endswith(("__main__", "sitecustomize")) or ".migrations" in m.name:
        continue
    try:
        importlib.import_module(m.name)
    except Exception:
        pass
out = {}
for name, (module, attr) in kvreplay._API.items():
    exec(f"from kvreplay import {name} as got")
    out[name] = [got is getattr(importlib.import_module(module), attr), type(got).__name__]
print(json.dumps(out))
"""


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_every_public_name_is_the_apis_object_whatever_was_imported_first():
    res = subprocess.run([sys.executable, "-c", PROG], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(got) == set(kvreplay.__all__) - {"__version__"}
    wrong = {name: kind for name, (same, kind) in got.items() if not same}
    assert wrong == {}, f"public names shadowed by a module or another object: {wrong}"
    assert got["replay"][1] == "function" and got["minimize"][1] == "function" and got["bisect"][1] == "function"


def test_a_submodule_of_a_public_name_still_imports():
    import kvreplay.replay.worker  # noqa: F401  (binds nothing over the public name)
    from kvreplay import replay
    from kvreplay.replay import dispatch

    assert replay is dispatch.replay
    assert sys.modules["kvreplay.replay.worker"].__name__ == "kvreplay.replay.worker"
