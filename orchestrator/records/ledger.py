"""The experiment ledger: which trials exist, their status, MLflow run and checkpoint.

Two SQLAlchemy tables, ``cemlab_experiments`` and ``cemlab_trials``, in any SQLAlchemy database:
by default the one behind MLflow's tracking store (``settings.ledger_url``), a PostgreSQL URL on
a cluster. The ledger is what makes a trial run exactly once: a trial's row (unique per
experiment and trial hash) holds its single MLflow run id, and a finished row is never rerun.
It is the single source of a trial's status, a ``Status`` (stored as its upper-case name in a
VARCHAR(16) column).

Leases
------
A submission trains a trial only while it holds the trial's lease (``acquire``): its owner id, the
time of its last heartbeat and an expiry, taken under a lock on the trial id across experiments
(a transaction-scoped advisory lock keyed by the trial id on PostgreSQL; the database's single
write lock, ``BEGIN IMMEDIATE``, on SQLite): of the rows that share a trial id, in any
experiment, one at a time holds a live lease. A holder renews its leases while it runs
(``renew``); a finished or failed trial's lease is released with its status, which only the
holder records (``update_trial(..., owner=...)``); the lease of an owner that died is taken over
once it has expired. Expiry is compared with the claimer's clock (UTC): hosts must agree to well
within a lease (seconds, against the default 120 s).

The trial cache
---------------
A trial id is the trial's scientific identity (model, data, budget, optimizer, seed, code), not
its experiment's. A trial of one experiment whose id has a FINISHED row in another experiment,
trained there (``finished_copy``), is settled from that row instead of being trained again: its
row takes the metrics and checkpoint and points to the trained row (``source_trial_id``).

Database outages
----------------
Every ledger call retries a database that does not answer (connection refused or lost, SQLite
busy), with exponential backoff from 0.5 s to 30 s, for up to ``retry_deadline_s`` (default
300 s), then raises ``LedgerUnavailable`` in one line (the URL's password masked). A retried
call is safe: each is one transaction, and each is idempotent (a retry of one whose commit
went through, but whose answer was lost, finds its own work done).

Schema migrations
-----------------
The schema is versioned by Alembic, with the migrations in ``orchestrator/records/migrations/``
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

    alembic -c orchestrator/records/migrations/alembic.ini -x url=sqlite:///ledger.db \\
        revision --autogenerate --rev-id 0002 -m "add trials.node"

review the file it writes under ``orchestrator/records/migrations/versions/`` (``revision -m`` alone
writes an empty one to fill in), and test it; ``Ledger(url)`` applies it on its next start.
``alembic -c orchestrator/records/migrations/alembic.ini -x url=... current`` (``history``,
``upgrade head``, ``downgrade -1``) inspect or move a database already under Alembic.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import (
    Connection,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    and_,
    create_engine,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

if TYPE_CHECKING:  # alembic is imported by Ledger(url), not on importing this module
    from alembic.config import Config

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
RETRY_DEADLINE_S = 300.0  # how long a ledger call retries a database that does not answer
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


def utc_now() -> dt.datetime:
    """Now in UTC, naive (as the ledger's DateTime columns store it)."""
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
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utc_now)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utc_now, onupdate=utc_now)


class TrialRow(Base):
    """One trial of an experiment: its hash, grid coordinates, status and where it lives."""

    __tablename__ = "cemlab_trials"
    __table_args__ = (UniqueConstraint("experiment_id", "trial_hash"),
                      Index("ix_cemlab_trials_trial_hash", "trial_hash"))
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
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utc_now)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utc_now, onupdate=utc_now)
    lease_owner: Mapped[str | None] = mapped_column(String(200))  # the submission training it
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(DateTime)  # its owner's last renewal
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    # the row of another experiment that trained this trial, when settled from the trial cache
    source_trial_id: Mapped[int | None] = mapped_column(
        ForeignKey("cemlab_trials.id", name="fk_cemlab_trials_source_trial_id"))
    # the round of an adapting learning-rate bracket that added this trial's LR (None: the grid)
    lr_round: Mapped[int | None] = mapped_column(Integer)
    # a trial imported from a result bundle: the bundle's fields that no ledger column holds
    # (its MLflow run id in the store where it trained, the run's params, metrics and history,
    # the host and versions that exported it), one JSON object, so an export gives them back
    carried: Mapped[str | None] = mapped_column(Text)


@dataclass(frozen=True)
class Lease:
    """What ``Ledger.acquire`` found: whether the caller now holds the trial's lease, who holds
    it (``owner``, until ``expires_at``, UTC; possibly on a row of the same trial id in another
    experiment), the trial's status, and ``previous_owner`` when the caller took over a lease
    that had expired. ``owner`` is None when nobody holds it (a FINISHED trial)."""

    acquired: bool
    status: Status | None
    owner: str | None
    expires_at: dt.datetime | None
    previous_owner: str | None = None


@dataclass(frozen=True)
class Imported:
    """What ``Ledger.import_finished`` did: trials it recorded FINISHED (``imported``), trials
    FINISHED in the ledger already and left as they are (``present``), and unfinished rows
    under a live lease, left to the submission that holds it (``held``)."""

    imported: int
    present: int
    held: int


# the fields of a finished trial that ``Ledger.import_finished`` records
IMPORTED_FIELDS = ("dataset", "variant", "size", "lr", "seed", "lr_round", "metric",
                   "val_metric", "started_at", "finished_at", "checkpoint_path")


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


class LedgerUnavailable(RuntimeError):
    """The ledger database did not answer within the retry deadline."""


def _transient(e: OperationalError) -> bool:
    """Whether ``e`` is a database that does not answer now (worth retrying), not a mistake
    in the statement or the URL: on SQLite only a busy or unopenable file, elsewhere any
    operational error (connection refused, lost, the server shutting down) but a refused
    password, an unknown database or a missing permission."""
    if e.connection_invalidated:
        return True
    message = str(e.orig).lower()
    if "sqlite" in type(e.orig).__module__:
        return any(m in message for m in ("locked", "busy", "unable to open", "disk i/o"))
    return not any(m in message for m in ("authentication failed", "does not exist",
                                          "permission denied"))


def retrying(method):
    """Run the ``Ledger`` method ``method`` again while its database does not answer
    (``_transient``), with exponential backoff, until ``self.retry_deadline_s``.

    Raises:
        LedgerUnavailable: past the deadline, in one line naming the URL (password masked).
    """

    @functools.wraps(method)
    def call(self: Ledger, *args, **kwargs):
        start, delay = time.monotonic(), 0.5
        while True:
            try:
                return method(self, *args, **kwargs)
            except OperationalError as e:
                if not _transient(e):
                    raise
                reason = (str(e.orig).strip().splitlines() or [type(e.orig).__name__])[0]
                waited = time.monotonic() - start
                if waited + delay > self.retry_deadline_s:
                    raise LedgerUnavailable(
                        f"ledger database {self.shown_url} did not answer for {waited:.0f} s "
                        f"({method.__name__}): {reason}") from None
                log.warning("ledger database %s: %s; retrying %s in %.1f s", self.shown_url,
                            reason, method.__name__, delay)
                time.sleep(delay)
                delay = min(2 * delay, 30.0)

    return call


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

    Every method retries a database that does not answer for up to ``retry_deadline_s``
    (``retrying``).

    Raises:
        sqlalchemy.exc.ArgumentError: an unparseable URL.
        LedgerUnavailable: the database did not answer within ``retry_deadline_s`` (with
            ``migrate``; else at the first read).
        sqlalchemy.exc.OperationalError: it refused the URL (password, database name).
    """

    def __init__(self, url: str, *, migrate: bool = True,
                 retry_deadline_s: float = RETRY_DEADLINE_S) -> None:
        connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
        # pre-ping: a connection pooled before a database restart is replaced, not used
        self.engine = create_engine(url, connect_args=connect_args, pool_pre_ping=True)
        self.shown_url = self.engine.url.render_as_string(hide_password=True)
        self.retry_deadline_s = retry_deadline_s
        self._tables_exist = False
        if migrate:
            self._upgrade()
            self._tables_exist = True

    @retrying
    def _upgrade(self) -> None:
        upgrade(self.engine)

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

    @retrying
    def experiments(self) -> list[ExperimentRow]:
        if not self._has_tables():
            return []
        with self.session() as s:
            return list(s.scalars(select(ExperimentRow).order_by(ExperimentRow.id)))

    @retrying
    def experiment(self, name: str) -> ExperimentRow | None:
        if not self._has_tables():
            return None
        with self.session() as s:
            return s.scalar(select(ExperimentRow).where(ExperimentRow.name == name))

    @retrying
    def ensure_experiment(self, name: str, workload: str, spec_yaml: str) -> ExperimentRow:
        """The experiment row ``name``, created (or its spec text updated) in one transaction;
        a submission racing another to create it gets the winner's row."""
        try:
            return self._ensure_experiment(name, workload, spec_yaml)
        except IntegrityError:  # created by a concurrent submission since we looked
            return self._ensure_experiment(name, workload, spec_yaml)

    def _ensure_experiment(self, name: str, workload: str, spec_yaml: str) -> ExperimentRow:
        with self.session() as s:
            row = s.scalar(select(ExperimentRow).where(ExperimentRow.name == name))
            if row is None:
                row = ExperimentRow(name=name, workload=workload, spec_yaml=spec_yaml)
                s.add(row)
            else:
                row.spec_yaml = spec_yaml
            s.flush()
            return row

    @retrying
    def experiment_name(self, experiment_id: int) -> str:
        with self.session() as s:
            return s.get(ExperimentRow, experiment_id).name

    @retrying
    def update_experiment(self, experiment_id: int, **fields) -> None:
        with self.session() as s:
            row = s.get(ExperimentRow, experiment_id)
            for k, v in fields.items():
                setattr(row, k, v)

    @retrying
    def trials(self, experiment_id: int) -> list[TrialRow]:
        if not self._has_tables():
            return []
        with self.session() as s:
            return list(s.scalars(select(TrialRow).where(TrialRow.experiment_id == experiment_id)
                                  .order_by(TrialRow.id)))

    @retrying
    def trial_by_id(self, row_id: int) -> TrialRow | None:
        """Trial row ``row_id``, or None."""
        with self.session() as s:
            return s.get(TrialRow, row_id)

    @retrying
    def set_parent_run(self, experiment_id: int, run_id: str) -> str:
        """Make ``run_id`` the experiment's parent run unless it already has one; returns the
        parent run it has (compare-and-set: of two submissions creating one at once, the first
        to record it wins, and the other finds it here)."""
        with self.session() as s:
            s.execute(update(ExperimentRow).where(ExperimentRow.id == experiment_id,
                                                  ExperimentRow.parent_run_id.is_(None))
                      .values(parent_run_id=run_id))
            return s.get(ExperimentRow, experiment_id).parent_run_id

    @retrying
    def ensure_trial(self, experiment_id: int, trial_hash: str, **coords) -> TrialRow:
        """The row of trial ``trial_hash``, inserted as PENDING with ``coords`` if new (a
        concurrent submission's insert of the same trial wins, and its row is returned)."""
        try:
            return self._ensure_trial(experiment_id, trial_hash, **coords)
        except IntegrityError:
            return self._ensure_trial(experiment_id, trial_hash, **coords)

    def _ensure_trial(self, experiment_id: int, trial_hash: str, **coords) -> TrialRow:
        with self.session() as s:
            row = s.scalar(select(TrialRow).where(TrialRow.experiment_id == experiment_id,
                                                  TrialRow.trial_hash == trial_hash))
            if row is None:
                row = TrialRow(experiment_id=experiment_id, trial_hash=trial_hash, **coords)
                s.add(row)
                s.flush()
            return row

    @retrying
    def update_trial(self, row_id: int, *, owner: str | None = None,
                     **fields) -> TrialRow | None:
        """Set ``fields`` of trial row ``row_id``; ``status`` (a ``Status`` or its value)
        stamps started/finished times, and FINISHED or FAILED releases the lease.

        With ``owner``, only while ``owner`` holds the trial's lease: a trial driver whose
        lease another submission took over (after a heartbeat-less lapse) changes nothing,
        so it can neither settle nor release the new holder's trial. Held means the lease
        names ``owner``, expired or not, since no one else has taken it; or, for a retried
        settle whose commit went through, the row is settled with that status and released.

        Returns:
            The row as written, or None when ``owner`` does not hold the lease (or no row
            ``row_id`` exists).

        Raises:
            ValueError: an unknown status.
        """
        status = None
        if fields.get("status") is not None:
            try:
                fields["status"] = status = Status(fields["status"])
            except ValueError:
                raise ValueError(f"status must be one of {', '.join(Status)}, "
                                 f"got {fields['status']!r}") from None
            if status is Status.RUNNING:
                fields.setdefault("started_at", utc_now())
                fields.setdefault("finished_at", None)
            elif status in (Status.FINISHED, Status.FAILED):  # settled: nobody holds it now
                fields.setdefault("finished_at", utc_now())
                fields.update(lease_owner=None, heartbeat_at=None, lease_expires_at=None)
        where = [TrialRow.id == row_id]
        if owner is not None:
            held = TrialRow.lease_owner == owner
            if status in (Status.FINISHED, Status.FAILED):  # a settle, perhaps retried
                held = or_(held, and_(TrialRow.lease_owner.is_(None), TrialRow.status == status))
            where.append(held)
        with self.session() as s:
            if not s.execute(update(TrialRow).where(*where).values(**fields)).rowcount:
                return None
            return s.get(TrialRow, row_id)

    @retrying
    def acquire(self, row_id: int, owner: str, lease_s: float) -> Lease:
        """Take (or renew) the lease of trial row ``row_id`` for ``owner`` for ``lease_s``
        seconds, unless the trial is FINISHED, or another owner holds a lease that has not
        expired on this row or on any row of the same trial id in another experiment (that
        submission trains it). One short transaction under a lock on the trial id: of two
        claimers at once, in one experiment or in two, exactly one acquires."""
        with self.engine.begin() as conn:
            if conn.dialect.name == "sqlite" and conn.dialect.driver == "pysqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")  # the single writer, from the read on
            trial_hash = conn.execute(select(TrialRow.trial_hash)
                                      .where(TrialRow.id == row_id)).scalar_one()
            if conn.dialect.name == "postgresql":  # released when the transaction ends
                conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:h, 0))"),
                             {"h": trial_hash})
            rows = conn.execute(select(TrialRow.id, TrialRow.status, TrialRow.lease_owner,
                                       TrialRow.lease_expires_at)
                                .where(TrialRow.trial_hash == trial_hash)).all()
            row = next(r for r in rows if r.id == row_id)
            status = Status(row.status) if row.status else None
            now = utc_now()
            holder = next((r for r in sorted(rows, key=lambda r: r.id != row_id)
                           if r.lease_owner not in (None, owner)
                           and r.lease_expires_at is not None and r.lease_expires_at > now),
                          None)
            if status is Status.FINISHED or holder is not None:
                return Lease(False, status, holder and holder.lease_owner,
                             holder and holder.lease_expires_at)
            expires = now + dt.timedelta(seconds=lease_s)
            conn.execute(update(TrialRow).where(TrialRow.id == row_id).values(
                lease_owner=owner, heartbeat_at=now, lease_expires_at=expires))
            previous = row.lease_owner if row.lease_owner not in (None, owner) else None
            return Lease(True, status, owner, expires, previous)

    @retrying
    def import_finished(self, experiments: dict[str, tuple[str, str]],
                        trials: list[dict]) -> Imported:
        """Record finished trials from elsewhere (a result bundle), in one transaction.

        ``experiments`` maps each name to ``(workload, spec_yaml)``: a missing experiment is
        created with them, an existing one is left as it is. Each trial is a dict with
        ``experiment`` (a name of ``experiments``), ``trial_hash``, every field of
        ``IMPORTED_FIELDS`` (times naive UTC), ``source_experiment`` (the experiment that
        trained it, when it was settled from the trial cache; else None) and, optionally,
        ``mlflow_run_id`` and ``carried`` (JSON text kept in the row's ``carried`` column).
        A trial FINISHED in the ledger already is left as it is; an unfinished row under a
        live lease is left to its holder; any other row of the trial (PENDING, FAILED, a
        lease that expired) is settled FINISHED with the given fields, and a new one
        inserted so. A trial whose ``source_experiment`` has a trained FINISHED row of the
        same id points to it (``source_trial_id``). Importing the same trials again changes
        nothing.

        Raises:
            KeyError: a trial of an experiment that ``experiments`` does not name.
        """
        try:
            return self._import_finished(experiments, trials)
        except IntegrityError:  # a submission inserted one of these rows since we looked
            return self._import_finished(experiments, trials)

    def _import_finished(self, experiments: dict[str, tuple[str, str]],
                         trials: list[dict]) -> Imported:
        imported = present = held = 0
        now = utc_now()
        with self.session() as s:
            ids = {}
            for name, (workload, spec_yaml) in sorted(experiments.items()):
                row = s.scalar(select(ExperimentRow).where(ExperimentRow.name == name))
                if row is None:
                    row = ExperimentRow(name=name, workload=workload, spec_yaml=spec_yaml)
                    s.add(row)
                    s.flush()
                ids[name] = row.id
            rows = {(r.experiment_id, r.trial_hash): r for r in s.scalars(
                select(TrialRow).where(TrialRow.experiment_id.in_(list(ids.values()))))}
            # trained rows first: a cached trial's source may be among them
            for t in sorted(trials, key=lambda t: t.get("source_experiment") is not None):
                key = (ids[t["experiment"]], t["trial_hash"])
                row = rows.get(key)
                if row is not None and row.status == Status.FINISHED:
                    present += 1
                    continue
                if (row is not None and row.lease_owner is not None
                        and row.lease_expires_at is not None and row.lease_expires_at > now):
                    held += 1
                    continue
                fields = {k: t[k] for k in IMPORTED_FIELDS}
                if t.get("mlflow_run_id"):
                    fields["mlflow_run_id"] = t["mlflow_run_id"]
                fields["carried"] = t.get("carried")
                source = t.get("source_experiment")
                source_id = source and s.scalar(
                    select(TrialRow.id).join(ExperimentRow).where(
                        ExperimentRow.name == source, TrialRow.trial_hash == t["trial_hash"],
                        TrialRow.status == Status.FINISHED, TrialRow.source_trial_id.is_(None))
                    .limit(1))
                fields.update(status=Status.FINISHED, error=None, source_trial_id=source_id,
                              lease_owner=None, heartbeat_at=None, lease_expires_at=None)
                if row is None:
                    row = TrialRow(experiment_id=key[0], trial_hash=key[1], **fields)
                    s.add(row)
                    rows[key] = row
                else:
                    for k, v in fields.items():
                        setattr(row, k, v)
                s.flush()
                imported += 1
        return Imported(imported, present, held)

    @retrying
    def finished_copy(self, trial_hash: str, experiment_id: int) -> TrialRow | None:
        """The earliest FINISHED row of trial ``trial_hash`` in an experiment other than
        ``experiment_id`` that trained it there (not itself settled from the cache), or None."""
        with self.session() as s:
            return s.scalar(select(TrialRow).where(
                TrialRow.trial_hash == trial_hash, TrialRow.experiment_id != experiment_id,
                TrialRow.status == Status.FINISHED, TrialRow.source_trial_id.is_(None))
                .order_by(TrialRow.finished_at, TrialRow.id).limit(1))

    @retrying
    def finished_hashes(self, trial_hashes: set[str]) -> set[str]:
        """Those of ``trial_hashes`` with a FINISHED row in any experiment."""
        if not trial_hashes or not self._has_tables():
            return set()
        return {r.trial_hash for r in self._rows_of(trial_hashes, TrialRow.status
                                                    == Status.FINISHED)}

    @retrying
    def rows_of_trials(self, trial_hashes: set[str]) -> list[TrialRow]:
        """Every row, in any experiment, of the trials ``trial_hashes``."""
        return self._rows_of(trial_hashes)

    def _rows_of(self, trial_hashes: set[str], *where) -> list[TrialRow]:
        """The rows of ``trial_hashes`` (and ``where``), in queries of 500 ids: within any
        database's bound-parameter limit."""
        hashes = sorted(trial_hashes)
        with self.session() as s:
            return [r for i in range(0, len(hashes), 500) for r in s.scalars(
                select(TrialRow).where(TrialRow.trial_hash.in_(hashes[i:i + 500]), *where))]

    @retrying
    def renew(self, owner: str, lease_s: float) -> int:
        """Extend every lease ``owner`` holds by ``lease_s`` seconds from now (its heartbeat);
        returns how many it holds."""
        now = utc_now()
        with self.session() as s:
            return s.execute(update(TrialRow).where(TrialRow.lease_owner == owner).values(
                heartbeat_at=now, lease_expires_at=now + dt.timedelta(seconds=lease_s)),
            ).rowcount

    @retrying
    def release(self, owner: str) -> int:
        """Give up every lease ``owner`` still holds (a submission that stops with trials it
        claimed but never settled); returns how many."""
        with self.session() as s:
            return s.execute(update(TrialRow).where(TrialRow.lease_owner == owner).values(
                lease_owner=None, heartbeat_at=None, lease_expires_at=None)).rowcount
