"""initial schema: traces, builds, runs, violations, divergences

Revision ID: 0001
Revises:
Create Date: 2026-11-29 19:39:22.664922
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    # In this order: a table's foreign keys name tables made before it.
    _create_builds()
    _create_traces()
    _create_runs()
    _create_divergences()
    _create_violations()


def _create_builds() -> None:
    op.create_table(
        "builds",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("spec", sa.String(length=500), nullable=False),
        sa.Column("resolved_version", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("spec"),
    )


def _create_traces() -> None:
    op.create_table(
        "traces",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("pool_class", sa.String(length=200), nullable=False),
        sa.Column("family", sa.String(length=16), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("content_hash"),
    )


def _create_runs() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("build_id", sa.Integer(), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("device", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=False),
        sa.Column("calls_replayed", sa.Integer(), nullable=False),
        sa.Column("wall_s", sa.Float(), nullable=False),
        sa.Column("calls_per_s", sa.Float(), nullable=False),
        sa.Column("violation_total", sa.Integer(), nullable=False),
        sa.Column("divergence_total", sa.Integer(), nullable=False),
        sa.Column("violation_counts", sa.JSON(), nullable=False),
        sa.Column("divergence_counts", sa.JSON(), nullable=False),
        sa.Column("first_violation_seq", sa.Integer(), nullable=True),
        sa.Column("first_violation_invariant", sa.String(length=32), nullable=True),
        sa.Column("first_violation_method", sa.String(length=64), nullable=True),
        sa.Column("capacity_assert_seq", sa.Integer(), nullable=True),
        sa.Column("capacity_assert_after_calls", sa.Integer(), nullable=True),
        sa.Column("kvreplay_version", sa.String(length=32), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["build_id"],
            ["builds.id"],
        ),
        sa.ForeignKeyConstraint(
            ["trace_id"],
            ["traces.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_build_id"), ["build_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_trace_id"), ["trace_id"], unique=False)


def _create_divergences() -> None:
    op.create_table(
        "divergences",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("expected", sa.Text(), nullable=False),
        sa.Column("actual", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("divergences", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_divergences_kind"), ["kind"], unique=False)
        batch_op.create_index(batch_op.f("ix_divergences_run_id"), ["run_id"], unique=False)


def _create_violations() -> None:
    op.create_table(
        "violations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("detected_seq", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(length=64), nullable=False),
        sa.Column("invariant", sa.String(length=32), nullable=False),
        sa.Column("rule", sa.String(length=64), nullable=False),
        sa.Column("sub_pool", sa.String(length=16), nullable=False),
        sa.Column("indices", sa.JSON(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("violations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_violations_invariant"), ["invariant"], unique=False)
        batch_op.create_index(batch_op.f("ix_violations_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("violations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_violations_run_id"))
        batch_op.drop_index(batch_op.f("ix_violations_invariant"))

    op.drop_table("violations")
    with op.batch_alter_table("divergences", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_divergences_run_id"))
        batch_op.drop_index(batch_op.f("ix_divergences_kind"))

    op.drop_table("divergences")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_trace_id"))
        batch_op.drop_index(batch_op.f("ix_runs_status"))
        batch_op.drop_index(batch_op.f("ix_runs_build_id"))

    op.drop_table("runs")
    op.drop_table("traces")
    op.drop_table("builds")
