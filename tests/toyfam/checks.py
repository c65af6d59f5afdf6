"""The toy family's one rule, beside the shared checks."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvreplay.check.family_checks import FamilyChecks


class LowestFirst(FamilyChecks):
    def after_alloc(self, call: int, method: str, args: dict[str, Any], tokens: np.ndarray) -> None:
        if not len(tokens):
            return
        owned = self.shadows["pool"].owned
        lower = np.arange(1, int(tokens.max()))
        skipped = lower[~owned[lower]]
        if len(skipped):
            self._flag(call, method, "toy-order", "not-lowest-first", "pool", skipped,
                       f"{method} handed out slot {int(tokens.max())} while slot {int(skipped[0])} was free")
