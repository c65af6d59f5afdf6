"""A vLLM-family build driven by hand under its checker, for pool tests (as
``kvreplay.families.sglang.checked.CheckedPool`` is for sglang's allocator API)."""

from __future__ import annotations

from typing import Any

from kvreplay.builds.resolve import load_build
from kvreplay.check.driver import Checked
from kvreplay.families.vllm.checker import BlockPoolChecker

FAMILY = "vllm"


class CheckedManager(Checked):
    """The same for a vLLM-family build (a KV-cache manager on the family's wire):

        m = CheckedManager("builtin:vllm", ctor={...})
        m.allocate_slots(request_id="a", ..., num_new_tokens=64)
        m.free_request(request_id="a")   # AssertionError here if the free breaks a rule
        m.finish()

    The whole pool is checked after every call."""

    def __init__(self, build: str, *, ctor: dict[str, Any], invariant: str | None = None) -> None:
        super().__init__(build, load_build(build, FAMILY, ctor, "cpu"), invariant)
        self.checker = BlockPoolChecker(self.pool, full_check_every=1, keep=1 << 30)

    def call(self, method: str, **args: Any) -> Any:
        """One manager call (wire arguments, as a trace records them), checked."""
        self.calls += 1
        fn = getattr(self.pool, method, None)
        if fn is None:
            raise AttributeError(f"{self.build} has no method {method}")
        log: list[tuple[str, Any]] = []
        self.pool.wire_blocks.log = log
        try:
            result = fn(**args)
        finally:
            self.pool.wire_blocks.log = None
        self.checker.after(self.calls, method, args, result, log)
        self._assert_clean()
        return result
