"""Import paths that moved, and the forwarding that keeps them working.

Import paths users write are API: when a module moves, its old name keeps importing
the module at its new place, with a FutureWarning that names the new path (shown by
default: a user's script should learn of the move before the old name goes). The
CHANGELOG says, per version, what moved. One table holds every move, so the package's
folders show only where code lives now."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old dotted name -> new one; a package's submodules follow it (old.x -> new.x)
MOVED: dict[str, str] = {
    "kvreplay.bisect": "kvreplay.jobs.bisect",
    "kvreplay.matrix": "kvreplay.jobs.matrix",
    "kvreplay.minimize": "kvreplay.jobs.minimize",
    "kvreplay.reproducer": "kvreplay.jobs.reproducer",
    "kvreplay.demo": "kvreplay.jobs.demo",
    "kvreplay.dashboard": "kvreplay.jobs.dashboard",
    "kvreplay.watch": "kvreplay.jobs.watch",
    "kvreplay.stored_replay": "kvreplay.jobs.stored_replay",
    "kvreplay.family": "kvreplay.contract",  # the family machinery, apart from the families
    # sglang's own code, out of the shared modules into its family's folder
    "kvreplay.replay.replayer": "kvreplay.families.sglang.replayer",
    "kvreplay.replay.remap": "kvreplay.families.sglang.remap",
    "kvreplay.check.checker": "kvreplay.families.sglang.checker",
    "kvreplay.check.checked_call": "kvreplay.families.sglang.checked_call",
    "kvreplay.checked_pool": "kvreplay.families.sglang.checked",
    "kvreplay.pool_api": "kvreplay.families.sglang.vocabulary",
}


def new_name(old: str) -> str | None:
    """Where ``old`` lives now (None: it did not move)."""
    for before, after in MOVED.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    return None


class _Forward(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("kvreplay.") or new_name(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        new = new_name(old)
        assert new is not None
        if new_name(old.rpartition(".")[0]) is None:  # a moved package's submodule: its package warned
            # stacklevel 2 skips the import machinery's own frames: the warning names the importer
            warnings.warn(f"{old} moved to {new}; import it from there (the old path will go)",
                          FutureWarning, stacklevel=2)
        # The import system hands back whatever sys.modules holds under the name once this
        # returns: the module at its new place, the same object, not a copy.
        sys.modules[old] = importlib.import_module(new)


_FORWARD = _Forward()


def install() -> None:
    """Put the forwarding first on the import path (once per process)."""
    if _FORWARD not in sys.meta_path:
        sys.meta_path.insert(0, _FORWARD)
