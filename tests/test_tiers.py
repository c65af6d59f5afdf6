"""The fast tier (the README's ``python -m pytest``) takes no engine's test and no test
with a marker nothing declares: tiny test files collected under the repository's own
pyproject.toml options and tests/conftest.py's hooks, as the README's command collects."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import tier_markers

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

# Written out, not read from tier_markers.py: moving one there to ANYWHERE must fail here.
ENGINE_MARKERS = ("sglang", "vllm", "mamba", "live", "soak")

# Borrows conftest.py's hooks (its fixtures are not needed) for a directory outside tests/.
CONFTEST = f"""\
import importlib.util, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
spec = importlib.util.spec_from_file_location("kvreplay_tests_conftest", {str(ROOT / "tests" / "conftest.py")!r})
ours = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ours)
pytest_configure = ours.pytest_configure
pytest_collection_modifyitems = ours.pytest_collection_modifyitems
pytest_make_collect_report = ours.pytest_make_collect_report
"""


def _collect(pytester: pytest.Pytester, name: str, test_file: str) -> pytest.RunResult:
    where = pytester.mkdir(name)
    (where / "conftest.py").write_text(CONFTEST)
    (where / "test_t.py").write_text(test_file)
    # In this process (torch is imported already), under the repository's addopts
    # (-m fast among them), one process instead of xdist's two; hypothesis's plugin would
    # import (and assertion-rewrite) all of hypothesis afresh each run, for nothing here.
    return pytester.runpytest_inprocess("--collect-only", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                                        "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(where), "-n", "0",
                                        str(where / "test_t.py"))


def _test_per_marker(markers: list[str]) -> str:
    return "import pytest\n\n\ndef test_plain():\n    pass\n" + "".join(
        f"\n\n@pytest.mark.{m}\ndef test_{m}():\n    pass\n" for m in markers)


def test_the_fast_tier_takes_no_engines_test_and_no_undeclared_marker(pytester):
    ours = [tier_markers.name_of(m) for m in tier_markers.MARKERS]
    assert set(ENGINE_MARKERS) <= set(ours)
    got = _collect(pytester, "declared", _test_per_marker(ours))
    out = "\n".join(got.outlines + got.errlines)
    assert got.ret == 0, out[-3000:]
    fast = {line.split("::", 1)[1] for line in got.outlines if line.startswith("test_t.py::")}
    assert "test_plain" in fast, out[-3000:]
    for marker in (*ENGINE_MARKERS, "slow", "browser"):
        assert f"test_{marker}" not in fast, f"a test marked only {marker} is in the fast tier"
    # these skip without what they need, so today's fast tier keeps them
    assert {"test_gpu", "test_ray", "test_slow_cases"} <= fast, out[-3000:]

    # a misspelt engine marker, or `fast` written by hand, stops the collection
    got = _collect(pytester, "undeclared", _test_per_marker(["sglnag", "fast"]))
    out = "\n".join(got.outlines + got.errlines)
    assert got.ret != 0, out[-3000:]
    assert "test_t.py::test_sglnag: undeclared marker 'sglnag'" in out, out[-3000:]
    assert "test_t.py::test_fast: 'fast' is given by tests/conftest.py" in out, out[-3000:]


def test_the_tiers_are_declared_once():
    """scripts/tiers.py lists the tiers conftest.py sorts by, and pyproject.toml keeps no
    marker list of its own to drift from them."""
    spec = importlib.util.spec_from_file_location("tiers_script", ROOT / "scripts" / "tiers.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.TIERS is tier_markers.TIERS
    text = (ROOT / "pyproject.toml").read_text()
    assert "markers = [" not in text
    assert "-m fast" in text


@pytest.mark.parametrize("marker", ENGINE_MARKERS)
def test_scripts_tiers_puts_an_engines_test_in_neither_the_fast_nor_the_slow_tier(marker):
    takes = {tier for tier, rule in tier_markers.TIERS.items() if rule({marker})}
    assert takes and not takes & {"fast", "slow"}, takes
    assert not tier_markers.TIERS["slow"]({marker, "slow"})
