"""Writing a replay's results and reading them back.

A run, its trace and build rows, its violations and divergences are written in
one transaction: a reader sees all of a run or none of it."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, selectinload

from kvreplay.builds.spec import BuildSpec
from kvreplay.errors import BadInput
from kvreplay.store.db import Store
from kvreplay.store.models import Build, DivergenceRow, Run, Trace, ViolationRow
from kvreplay.version import __version__


@dataclass
class TraceInfo:
    path: str
    content_hash: str
    pool_class: str
    family: str
    meta: dict[str, Any]
    rows: int
    calls: int | None = None


def _get_or_create(s: Session, stmt: Any, make: Callable[[], Any]) -> Any:
    """The row ``stmt`` finds, or a new one from ``make``. Two writers may both find none
    (PostgreSQL does not serialize them as SQLite's write lock does): the insert runs in a
    savepoint, and the one that loses the race takes the winner's row."""
    row = s.scalar(stmt)
    if row is not None:
        return row
    try:
        with s.begin_nested():
            row = make()
            s.add(row)
        return row
    except IntegrityError:
        row = s.scalar(stmt)
        if row is None:
            raise
        return row


def _get_or_create_trace(s: Session, info: TraceInfo) -> Trace:
    t = _get_or_create(s, select(Trace).where(Trace.content_hash == info.content_hash), lambda: Trace(
        content_hash=info.content_hash, path=info.path, pool_class=info.pool_class, family=info.family,
        meta=info.meta, rows=info.rows, calls=info.calls))
    if t.path != info.path:
        t.path = info.path  # same content seen at a new place: remember the latest
    return t


def _get_or_create_build(s: Session, spec: str, version: str) -> Build:
    return _get_or_create(s, select(Build).where(Build.spec == spec),
                          lambda: Build(spec=spec, resolved_version=version))


def record_run(store: Store, report: Any, info: TraceInfo, *, build_version: str = "") -> int:
    """Store one ReplayReport atomically; returns the run id."""
    try:
        with store.session() as s, s.begin():
            trace = _get_or_create_trace(s, info)
            build = _get_or_create_build(s, report.build, build_version)
            fv = report.first_violation
            run = Run(
                trace=trace, build=build, mode=report.mode, device=report.device, status=report.status,
                exit_code=report.exit_code, calls_replayed=report.calls_replayed, wall_s=report.wall_s,
                calls_per_s=report.calls_per_s, cpu_s=getattr(report, "cpu_s", None),
                violation_total=sum(report.violation_counts.values()),
                divergence_total=sum(report.divergence_counts.values()),
                violation_counts=report.violation_counts, divergence_counts=report.divergence_counts,
                first_violation_call=fv.call if fv else None,
                first_violation_invariant=fv.invariant if fv else None,
                first_violation_method=fv.method if fv else None,
                capacity_assert_call=report.capacity_assert_call,
                capacity_assert_after_calls=report.capacity_assert_after_calls,
                kvreplay_version=__version__,
                message=getattr(report, "message", "") or None,
                kernels=getattr(report, "kernels", "none"),
                timeline=getattr(report, "timeline", None) or None,
            )
            run.violations = [
                ViolationRow(call=v.call, detected_call=v.detected_call, method=v.method, invariant=v.invariant,
                             rule=v.rule, sub_pool=v.sub_pool, indices=v.indices, message=v.message)
                for v in report.violations
            ]
            run.divergences = [
                DivergenceRow(call=d.call, method=d.method, kind=d.kind, expected=json.dumps(d.expected),
                              actual=json.dumps(d.actual),
                              message=d.message)
                for d in report.divergences
            ]
            s.add(run)
            s.flush()
            return run.id
    except SQLAlchemyError as exc:
        raise BadInput(f"could not store the run: {str(exc).splitlines()[0]}") from None


def list_runs(store: Store, *, trace: str | None = None, build: str | None = None, status: str | None = None,
              limit: int = 50, since: dt.datetime | None = None, until: dt.datetime | None = None,
              trace_hash: str | None = None) -> list[Run]:
    """Stored runs, newest first: ``trace`` matches a path part or a hash prefix,
    ``trace_hash`` one trace exactly; ``since``/``until`` bound when they were stored."""
    for name, value in (("trace", trace), ("build", build)):
        if value and len(value) > MAX_FILTER_CHARS:
            raise BadInput(f"the {name} filter is longer than {MAX_FILTER_CHARS} characters")
    q = select(Run).join(Run.trace).join(Run.build).options(selectinload(Run.trace), selectinload(Run.build))
    if trace_hash:
        q = q.where(Trace.content_hash == trace_hash)
    if since is not None:
        q = q.where(Run.started_at >= since)
    if until is not None:
        q = q.where(Run.started_at < until)
    if trace:
        q = q.where((Trace.path.contains(trace)) | (Trace.content_hash.startswith(trace)))
    if build:
        q = q.where(Build.spec == build)
    if status:
        q = q.where(Run.status == status)
    with store.session() as s:
        return list(s.scalars(q.order_by(Run.id.desc()).limit(limit)))


def build_specs(store: Store) -> list[str]:
    """Every build spec with a stored run."""
    with store.session() as s:
        return sorted(s.scalars(select(Build.spec).where(Build.id.in_(select(Run.build_id)))))


def trace_by_hash(store: Store, prefix: str) -> Trace | None:
    with store.session() as s:
        return s.scalars(select(Trace).where(Trace.content_hash.startswith(prefix)).limit(1)).first()


MAX_RUN_ID = (1 << 63) - 1  # the store's ids are 64-bit: a larger number names no run
MAX_FILTER_CHARS = 1000  # a filter longer than any path (SQLite refuses long LIKE patterns)


def get_run(store: Store, run_id: int) -> Run:
    if not 1 <= run_id <= MAX_RUN_ID:
        raise BadInput(f"no run {str(run_id)[:24]} in this database (run ids are 1 to {MAX_RUN_ID})")
    with store.session() as s:
        run = s.scalar(
            select(Run).where(Run.id == run_id).options(
                selectinload(Run.trace), selectinload(Run.build), selectinload(Run.violations),
                selectinload(Run.divergences),
            )
        )
    if run is None:
        raise BadInput(f"no run {run_id} in this database")
    return run


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):  # stored by kvreplay < 0.2 as display text
        return text


def run_to_dict(run: Run, *, details: bool = False) -> dict[str, Any]:
    """A stored run in the JSON vocabulary of docs/json.md (the same fields as a
    fresh replay's report, plus where and when it was stored)."""
    d: dict[str, Any] = {
        "run_id": run.id, "trace": run.trace.path, "trace_hash": run.trace.content_hash[:12],
        "trace_calls": run.trace.calls, "build": run.build.spec, "build_version": run.build.resolved_version,
        "mode": run.mode, "device": run.device, "status": run.status, "exit_code": run.exit_code,
        "calls_replayed": run.calls_replayed, "wall_s": round(run.wall_s, 3), "calls_per_s": round(run.calls_per_s),
        "cpu_s": round(run.cpu_s, 3) if run.cpu_s is not None else None,
        "violation_total": run.violation_total, "divergence_total": run.divergence_total,
        "violation_counts": run.violation_counts or {}, "divergence_counts": run.divergence_counts or {},
        "first_violation": (
            {"call": run.first_violation_call, "invariant": run.first_violation_invariant,
             "method": run.first_violation_method} if run.first_violation_call is not None else None
        ),
        "capacity_assert_call": run.capacity_assert_call,
        "capacity_assert_after_calls": run.capacity_assert_after_calls,
        "kvreplay_version": run.kvreplay_version,
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "message": run.message or "",
        "kernels": run.kernels or "none",
    }
    if details:
        d["violations"] = [
            {"call": v.call, "detected_call": v.detected_call, "method": v.method, "invariant": v.invariant,
             "rule": v.rule, "sub_pool": v.sub_pool, "indices": v.indices, "message": v.message}
            for v in run.violations
        ]
        d["divergences"] = [
            {"call": x.call, "method": x.method, "kind": x.kind, "expected": _json(x.expected),
             "actual": _json(x.actual), "message": x.message}
            for x in run.divergences
        ]
        if d["violations"]:
            d["first_violation"] = min(d["violations"], key=lambda v: (v["call"], v["detected_call"]))
        d["first_divergence"] = min(d["divergences"], key=lambda x: x["call"]) if d["divergences"] else None
    return d


def run_timeline(store: Store, run_id: int) -> dict[str, Any]:
    """A stored run's timeline ({} for runs stored before kvreplay kept one)."""
    with store.session() as s:
        value = s.scalar(select(Run.timeline).where(Run.id == run_id))
    return value if isinstance(value, dict) else {}


# What a stored run may stand in for a replay with, and when. The one rule, for every
# command that reuses runs (bisect, matrix):
# - the build pins its code exactly (BuildSpec.exact: a builtin pool, a release, a git
#   build at a full commit); py: and sglang builds can change under the same spec;
# - the run was made by this kvreplay version: the checker and the replayer are
#   kvreplay's own, so another version may find other things on the same code;
# - its status follows from the code and the trace alone: clean, violation, divergence,
#   unsupported. unloadable depends on the environment the build was loaded in (a
#   missing package), crashed and timeout on the machine: those are replayed again.
REUSABLE = frozenset({"clean", "violation", "divergence", "unsupported"})


def reusable_run(store: Store, content_hash: str, spec: BuildSpec, mode: str) -> Run | None:
    """The newest stored run that may stand in for replaying the trace with this
    content hash on ``spec`` in ``mode`` (the rule above), with its findings; or None."""
    if not spec.exact:
        return None
    q = (select(Run).join(Run.trace).join(Run.build)
         .where(Trace.content_hash == content_hash, Build.spec == spec.text, Run.mode == mode,
                Run.status.in_(REUSABLE), Run.kvreplay_version == __version__)
         .options(selectinload(Run.violations), selectinload(Run.divergences))
         .order_by(Run.id.desc()).limit(1))
    with store.session() as s:
        return s.scalar(q)
