"""The ledger's original schema, as ``Base.metadata.create_all`` made it before Alembic.

A ledger created that way is stamped at this revision instead of running it
(``orchestrator.records.ledger.upgrade``): keep it identical to that schema, unnamed constraints
included (PostgreSQL names them itself, the same way in both cases).

Revision ID: 0001
Revises: None
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "cemlab_experiments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("workload", sa.String(length=50), nullable=False),
        sa.Column("spec_yaml", sa.Text(), nullable=False),
        sa.Column("mlflow_experiment_id", sa.String(length=64), nullable=True),
        sa.Column("parent_run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "cemlab_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("trial_hash", sa.String(length=64), nullable=False),
        sa.Column("dataset", sa.String(length=100), nullable=False),
        sa.Column("variant", sa.String(length=100), nullable=False),
        sa.Column("size", sa.String(length=100), nullable=False),
        sa.Column("lr", sa.Float(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),  # a Status value
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("checkpoint_path", sa.Text(), nullable=True),
        sa.Column("metric", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["experiment_id"], ["cemlab_experiments.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("experiment_id", "trial_hash"),
    )


def downgrade() -> None:
    op.drop_table("cemlab_trials")
    op.drop_table("cemlab_experiments")
