"""The experiment ledger: which trials exist, their status, MLflow run and checkpoint.

Two SQLAlchemy tables, ``cemlab_experiments`` and ``cemlab_trials``, in any SQLAlchemy database:
by default the one behind MLflow's tracking store (``settings.ledger_url``), a PostgreSQL URL on
a cluster. The ledger is what makes a trial run exactly once: a trial's row (unique per
experiment and trial hash) holds its single MLflow run id, and a finished row is never rerun.
It is the single source of a trial's status, a ``Status`` (stored as its upper-case name in a
VARCHAR(16) column).

Schema migrations
-----------------
The schema is versioned by Alembic, with the migrations in ``orchestrator/migrations/``
(``env.py``, and one revision per schema change under ``versions/``; ``0001`` is the
original schema). ``Ledger(url)`` upgrades the database to the newest revision when it opens
it (``migrate=False`` opens it read-only, e.g. for the dashboard). A ledger created before
the migrations existed (its tables made by ``create_all``, no version row) is adopted: stamped
at ``0001`` as it is, rows kept, then upgraded.

The ledger usually shares its database with MLflow, which also uses Alembic with its own
``alembic_version`` table, so the ledger's revision is kept in ``cemlab_alembic_version``
(``VERSION_TABLE``) and its migrations only ever see ``cemlab_*`` tables (``include_name``):
MLflow's tables are never compared, altered or dropped. Upgrades are serialized across
processes: a transaction-scoped advisory lock on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite.

To change the schema, edit the ORM classes below, then add a revision with the Alembic CLI
against a database at the current head (the URL comes from ``-x url=...`` or
``$CEMLAB_LEDGER_URL``)::

    alembic -c orchestrator/migrations/alembic.ini -x url=sqlite:///ledger.db \\
        revision --autogenerate --rev-id 0002 -m "add trials.node"

review the file it writes under ``orchestrator/migrations/versions/`` (``revision -m`` alone
writes an empty one to fill in), and test it; ``Ledger(url)`` applies it on its next start.
``alembic -c orchestrator/migrations/alembic.ini -x url=... current`` (``history``,
``upgrade head``, ``downgrade -1``) inspect or move a database already under Alembic.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import (
    Connection,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

if TYPE_CHECKING:  # alembic is imported by Ledger(url), not on importing this module
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "cemlab_alembic_version"
TABLE_PREFIX = "cemlab_"
FIRST_REVISION = "0001"  # the schema of the ledgers created by ``create_all``, before Alembic
# pg_advisory_xact_lock key serializing ledger migrations on a PostgreSQL server: a constant no
# other application is likely to use (the first 8 bytes of sha256(b"cemlab_ledger"), signed).
_PG_LOCK_KEY = -6133592296717213964


class Status(enum.StrEnum):
    """A trial's status, in the order a trial goes through them (FAILED instead of FINISHED)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"


class StatusType(TypeDecorator):
    """A ``Status`` in a VARCHAR(16) column holding its value; rejects any other string."""

    impl = String(16)
    cache_ok = True

    def process_bind_param(self, value, dialect) -> str | None:
        return None if value is None else Status(value).value

    def process_result_value(self, value, dialect) -> Status | None:
        return None if value is None else Status(value)

    @property
    def python_type(self) -> type:
        return Status


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
    status: Mapped[Status] = mapped_column(StatusType, default=Status.PENDING)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    checkpoint_path: Mapped[str | None] = mapped_column(Text)
    metric: Mapped[float | None] = mapped_column(Float)  # the workload's test metric when done
    val_metric: Mapped[float | None] = mapped_column(Float)  # its validation metric (selection)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now, onupdate=_now)


def include_name(name: str | None, type_: str, parent_names: dict) -> bool:
    """Alembic's ``include_name`` hook: the ledger's migrations see only its own tables
    (``cemlab_*`` but the version table), never MLflow's or anyone else's."""
    if type_ == "table":
        return name is not None and name.startswith(TABLE_PREFIX) and name != VERSION_TABLE
    return True


def migration_lock(conn: Connection) -> None:
    """Hold, until ``conn``'s transaction ends, the lock that serializes ledger migrations.

    PostgreSQL: a transaction-level advisory lock (DDL is transactional there, so a second
    process waits, then finds the schema at head). SQLite: ``BEGIN IMMEDIATE``, the database's
    write lock, taken before the first statement (pysqlite itself would run DDL outside any
    transaction); ``conn`` must not have executed anything yet. Other databases: none.
    """
    dialect = conn.dialect.name
    if dialect == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
    elif dialect == "sqlite" and conn.dialect.driver == "pysqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def alembic_config(conn: Connection | None = None) -> Config:
    """The Alembic ``Config`` of the ledger's migrations, run on ``conn`` if given."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if conn is not None:
        cfg.attributes["connection"] = conn
    return cfg


@functools.cache
def head_revisions() -> frozenset[str]:
    """The newest revision(s) of the migrations (one, unless the history branched)."""
    from alembic.script import ScriptDirectory

    return frozenset(ScriptDirectory.from_config(alembic_config()).get_heads())


def current_revisions(conn: Connection) -> frozenset[str]:
    """The revision(s) the ledger in ``conn``'s database is at: empty if not under Alembic."""
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return frozenset(context.get_current_heads())


def upgrade(engine: Engine) -> None:
    """Bring the ledger schema in ``engine``'s database to the newest revision, in one
    transaction under ``migration_lock``: creates it in a database without it, adopts one made
    by ``create_all`` before the migrations existed (stamped at ``FIRST_REVISION``), and does
    nothing (and takes no lock) when it is already at head.

    Raises:
        RuntimeError: only one of the ledger's tables exists and no revision is recorded.
    """
    from alembic import command

    with engine.connect() as conn:
        if current_revisions(conn) == head_revisions():
            return
    with engine.begin() as conn:
        migration_lock(conn)
        if not current_revisions(conn):
            tables = set(inspect(conn).get_table_names()) & set(Base.metadata.tables)
            if tables == set(Base.metadata.tables):
                command.stamp(alembic_config(conn), FIRST_REVISION)
            elif tables:
                raise RuntimeError(f"ledger table(s) {sorted(tables)} exist without the rest "
                                   f"and without {VERSION_TABLE}: repair by hand")
        command.upgrade(alembic_config(conn), "head")


def _missing_sqlite_file(url: URL) -> bool:
    """Whether ``url`` names a SQLite file that does not exist (connecting would create it)."""
    if url.get_backend_name() != "sqlite" or url.query.get("uri"):
        return False
    return url.database not in (None, "", ":memory:") and not Path(url.database).exists()


class Ledger:
    """The ledger at SQLAlchemy ``url``.

    With ``migrate`` (the default) its schema is created or upgraded to the newest revision
    now (``upgrade``); without, nothing is ever written by opening it, and the reading methods
    return no experiment or trial while its tables do not exist (a read-only viewer such as
    the dashboard, which must not create or migrate the ledger of a running experiment).

    Raises:
        sqlalchemy.exc.ArgumentError: an unparseable URL.
        sqlalchemy.exc.OperationalError: the database cannot be reached (with ``migrate``;
            else at the first read).
    """

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
        self.engine = create_engine(url, connect_args=connect_args)
        self._tables_exist = False
        if migrate:
            upgrade(self.engine)
            self._tables_exist = True

    def _has_tables(self) -> bool:
        """Whether the ledger's tables exist (checked until they do; they are never dropped)."""
        if not self._tables_exist and not _missing_sqlite_file(self.engine.url):
            with self.engine.connect() as conn:
                inspector = inspect(conn)
                self._tables_exist = all(inspector.has_table(t) for t in Base.metadata.tables)
        return self._tables_exist

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: committed when the block ends, rolled back on an exception."""
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            yield s

    def experiments(self) -> list[ExperimentRow]:
        if not self._has_tables():
            return []
        with self.session() as s:
            return list(s.scalars(select(ExperimentRow).order_by(ExperimentRow.id)))

    def experiment(self, name: str) -> ExperimentRow | None:
        if not self._has_tables():
            return None
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
        if not self._has_tables():
            return []
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
        """Set ``fields`` of trial row ``row_id``; ``status`` (a ``Status`` or its value)
        stamps started/finished times.

        Raises:
            ValueError: an unknown status.
        """
        if fields.get("status") is not None:
            try:
                fields["status"] = status = Status(fields["status"])
            except ValueError:
                raise ValueError(f"status must be one of {', '.join(Status)}, "
                                 f"got {fields['status']!r}") from None
            if status is Status.RUNNING:
                fields.setdefault("started_at", _now())
                fields.setdefault("finished_at", None)
            elif status in (Status.FINISHED, Status.FAILED):
                fields.setdefault("finished_at", _now())
        with self.session() as s:
            row = s.get(TrialRow, row_id)
            for k, v in fields.items():
                setattr(row, k, v)
            return row
