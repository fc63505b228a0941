"""The experiment ledger: which trials exist, their status, MLflow run and checkpoint.

Two SQLAlchemy tables, ``cemlab_experiments`` and ``cemlab_trials``, in any SQLAlchemy database:
by default the one behind MLflow's tracking store (``settings.ledger_url``), a PostgreSQL URL on
a cluster. The ledger is what makes a trial run exactly once: a trial's row (unique per
experiment and trial hash) holds its single MLflow run id, and a finished row is never rerun.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import (
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

STATUSES = ("PENDING", "RUNNING", "FINISHED", "FAILED")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class ExperimentRow(Base):
    """One experiment spec (by name) and its MLflow experiment and parent run."""

    __tablename__ = "cemlab_experiments"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    workload: Mapped[str] = mapped_column(String(50))
    spec_yaml: Mapped[str] = mapped_column(Text)
    mlflow_experiment_id: Mapped[str | None] = mapped_column(String(64))
    parent_run_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now, onupdate=_now)


class TrialRow(Base):
    """One trial of an experiment: its hash, grid coordinates, status and where it lives."""

    __tablename__ = "cemlab_trials"
    __table_args__ = (UniqueConstraint("experiment_id", "trial_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = mapped_column(ForeignKey("cemlab_experiments.id"))
    trial_hash: Mapped[str] = mapped_column(String(64))
    dataset: Mapped[str] = mapped_column(String(100))
    variant: Mapped[str] = mapped_column(String(100))
    size: Mapped[str] = mapped_column(String(100))
    lr: Mapped[float] = mapped_column(Float)
    seed: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="PENDING")
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    checkpoint_path: Mapped[str | None] = mapped_column(Text)
    metric: Mapped[float | None] = mapped_column(Float)  # the workload's test metric when done
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now, onupdate=_now)


class Ledger:
    """The ledger at SQLAlchemy ``url``; its tables are created when missing.

    Raises:
        sqlalchemy.exc.ArgumentError: an unparseable URL.
        sqlalchemy.exc.OperationalError: the database cannot be reached.
    """

    def __init__(self, url: str) -> None:
        connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
        self.engine = create_engine(url, connect_args=connect_args)
        Base.metadata.create_all(self.engine)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: committed when the block ends, rolled back on an exception."""
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            yield s

    def experiments(self) -> list[ExperimentRow]:
        with self.session() as s:
            return list(s.scalars(select(ExperimentRow).order_by(ExperimentRow.id)))

    def experiment(self, name: str) -> ExperimentRow | None:
        with self.session() as s:
            return s.scalar(select(ExperimentRow).where(ExperimentRow.name == name))

    def ensure_experiment(self, name: str, workload: str, spec_yaml: str) -> ExperimentRow:
        """The experiment row ``name``, created (or its spec text updated) in one transaction."""
        with self.session() as s:
            row = s.scalar(select(ExperimentRow).where(ExperimentRow.name == name))
            if row is None:
                row = ExperimentRow(name=name, workload=workload, spec_yaml=spec_yaml)
                s.add(row)
            else:
                row.spec_yaml = spec_yaml
            s.flush()
            return row

    def update_experiment(self, experiment_id: int, **fields) -> None:
        with self.session() as s:
            row = s.get(ExperimentRow, experiment_id)
            for k, v in fields.items():
                setattr(row, k, v)

    def trials(self, experiment_id: int) -> list[TrialRow]:
        with self.session() as s:
            return list(s.scalars(select(TrialRow).where(TrialRow.experiment_id == experiment_id)
                                  .order_by(TrialRow.id)))

    def ensure_trial(self, experiment_id: int, trial_hash: str, **coords) -> TrialRow:
        """The row of trial ``trial_hash``, inserted as PENDING with ``coords`` if new."""
        with self.session() as s:
            row = s.scalar(select(TrialRow).where(TrialRow.experiment_id == experiment_id,
                                                  TrialRow.trial_hash == trial_hash))
            if row is None:
                row = TrialRow(experiment_id=experiment_id, trial_hash=trial_hash, **coords)
                s.add(row)
                s.flush()
            return row

    def update_trial(self, row_id: int, **fields) -> TrialRow:
        """Set ``fields`` of trial row ``row_id``; ``status`` stamps started/finished times.

        Raises:
            ValueError: an unknown status.
        """
        with self.session() as s:
            row = s.get(TrialRow, row_id)
            status = fields.get("status")
            if status is not None:
                if status not in STATUSES:
                    raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
                if status == "RUNNING":
                    fields.setdefault("started_at", _now())
                    fields.setdefault("finished_at", None)
                elif status in ("FINISHED", "FAILED"):
                    fields.setdefault("finished_at", _now())
            for k, v in fields.items():
                setattr(row, k, v)
            return row
