"""What a family's own checks hear from the shared invariant checker (checker.py), as
no-ops: a family's record names a subclass (``Family.checks``) that overrides the
moments it cares about, the way a bug variant overrides one hook of its pool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvreplay.check.pool_view import PoolView
from kvreplay.check.shadow import Shadow

Flag = Callable[..., None]  # the checker's: (call, method, invariant, rule, sub, indices, message, detected=)


class FamilyChecks:
    """Checks beyond the shared ones, fed by the same top-level call stream."""

    def __init__(self, view: PoolView, shadows: dict[str, Shadow], flag: Flag) -> None:
        self.view, self.shadows, self._flag = view, shadows, flag

    @property
    def pending(self) -> bool:
        """Is a finding waiting for the end of a free group (no checkpoint is taken then)?"""
        return False

    def reset(self) -> None:
        """The pool was cleared."""

    def adopt(self) -> None:
        """Start from the pool's state now (a trace that begins with a snapshot)."""

    def state(self) -> Any:
        """What these checks know beyond the pool's state, as JSON, for a checkpoint."""
        return None

    def restore(self, state: Any) -> None:
        """Take up a ``state()``."""

    def peers_before_free(self, method: str, pages: np.ndarray) -> Any:
        """Read before a free mutates the pool; handed back to ``after_free``."""
        return None

    def mapped(self, call: int, method: str, args: dict[str, Any]) -> None:
        """A mapping call (``MAPPING_METHODS``) returned."""

    def after_alloc(self, call: int, method: str, args: dict[str, Any], tokens: np.ndarray) -> None:
        """An allocation handed out ``tokens`` (the shared ownership checks already ran)."""

    def after_free(self, call: int, method: str, pages: np.ndarray, before: Any) -> None:
        """A free of ``pages`` returned; ``before`` is what ``peers_before_free`` read."""

    def settle(self, call: int) -> None:
        """The end of a call outside a free group, while ``pending``."""

    def full_check(self, call: int, method: str, free_by_sub: dict[str, np.ndarray], final: bool) -> None:
        """The O(pool) checks, every ``full_check_every`` calls and at the end (``final``)."""
