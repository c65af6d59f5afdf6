"""runs.cpu_s: the CPU time of the replay itself, beside its wall time: on a shared
machine the wall time says how busy the machine was, the CPU time what the replay cost

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch_op:
        batch_op.add_column(sa.Column("cpu_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch_op:
        batch_op.drop_column("cpu_s")
