"""State that grows without bound: the rule class every family shares.

Beside its tensors a pool keeps Python containers: per-request maps, lists of blocks
handed out this step, pending frees, hash maps. A correct pool bounds each by what it
holds: its capacity (slots, blocks, rows) and the requests that capacity can serve. A
container that keeps growing while the pool does not is memory a long-running server
loses, an entry per request or per step, until it is restarted, and no ownership rule
sees it: every slot is still accounted for.

``GrowthWatch`` samples the sizes of the containers reachable from a build (its
attributes and theirs, a few levels down, within the engine's and kvreplay's own
objects) at each full check and flags a container the first time it passes
``FACTOR * capacity + SLACK`` entries, a bound no correct pool reaches."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

FACTOR = 4
SLACK = 1024
MAX_DEPTH = 3  # the manager, its coordinator, each group's manager: vLLM's deepest
MAX_CONTAINERS = 512  # a sample's cost stays a few hundred len() calls
_SIZED = (dict, list, set, frozenset, deque, tuple)
_OWNERS = ("kvreplay", "vllm", "sglang")  # objects whose attributes are pool state
RULE = "growth/unbounded-container"


def _is_state(obj: Any) -> bool:
    # an engine's or kvreplay's object, or a subclass of one (a bug variant, a user's build)
    return isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, type) and any(
        (getattr(c, "__module__", "") or "").partition(".")[0] in _OWNERS for c in type(obj).__mro__)


class GrowthWatch:
    """The containers of ``root`` held to ``FACTOR * capacity + SLACK`` entries. A root's
    class may name attributes that hold what the pool does not bound in ``growth_exempt``
    (a replay's stand-ins for the requests a scheduler has queued)."""

    def __init__(self, root: Any, capacity: int) -> None:
        self.root = root
        self.limit = FACTOR * max(0, int(capacity)) + SLACK
        self.flagged: set[str] = set()

    def sample(self) -> list[tuple[str, int]]:
        """(path, size) of each container past the limit, each path once per replay."""
        out = []
        for path, size in self.sizes():
            if size > self.limit and path not in self.flagged:
                self.flagged.add(path)
                out.append((path, size))
        return out

    def sizes(self) -> Iterator[tuple[str, int]]:
        """(attribute path, len) of every container reachable from the root."""
        seen: set[int] = set()
        stack: list[tuple[Any, str, int]] = [(self.root, type(self.root).__name__, 0)]
        count = 0
        while stack:
            obj, path, depth = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            exempt = set(getattr(type(obj), "growth_exempt", ()))
            for name, value in list(vars(obj).items()):
                if name in exempt:
                    continue
                where = f"{path}.{name}"
                if isinstance(value, _SIZED):
                    count += 1
                    if count > MAX_CONTAINERS:
                        return
                    yield where, len(value)
                    # a short list of objects: vLLM's managers, one per KV-cache group
                    if isinstance(value, (list, tuple)) and len(value) <= 16 and depth < MAX_DEPTH:
                        stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value) if _is_state(v))
                elif depth < MAX_DEPTH and _is_state(value):
                    stack.append((value, where, depth + 1))

    def message(self, path: str, size: int) -> str:
        return (f"{path} holds {size:,} entries, past {self.limit:,} ({FACTOR} x the pool's capacity + {SLACK}): "
                "it grows with the requests or steps served, not with what the pool holds")
