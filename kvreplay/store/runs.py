"""Writing a replay's results and reading them back.

A run, its trace and build rows, its violations and divergences are written in
one transaction: a reader sees all of a run or none of it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, selectinload

from kvreplay import __version__
from kvreplay.errors import BadInput
from kvreplay.store.db import Store
from kvreplay.store.models import Build, DivergenceRow, Run, Trace, ViolationRow


def file_hash(path: str | Path) -> str:
    """Content hash of a trace file, or of a rotated trace's parts in order."""
    from kvreplay.recorder.trace_format import PART_GLOB

    path = Path(path)
    rotated = path.is_dir()
    h = hashlib.sha256()
    for part in sorted(path.glob(PART_GLOB)) if rotated else [path]:
        if rotated:
            h.update(part.name.encode() + b"\0")
        with open(part, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


@dataclass
class TraceInfo:
    path: str
    content_hash: str
    pool_class: str
    family: str
    meta: dict[str, Any]
    rows: int
    calls: int | None = None


def _get_or_create_trace(s: Session, info: TraceInfo) -> Trace:
    t = s.scalar(select(Trace).where(Trace.content_hash == info.content_hash))
    if t is None:
        t = Trace(content_hash=info.content_hash, path=info.path, pool_class=info.pool_class, family=info.family,
                  meta=info.meta, rows=info.rows, calls=info.calls)
        s.add(t)
        s.flush()
    elif t.path != info.path:
        t.path = info.path  # same content seen at a new place: remember the latest
    return t


def _get_or_create_build(s: Session, spec: str, version: str) -> Build:
    b = s.scalar(select(Build).where(Build.spec == spec))
    if b is None:
        b = Build(spec=spec, resolved_version=version)
        s.add(b)
        s.flush()
    return b


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
                calls_per_s=report.calls_per_s,
                violation_total=sum(report.violation_counts.values()),
                divergence_total=sum(report.divergence_counts.values()),
                violation_counts=report.violation_counts, divergence_counts=report.divergence_counts,
                first_violation_seq=fv.seq if fv else None,
                first_violation_invariant=fv.invariant if fv else None,
                first_violation_method=fv.method if fv else None,
                capacity_assert_seq=report.capacity_assert_seq,
                capacity_assert_after_calls=report.capacity_assert_after_calls,
                kvreplay_version=__version__,
                message=getattr(report, "message", "") or None,
            )
            run.violations = [
                ViolationRow(seq=v.seq, detected_seq=v.detected_seq, method=v.method, invariant=v.invariant,
                             rule=v.rule, sub_pool=v.sub_pool, indices=v.indices, message=v.message)
                for v in report.violations
            ]
            run.divergences = [
                DivergenceRow(seq=d.seq, method=d.method, kind=d.kind, expected=d.expected, actual=d.actual,
                              message=d.message)
                for d in report.divergences
            ]
            s.add(run)
            s.flush()
            return run.id
    except SQLAlchemyError as exc:
        raise BadInput(f"could not store the run: {str(exc).splitlines()[0]}") from None


def list_runs(store: Store, *, trace: str | None = None, build: str | None = None, status: str | None = None,
              limit: int = 50) -> list[Run]:
    q = select(Run).join(Run.trace).join(Run.build).options(selectinload(Run.trace), selectinload(Run.build))
    if trace:
        q = q.where((Trace.path.contains(trace)) | (Trace.content_hash.startswith(trace)))
    if build:
        q = q.where(Build.spec == build)
    if status:
        q = q.where(Run.status == status)
    with store.session() as s:
        return list(s.scalars(q.order_by(Run.id.desc()).limit(limit)))


def get_run(store: Store, run_id: int) -> Run:
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


def run_to_dict(run: Run, *, details: bool = False) -> dict[str, Any]:
    d = {
        "id": run.id, "trace": run.trace.path, "trace_hash": run.trace.content_hash[:12],
        "trace_calls": run.trace.calls, "build": run.build.spec,
        "mode": run.mode, "device": run.device, "status": run.status, "exit_code": run.exit_code,
        "calls_replayed": run.calls_replayed, "wall_s": round(run.wall_s, 3), "calls_per_s": round(run.calls_per_s),
        "violation_total": run.violation_total, "divergence_total": run.divergence_total,
        "first_violation": (
            {"seq": run.first_violation_seq, "invariant": run.first_violation_invariant,
             "method": run.first_violation_method} if run.first_violation_seq is not None else None
        ),
        "capacity_assert_seq": run.capacity_assert_seq,
        "capacity_assert_after_calls": run.capacity_assert_after_calls,
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "message": run.message or "",
    }
    if details:
        d["violation_counts"] = run.violation_counts
        d["divergence_counts"] = run.divergence_counts
        d["violations"] = [
            {"seq": v.seq, "detected_seq": v.detected_seq, "method": v.method, "invariant": v.invariant,
             "rule": v.rule, "sub_pool": v.sub_pool, "indices": v.indices, "message": v.message}
            for v in run.violations
        ]
        d["divergences"] = [
            {"seq": x.seq, "method": x.method, "kind": x.kind, "expected": x.expected, "actual": x.actual,
             "message": x.message}
            for x in run.divergences
        ]
    return d
