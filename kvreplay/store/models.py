"""SQLAlchemy 2 models of what replays leave behind: traces, builds, runs, and each
run's violations and divergences. The schema is created and changed only by the
Alembic migrations in ``migrations/``."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Base(DeclarativeBase):
    pass


class Trace(Base):
    __tablename__ = "traces"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    content_hash: Mapped[str] = mapped_column(String(64), unique=True)
    path: Mapped[str] = mapped_column(Text)
    pool_class: Mapped[str] = mapped_column(String(200))
    family: Mapped[str] = mapped_column(String(16))
    meta: Mapped[dict] = mapped_column(JSON)
    rows: Mapped[int] = mapped_column(Integer)
    calls: Mapped[int | None] = mapped_column(Integer, nullable=True)  # top-level calls (0002)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Build(Base):
    __tablename__ = "builds"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec: Mapped[str] = mapped_column(String(500), unique=True)
    resolved_version: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id"), index=True)
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id"), index=True)
    mode: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), index=True)
    exit_code: Mapped[int] = mapped_column(Integer)
    calls_replayed: Mapped[int] = mapped_column(Integer)
    wall_s: Mapped[float] = mapped_column(Float)
    calls_per_s: Mapped[float] = mapped_column(Float)
    cpu_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # (0007)
    violation_total: Mapped[int] = mapped_column(Integer, default=0)
    divergence_total: Mapped[int] = mapped_column(Integer, default=0)
    violation_counts: Mapped[dict] = mapped_column(JSON, default=dict)
    divergence_counts: Mapped[dict] = mapped_column(JSON, default=dict)
    first_violation_call: Mapped[int | None] = mapped_column(Integer, nullable=True)  # call numbers (0004)
    first_violation_invariant: Mapped[str | None] = mapped_column(String(32), nullable=True)
    first_violation_method: Mapped[str | None] = mapped_column(String(64), nullable=True)
    capacity_assert_call: Mapped[int | None] = mapped_column(Integer, nullable=True)
    capacity_assert_after_calls: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kvreplay_version: Mapped[str] = mapped_column(String(32))
    message: Mapped[str | None] = mapped_column(Text, nullable=True)  # why, when no violation says (0003)
    kernels: Mapped[str] = mapped_column(String(24), default="none", server_default="none")  # (0005)
    # Replayed occupancy and finding positions (replay/timeline.py), for pictures (0006).
    timeline: Mapped[dict | None] = mapped_column(JSON, nullable=True, deferred=True)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    trace: Mapped[Trace] = relationship()
    build: Mapped[Build] = relationship()
    violations: Mapped[list[ViolationRow]] = relationship(
        back_populates="run", cascade="all, delete-orphan", order_by="ViolationRow.call"
    )
    divergences: Mapped[list[DivergenceRow]] = relationship(
        back_populates="run", cascade="all, delete-orphan", order_by="DivergenceRow.call"
    )


class ViolationRow(Base):
    __tablename__ = "violations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    call: Mapped[int] = mapped_column(Integer)
    detected_call: Mapped[int] = mapped_column(Integer)
    method: Mapped[str] = mapped_column(String(64))
    invariant: Mapped[str] = mapped_column(String(32), index=True)
    rule: Mapped[str] = mapped_column(String(64))
    sub_pool: Mapped[str] = mapped_column(String(16))
    indices: Mapped[list] = mapped_column(JSON)
    message: Mapped[str] = mapped_column(Text)

    run: Mapped[Run] = relationship(back_populates="violations")


class DivergenceRow(Base):
    __tablename__ = "divergences"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    call: Mapped[int] = mapped_column(Integer)
    method: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16), index=True)
    expected: Mapped[str] = mapped_column(Text)
    actual: Mapped[str] = mapped_column(Text)
    message: Mapped[str] = mapped_column(Text)

    run: Mapped[Run] = relationship(back_populates="divergences")


__all__ = ["Base", "Build", "DivergenceRow", "Run", "Trace", "ViolationRow"]
