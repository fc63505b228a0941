"""Result bundles round-trip whole: a trial imported from a bundle keeps the bundle's fields
that no other column holds (``carried``: its MLflow run id where it trained, the run's params,
metrics and history, the exporting host and versions, as one JSON object; NULL for a trial
trained here), so exporting it again loses none of them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("cemlab_trials") as batch:
        batch.add_column(sa.Column("carried", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("cemlab_trials") as batch:
        batch.drop_column("carried")
