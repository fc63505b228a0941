"""The trial cache: a trial row settled from a finished trial of the same id in another
experiment points to the row that trained it (``source_trial_id``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("cemlab_trials") as batch:
        batch.add_column(sa.Column("source_trial_id", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_cemlab_trials_source_trial_id", "cemlab_trials",
                                 ["source_trial_id"], ["id"])
        batch.create_index("ix_cemlab_trials_trial_hash", ["trial_hash"])


def downgrade() -> None:
    with op.batch_alter_table("cemlab_trials") as batch:
        batch.drop_index("ix_cemlab_trials_trial_hash")
        batch.drop_constraint("fk_cemlab_trials_source_trial_id", type_="foreignkey")
        batch.drop_column("source_trial_id")
