"""The checker's vocabulary: every invariant and rule it can report, in one table,
and the Violation record a finding becomes.

An invariant is one of the seven properties of a correct pool; a rule is one way of
breaking it. ``severity`` says what a finding means for a server: ``corrupts`` (two
owners for one slot, or a slot lost: the crash to come), ``leaks`` (capacity lost,
no corruption) or ``misreports`` (counters or results wrong, state intact)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvreplay.families.registry import unit_of


@dataclass(frozen=True)
class Rule:
    invariant: str
    rule: str
    severity: str  # corrupts | leaks | misreports
    doc: str

    @property
    def id(self) -> str:
        return f"{self.invariant}/{self.rule}"


INVARIANTS: dict[str, str] = {
    "capacity": "1 capacity: 0 <= available_size() <= size per sub-pool",
    "free-list": "2 free list: no duplicate pages in free + staged, ids in 1..num_pages, page 0 never free",
    "ownership": "3 ownership: no index handed out while live, no free of a non-live index, live + available == size",
    "none-unchanged": "4 a call that returned None changed nothing",
    "swa-mapping": "5 SWA mapping: injective over live full slots, peers live, released pages unmapped, sentinel -1",
    "quiescence": "6 quiescence: at the end everything allocated is accounted for",
    "block-pool": "7 block pool (vLLM): reference counts equal the block tables that list a block, free exactly "
                  "when unreferenced, the free queue's links agree with its count, cached hashes match their blocks",
}

# invariant/rule | severity | what happened (docs/invariants.md explains each at length)
_TABLE = """
capacity/available-out-of-bounds | corrupts | available_size() is below 0 or above size
free-list/duplicate-free-page | corrupts | a page is on the free (or staged) list twice
free-list/padding-page-free | corrupts | page 0, the padding page, is free
free-list/page-out-of-range | corrupts | a free-list entry is not a page id
ownership/handout-while-live | corrupts | a slot was handed out while the caller holds it
ownership/handout-out-of-range | corrupts | a handed-out slot is outside the pool or on page 0
ownership/free-not-live | corrupts | a free named a page the caller does not hold
ownership/live-plus-available | misreports | slots the caller holds + available_size() != the pool's capacity
ownership/live-page-free | corrupts | a page the caller holds is on the free list
ownership/leaked-page | leaks | a page is neither held nor free
none-unchanged/none-changed-state | leaks | a call returned None but changed the counters
swa-mapping/released-page-keeps-peer | corrupts | a released full page (or one whose SWA peer was freed) still maps
swa-mapping/tail-prealloc-nontail-mapped | corrupts | after alloc_extend_swa_tail, a non-tail slot maps to an SWA slot
swa-mapping/shared-swa-slot | corrupts | two live full slots map to one SWA slot
swa-mapping/peer-not-live | corrupts | a live full slot maps to an SWA slot that is free
swa-mapping/allocated-without-peer | corrupts | an allocated full slot has no SWA peer
swa-mapping/orphan-swa-slot | leaks | a live SWA slot is mapped from no live full slot
swa-mapping/sentinel-changed | corrupts | the mapping's trailing -1 was overwritten
quiescence/leaked-page | leaks | at the end, a page is neither held nor free
quiescence/orphan-swa-slot | leaks | at the end, a live SWA slot is mapped from nothing
quiescence/held-block | leaks | at the end, with no request left, a block is still referenced
block-pool/negative-ref-count | corrupts | a block's reference count went below zero (freed once too often)
block-pool/ref-count-not-owners | corrupts | a block's reference count is not the number of block tables listing it
block-pool/free-queue-mismatch | corrupts | a block with no references is not in the free queue, or a referenced one is
block-pool/handout-while-held | corrupts | get_new_blocks handed out a block a request still holds
block-pool/free-queue-links | corrupts | the free queue's links hold a block twice, disagree, or disagree with its count
block-pool/null-block-free | corrupts | the null block (block 0, a placeholder) is in the free queue
block-pool/null-block-ref-count | misreports | the null block's reference count went below zero (a free counted it)
block-pool/stale-cached-hash | corrupts | a cached hash maps to a block that carries another hash
"""


def _rules(table: str) -> dict[str, Rule]:
    rules = {}
    for line in table.strip().splitlines():
        rule_id, severity, doc = (part.strip() for part in line.split("|"))
        invariant, _, rule = rule_id.partition("/")
        rules[rule_id] = Rule(invariant, rule, severity, doc)
    return rules


RULES = _rules(_TABLE)
SEVERITIES = ("corrupts", "leaks", "misreports")
assert {r.severity for r in RULES.values()} <= set(SEVERITIES)
assert {r.invariant for r in RULES.values()} == set(INVARIANTS)



@dataclass
class Finding:
    """Something a replay found at top-level call number ``call`` (1..N in the trace)."""

    call: int
    method: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Violation(Finding):
    """One broken rule, named at the call that created the bad state;
    ``detected_call`` is where it became visible."""

    invariant: str
    rule: str
    sub_pool: str
    indices: list[int]
    message: str
    detected_call: int


@dataclass
class ViolationLog:
    """Every violation counted; the first ``keep`` of each (invariant, rule) kept whole."""

    keep: int = 20
    kept: list[Violation] = field(default_factory=list)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    # Told of every violation, kept or not (a replay's timeline places them all).
    listener: Callable[[Violation], None] | None = None

    def add(self, v: Violation) -> None:
        key = (v.invariant, v.rule)
        n = self.counts[key] = self.counts.get(key, 0) + 1
        if n <= self.keep:
            self.kept.append(v)
        if self.listener is not None:
            self.listener(v)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def first(self) -> Violation | None:
        return min(self.kept, key=lambda v: (v.call, v.detected_call)) if self.kept else None


def describe_violation(v: Any, *, long: bool = False) -> str:
    """One line for a violation (a Violation or its stored dict):
    ``swa-mapping/peer-not-live at call #12 free`` and, with ``long``, where it was
    seen, the sub-pool, the slots and the message."""
    def get(name: str) -> Any:
        return v[name] if isinstance(v, dict) else getattr(v, name)

    call = get("call")
    head = f"{get('invariant')}/{get('rule')} at call #{call} {get('method')}"
    if not long:
        return head
    detected = get("detected_call")
    seen = f" (seen at call #{detected})" if detected != call else ""
    idx = get("indices")
    sub_pool = get("sub_pool")
    return f"{head}{seen} [{sub_pool}]" + (f" {unit_of(sub_pool)} {idx}" if idx else "") + f": {get('message')}"
