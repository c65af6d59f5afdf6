"""What replaying a corpus trace on a build must show, and checking a report against it.

The corpus manifest (``traces/manifest.json``) lists, per trace and per build,
either ``"status": "clean"`` or the violations that must appear, each named by
invariant and rule and optionally pinned to the method and call (``seq``) of the
first violation of that rule: the call that creates the bad state."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.errors import BadInput

MANIFEST = "manifest.json"


@dataclass
class ExpectedViolation:
    invariant: str
    rule: str | None = None
    method: str | None = None
    seq: int | None = None

    def describe(self) -> str:
        s = self.invariant + (f"/{self.rule}" if self.rule else "")
        if self.method or self.seq is not None:
            s += " at " + " ".join(x for x in (f"#{self.seq}" if self.seq is not None else "", self.method or "") if x)
        return s


@dataclass
class Expectation:
    build: str
    status: str  # clean | violation
    modes: list[str] = field(default_factory=lambda: ["strict"])
    violations: list[ExpectedViolation] = field(default_factory=list)
    capacity_assert_seq: int | None = None


@dataclass
class CorpusEntry:
    name: str
    file: Path
    command: str
    sha256: str
    summary: str
    expect: list[Expectation]


def _expectation(d: dict[str, Any], where: str) -> Expectation:
    try:
        status = d["status"]
        if status not in ("clean", "violation"):
            raise ValueError(f"status must be clean or violation, not {status!r}")
        vs = [ExpectedViolation(**v) for v in d.get("violations", [])]
        if status == "violation" and not vs:
            raise ValueError("a violation expectation must name at least one violation")
        return Expectation(build=d["build"], status=status, modes=list(d.get("modes", ["strict"])), violations=vs,
                           capacity_assert_seq=d.get("capacity_assert_seq"))
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInput(f"{where}: bad expectation ({exc})") from None


def load_manifest(corpus: str | Path) -> list[CorpusEntry]:
    root = Path(corpus)
    path = root / MANIFEST if root.is_dir() else root
    if not path.is_file():
        raise BadInput(f"{path}: no corpus manifest")
    try:
        doc = json.loads(path.read_text())
        entries = []
        for t in doc["traces"]:
            where = f"{path}: trace {t.get('name', '?')}"
            entries.append(CorpusEntry(name=t["name"], file=path.parent / t["file"], command=t.get("command", ""),
                                       sha256=t.get("sha256", ""), summary=t.get("summary", ""),
                                       expect=[_expectation(e, where) for e in t["expect"]]))
        return entries
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise BadInput(f"{path}: bad manifest ({type(exc).__name__}: {exc})") from None


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_report(report: Any, exp: Expectation) -> list[str]:
    """Problems with ``report`` against ``exp``; empty when the expectation holds.

    A violation expectation with a ``seq`` holds only if the *first* violation of
    that invariant/rule is at that call: flagging it later is a miss."""
    problems: list[str] = []
    if exp.status == "clean":
        if report.status != "clean":
            first = report.first_violation or report.first_divergence
            problems.append(f"expected clean, got {report.status} (first: {_first(first)})")
        return problems
    if report.first_violation is None:
        problems.append("expected violations, got none: the checker missed the bug")
        return problems
    firsts: dict[tuple[str, str], Any] = {}
    for v in report.violations:
        key = (v.invariant, v.rule)
        if key not in firsts or (v.seq, v.detected_seq) < (firsts[key].seq, firsts[key].detected_seq):
            firsts[key] = v
    for ev in exp.violations:
        hits = [v for (inv, rule), v in firsts.items() if inv == ev.invariant and (ev.rule in (None, rule))]
        if not hits:
            problems.append(f"expected {ev.describe()}, not reported")
            continue
        v = min(hits, key=lambda x: x.seq)
        if ev.seq is not None and v.seq != ev.seq:
            problems.append(f"expected {ev.describe()}, first reported at #{v.seq} {v.method}")
        elif ev.method is not None and v.method != ev.method:
            problems.append(f"expected {ev.describe()}, first reported at #{v.seq} {v.method}")
    if exp.capacity_assert_seq is not None and report.capacity_assert_seq != exp.capacity_assert_seq:
        problems.append(f"expected the capacity assertion at #{exp.capacity_assert_seq}, "
                        f"got {report.capacity_assert_seq}")
    return problems


def _first(x: Any) -> str:
    if x is None:
        return "-"
    kind = getattr(x, "invariant", None) or getattr(x, "kind", "")
    return f"#{x.seq} {x.method} {kind}"
