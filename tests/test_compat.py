"""The CPU compatibility layer (recorder/compat.py, ``kvreplay record --cpu-compat``): its
patches are opt-in, named, applied when their module is imported, and never aimed at an
allocator. The live tier records a speculative-decoding server through it and holds the
trace to the unpatched release (tests/test_live_server.py)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import run_in_process as run

from kvreplay.contract.registry import engines
from kvreplay.recorder import compat
from kvreplay.recorder.compat import COMPAT_ENV, Patch


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A module of an 'engine' on sys.path and a patch aimed at it."""
    (tmp_path / "kv_toy_engine.py").write_text("FLAG = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []
    patch = Patch("toy-flag", "kv_toy_engine", why="a test", apply=lambda m: (setattr(m, "FLAG", True),
                                                                               seen.append(m.__name__)))
    monkeypatch.setattr(compat, "patches", lambda: [patch])
    yield seen
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, compat._Finder)]
    compat._pending.clear()
    sys.modules.pop("kv_toy_engine", None)


def test_a_patch_is_applied_once_when_its_module_is_imported(toy, monkeypatch, capfd):
    monkeypatch.setenv(COMPAT_ENV, "toy-flag")
    compat.install_from_env()
    import kv_toy_engine

    assert kv_toy_engine.FLAG is True and toy == ["kv_toy_engine"]
    assert "cpu-compat patch toy-flag applied to kv_toy_engine" in capfd.readouterr().err


def test_without_the_switch_nothing_is_patched(toy, monkeypatch):
    monkeypatch.delenv(COMPAT_ENV, raising=False)
    compat.install_from_env()
    import kv_toy_engine

    assert kv_toy_engine.FLAG is False and toy == []
    monkeypatch.setenv(COMPAT_ENV, "another-patch")  # names only what it names
    compat.install_from_env()
    assert toy == [] and not compat._pending


def test_the_engines_patches_are_named_explained_and_aim_at_no_allocator():
    found = compat.patches()
    assert found, "sglang's record names its patches"
    assert len({p.name for p in found}) == len(found)
    allocator_homes = ("sglang.srt.mem_cache", "vllm.v1.core")  # where the engines' pools live
    for p in found:
        assert p.why and len(p.why) > 40 and not p.module.startswith(allocator_homes), p
    assert [e.name for e in engines() if e.cpu_compat] == ["sglang", "vllm"]


def test_sglangs_meta_parameters_patch_puts_them_where_the_model_is():
    """0.5.12's transformers backend put meta-device parameters on 'cuda' by name."""
    import types

    import torch
    from torch import nn

    from kvreplay.families.sglang.cpu_compat import PATCHES

    (patch,) = [p for p in PATCHES if p.name == "transformers-meta-params"]

    class TransformersBase(nn.Module):
        def _init_parameters(self, module):
            raise AssertionError("the release's own: materializes on cuda")

    module = types.ModuleType("sglang.srt.models.transformers")
    module.TransformersBase = TransformersBase
    patch.apply(module)
    model = TransformersBase()
    model.dense = nn.Linear(2, 2)  # loaded: on the CPU
    with torch.device("meta"):
        model.experts = nn.Linear(4, 4)  # left on the meta device
    model._init_parameters(model)
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_print_env_names_the_switch_and_what_the_patches_need(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = run(capsys, "record", "--out", str(tmp_path / "o"), "--print-env", "--cpu-compat", "--json")
    env = json.loads(r.stdout)
    assert env[COMPAT_ENV] == ",".join(p.name for p in compat.patches()) and env["TRITON_INTERPRET"] == "1"
    plain = json.loads(run(capsys, "record", "--out", str(tmp_path / "o"), "--print-env", "--json").stdout)
    assert COMPAT_ENV not in plain and "TRITON_INTERPRET" not in plain


def test_vllms_patch_keeps_the_scheduling_the_engine_chose_and_the_rest_of_the_platforms_word():
    """vLLM's CPU platform turns asynchronous scheduling off after the engine resolved it:
    the patch puts back what was resolved, whichever it was, and keeps the rest of what
    the platform set."""
    import types

    from kvreplay.families.vllm.cpu_compat import PATCHES

    (patch,) = PATCHES
    assert patch.module == "vllm.platforms.cpu"

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, config):
            config.scheduler_config.async_scheduling = False
            config.cache_config.block_size = 128

    module = types.ModuleType("vllm.platforms.cpu")
    module.CpuPlatform = CpuPlatform
    patch.apply(module)
    for wanted in (True, False):
        config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(async_scheduling=wanted),
                                       cache_config=types.SimpleNamespace(block_size=16))
        CpuPlatform.check_and_update_config(config)
        assert config.scheduler_config.async_scheduling is wanted and config.cache_config.block_size == 128
