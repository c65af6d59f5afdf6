"""Call numbers instead of row numbers: findings name top-level calls 1..N

kvreplay 0.2 reports every finding at its top-level call's number in the trace
(the Nth call), where 0.1 gave the row's ``seq`` (which counts nested rows too).
The columns are renamed; runs stored by 0.1 (``runs.kvreplay_version``) keep the
row numbers they were stored with. Divergence values are stored as JSON.

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_RENAMES = {
    "runs": (("first_violation_seq", "first_violation_call"), ("capacity_assert_seq", "capacity_assert_call")),
    "violations": (("seq", "call"), ("detected_seq", "detected_call")),
    "divergences": (("seq", "call"),),
}


def upgrade() -> None:
    for table, pairs in _RENAMES.items():
        with op.batch_alter_table(table) as batch_op:
            for old, new in pairs:
                batch_op.alter_column(old, new_column_name=new)


def downgrade() -> None:
    for table, pairs in _RENAMES.items():
        with op.batch_alter_table(table) as batch_op:
            for old, new in pairs:
                batch_op.alter_column(new, new_column_name=old)
