"""What a worker build runs: the code on its ``sys.path`` and the environment around it.

``git:``, ``sglang==VERSION`` and ``vllm==VERSION`` builds replay in a worker process
(replay/worker.py).
Both get their pool code first on ``sys.path`` (a revision's tree, a release's
package) and, where the code is sglang, an overlay of the pins it imports with
(builds/overlay.py): a release's own ``Requires-Dist``, a checkout's own
``pyproject.toml``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from kvreplay.builds.git_tree import path_for, tree_at
from kvreplay.builds.overlay import exact_pins, overlay_for
from kvreplay.builds.releases import check_release, fetch, requirements_of_tree
from kvreplay.builds.spec import BuildSpec
from kvreplay.contract.registry import engine
from kvreplay.errors import BuildUnloadable

# Top-level modules the worker must treat as not installed (comma-separated): the
# overlay's, and any the environment already names.
HIDE_ENV = "KVREPLAY_HIDE_MODULES"


@dataclass
class WorkerCode:
    paths: list[str]  # first on sys.path, in order
    cwd: Path | None  # the tree's root for git: builds
    code_id: str  # the commit, or the release version
    overlay: tuple[str, ...] = field(default_factory=tuple)  # name==version pins in front of the environment
    hidden: tuple[str, ...] = field(default_factory=tuple)  # installed modules the overlay breaks

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = os.pathsep.join([*self.paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1")  # the pools' tensors are small: one thread, no spinning
        # the caller's own list too: a test (or a user) can make an installed module absent
        asked = [n for n in env.get(HIDE_ENV, "").split(",") if n]
        env[HIDE_ENV] = ",".join(dict.fromkeys([*self.hidden, *asked]))
        return env


def prepare(spec: BuildSpec) -> WorkerCode:
    """Fetch (once) what a worker needs to replay on ``spec``."""
    if spec.kind == "release":
        eng = engine(spec.engine)
        if eng is not None and eng.installed_only and not _installed(*eng.dists):
            check_release(spec.engine, spec.version)  # a version that does not exist is the spec's fault
            raise BuildUnloadable(f"{spec}: {eng.installed_only}")
        rel = fetch(spec.version, spec.engine)
        return WorkerCode(rel.paths, None, rel.version, rel.overlay.packages, _shadowed(rel.overlay.hidden, rel.paths))
    if spec.kind == "git":
        assert spec.repo is not None
        commit, tree = tree_at(spec.repo, spec.rev)
        overlay = overlay_for(exact_pins(requirements_of_tree(tree)))
        paths = ([str(overlay.path)] if overlay.path else []) + path_for(tree)
        return WorkerCode(paths, tree, commit, overlay.packages, _shadowed(overlay.hidden, paths))
    return WorkerCode([], None, "")  # builtin:, py:, sglang: this environment as it is


def _installed(*names: str) -> bool:
    for name in names:
        try:
            metadata.distribution(name)
            return True
        except metadata.PackageNotFoundError:
            continue
    return False


def _shadowed(hidden: tuple[str, ...], paths: list[str]) -> tuple[str, ...]:
    """The hidden modules, less those the build's own code provides (the installed
    sglang needs the newer pins, but the release's sglang is the one imported)."""
    return tuple(h for h in hidden if not any((Path(p) / h).exists() or (Path(p) / f"{h}.py").exists()
                                               for p in paths))
