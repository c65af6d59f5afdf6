"""runs.kernels: whether the build's Triton kernels ran, and where (none,
triton-interpreter, cuda): a release replayed on CPU runs its kernels in Triton's
interpreter, and a result should say so

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch_op:
        batch_op.add_column(sa.Column("kernels", sa.String(24), nullable=False, server_default="none"))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch_op:
        batch_op.drop_column("kernels")
