"""What replaying a corpus trace on a build must show: a replay turned into an
expectation (``corpus add``), and a replay checked against one (``ci``)."""

from __future__ import annotations

from typing import Any

from kvreplay.corpus.manifest import Expectation
from kvreplay.errors import BadInput
from kvreplay.replay.report import ReplayReport, describe, firsts_by_rule


def expectation_of(report: ReplayReport) -> dict[str, Any]:
    """What a replay showed, as a manifest expectation: clean, the first violation of
    each rule with its call (and the first divergence, if it also answered otherwise), or
    the first divergence of a build that broke no rule."""
    if report.status == "clean":
        return {"build": report.build, "status": "clean"}
    if report.status == "divergence" and report.first_divergence is not None:
        d = report.first_divergence
        return {"build": report.build, "status": "divergence",
                "divergence": {"kind": d.kind, "method": d.method, "call": d.call}}
    if report.status != "violation":
        why = report.message.splitlines()[0][:200] if report.message else "nothing replayed"
        raise BadInput(f"{report.build} {report.status} on this trace ({why}): only clean, violation or divergence "
                       "can be an expectation")
    out = {"build": report.build, "status": "violation",
           "violations": [{"invariant": v.invariant, "rule": v.rule, "method": v.method, "call": v.call}
                          for v in firsts_by_rule(report.violations).values()]}
    if report.first_divergence is not None:  # it also answered otherwise somewhere
        d = report.first_divergence
        out["divergence"] = {"kind": d.kind, "method": d.method, "call": d.call}
    return out


def check_report(report: ReplayReport, exp: Expectation) -> list[str]:
    """Problems with ``report`` against ``exp``; empty when the expectation holds.

    A violation expectation with a ``call`` holds only if the *first* violation of
    that invariant/rule is at that call: flagging it later is a miss."""
    problems: list[str] = []
    if exp.status == "clean":
        if report.status != "clean":
            first = report.first_violation or report.first_divergence
            problems.append(f"expected clean, got {report.status} (first: {describe(first)})")
        return problems
    if exp.divergence is not None:
        ed, d = exp.divergence, report.first_divergence
        if report.status != exp.status or d is None:
            first = report.first_violation or d
            problems.append(f"expected {exp.status} with divergence: {ed.describe()}, got {report.status}"
                            + (f" (first: {describe(first)})" if first is not None else ""))
        elif d.kind != ed.kind or (ed.call is not None and d.call != ed.call) or \
                (ed.method is not None and d.method != ed.method):
            problems.append(f"expected divergence: {ed.describe()}, first was {describe(d)}")
        if exp.status == "divergence" or problems:
            return problems
    if report.first_violation is None:
        problems.append("expected violations, got none: the checker missed the bug")
        return problems
    firsts = firsts_by_rule(report.violations)
    for ev in exp.violations:
        hits = [v for v in firsts.values() if v.invariant == ev.invariant and ev.rule in (None, v.rule)]
        if not hits:
            problems.append(f"expected {ev.describe()}, not reported")
            continue
        v = min(hits, key=lambda x: x.call)
        if (ev.call is not None and v.call != ev.call) or (ev.method is not None and v.method != ev.method):
            problems.append(f"expected {ev.describe()}, first reported at call #{v.call} {v.method}")
    if exp.capacity_assert_call is not None and report.capacity_assert_call != exp.capacity_assert_call:
        problems.append(f"expected the capacity assertion at call #{exp.capacity_assert_call}, "
                        f"got {report.capacity_assert_call}")
    return problems

