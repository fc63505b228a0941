"""A trial's validation metric beside its test metric: learning rates and ``best`` models are
chosen on validation, test is reported at that choice.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("cemlab_trials") as batch:
        batch.add_column(sa.Column("val_metric", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("cemlab_trials") as batch:
        batch.drop_column("val_metric")
