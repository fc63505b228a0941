"""Learning-rate brackets that adapt: a trial row records the round that added its learning
rate (``lr_round``: NULL for the spec's grid, 1 for the first point beyond it, ...).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("cemlab_trials") as batch:
        batch.add_column(sa.Column("lr_round", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("cemlab_trials") as batch:
        batch.drop_column("lr_round")
