"""Divergences, beside the rules of check/rules.py: the ways a replay can differ from
its recording (or one build from another), and the record of one. The replayer finds
them (``Replayer._diverge``); reports, the store and ``--failure`` name them by these
kinds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreplay.check.rules import Finding

DIVERGENCE_KINDS: dict[str, str] = {
    "result": "the build returned another value than the recording",
    "counter": "the pool's counters after the call differ",
    "nested": "the build's sub-allocator calls differ (strict mode)",
    "exception": "the build raised where the recording returned, or the reverse",
    "unsupported": "the build lacks the method, or an argument was not recorded losslessly",
}


@dataclass
class Divergence(Finding):
    """The call did something else than the recording (or the other build)."""

    kind: str  # one of DIVERGENCE_KINDS
    expected: Any  # JSON values (compare.json_value)
    actual: Any
    message: str

    def __post_init__(self) -> None:
        if self.kind not in DIVERGENCE_KINDS:
            raise ValueError(f"unknown divergence kind {self.kind!r}")


__all__ = ["DIVERGENCE_KINDS", "Divergence"]
