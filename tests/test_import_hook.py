"""The recorder's import hook (recorder/import_hook.py), shared by the CPU compatibility
patches and auto-recording: what waits for a module runs once, right after the module
executes, whoever imports it; each user keeps its own failure policy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvreplay.recorder import import_hook
from kvreplay.recorder.import_hook import Finder, after_import


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A fresh hook (nothing waiting, no finder of its own yet) and a place for toy modules."""
    monkeypatch.setattr(import_hook, "_waiting", {})
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, Finder)])
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def module(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    yield module
    for name in names:
        sys.modules.pop(name, None)


def _finders() -> int:
    return sum(isinstance(f, Finder) for f in sys.meta_path)


def test_callbacks_run_once_in_order_right_after_the_module_executes(toy):
    toy("kv_hook_a", "VALUE = 1\n")
    seen: list[tuple[str, int]] = []
    first = lambda m: seen.append(("first", m.VALUE))  # noqa: E731
    second = lambda m: seen.append(("second", m.VALUE))  # noqa: E731
    after_import("kv_hook_a", first)
    after_import("kv_hook_a", second)
    after_import("kv_hook_a", first)  # registered twice: still run once
    assert _finders() == 1 and seen == []
    import kv_hook_a

    assert seen == [("first", 1), ("second", 1)]
    del sys.modules["kv_hook_a"]
    import kv_hook_a  # noqa: F401,F811  (imported again: nothing waits any more)

    assert len(seen) == 2 and _finders() == 1


def test_a_module_already_imported_gets_the_callback_now_and_no_finder(toy):
    toy("kv_hook_b", "VALUE = 2\n")
    import kv_hook_b

    seen = []
    after_import("kv_hook_b", lambda m: seen.append(m))
    assert seen == [kv_hook_b] and _finders() == 0 and import_hook._waiting == {}


def test_the_finder_comes_back_if_taken_off(toy):
    toy("kv_hook_c", "")
    after_import("kv_hook_c", lambda m: None)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, Finder)]
    seen = []
    after_import("kv_hook_c", lambda m: seen.append(m.__name__))
    assert _finders() == 1 and isinstance(sys.meta_path[0], Finder)
    import kv_hook_c  # noqa: F401

    assert seen == ["kv_hook_c"]


def test_what_a_callback_raises_reaches_the_importer_and_a_failed_import_keeps_its_callbacks(toy):
    toy("kv_hook_d", "raise RuntimeError('the module itself')\n")
    seen = []
    after_import("kv_hook_d", lambda m: seen.append(m.__name__))
    with pytest.raises(RuntimeError, match="the module itself"):
        import kv_hook_d  # noqa: F401
    assert seen == [] and "kv_hook_d" in import_hook._waiting
    toy("kv_hook_d", "")
    sys.path_importer_cache.clear()
    import kv_hook_d  # noqa: F401,F811

    assert seen == ["kv_hook_d"]

    def broken(m):
        raise ValueError("a broken callback")

    toy("kv_hook_e", "")
    after_import("kv_hook_e", broken)
    with pytest.raises(ValueError, match="a broken callback"):
        import kv_hook_e  # noqa: F401


def test_autorecord_turns_itself_off_when_a_class_cannot_be_wrapped_and_the_import_goes_on(toy, monkeypatch,
                                                                                         tmp_path, caplog):
    from kvreplay.recorder import autorecord

    toy("kv_hook_pool", "class Meta(type):\n"
                        "    def __setattr__(cls, name, value):\n"
                        "        raise RuntimeError('frozen class')\n"
                        "class Pool(metaclass=Meta):\n"
                        "    def __init__(self):\n"
                        "        self.ok = True\n")
    monkeypatch.setattr(autorecord, "_targets", {})
    monkeypatch.setattr(autorecord, "_failed", False)
    monkeypatch.setattr(autorecord, "_out", None)
    autorecord.install(tmp_path / "out", ["kv_hook_pool:Pool"])
    import kv_hook_pool

    assert kv_hook_pool.Pool().ok and autorecord._failed
    assert "recording disabled" in caplog.text


def test_the_hook_is_cheap_to_import():
    """It runs in every process of a recorded server before the engine loads."""
    prog = ("import sys; import kvreplay.recorder.import_hook; "
            "print(sorted(m for m in ('torch', 'numpy', 'pyarrow') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
