"""The import contract (tests/layers.py) holds, and its checker catches breaches."""

from __future__ import annotations

import shutil

import layers


def test_the_package_keeps_its_import_contract():
    assert layers.breaches(layers.graph()) == []


def test_every_package_top_module_and_family_folder_is_in_a_layer():
    named = {e for layer in layers.LAYERS for e in layer}
    found = {p.stem if p.is_file() else p.name for p in layers.ROOT.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    # the families' folders and the jobs' modules are entries of their own
    found |= {f"families.{p.name}" for p in (layers.ROOT / "families").iterdir() if (p / "__init__.py").exists()}
    found |= {f"jobs.{p.stem}" for p in (layers.ROOT / "jobs").glob("*.py") if p.stem != "__init__"}
    assert found == named


def _copy(tmp_path):
    root = tmp_path / "kvreplay"
    shutil.copytree(layers.ROOT, root, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return root


def test_the_checker_fails_on_a_cycle_and_on_an_upward_import(tmp_path):
    root = _copy(tmp_path)
    # the trace format starts using the replayer, which reads traces: a cycle, and upward
    fmt = root / "trace" / "format.py"
    fmt.write_text(fmt.read_text() + "\n\ndef _late():\n    from kvreplay.families.sglang.replayer import Replayer\n")
    found = layers.breaches(layers.graph(root))
    upward = "kvreplay.trace.format imports kvreplay.families.sglang.replayer: upward"
    assert any(b.startswith(upward) for b in found), found
    assert any(b.startswith("import cycle:") and "kvreplay.trace.format" in b for b in found), found


def test_the_checker_fails_on_a_sibling_import(tmp_path):
    root = _copy(tmp_path)
    rec = root / "recorder" / "live.py"
    rec.write_text(rec.read_text() + "\nfrom kvreplay.replay import diff  # noqa\n")
    found = layers.breaches(layers.graph(root))
    assert any("sideways" in b and b.startswith("kvreplay.recorder.live") for b in found), found
