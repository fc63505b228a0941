"""Shared fixtures: small real corpora written to disk."""

import os
import random
from contextlib import contextmanager
from pathlib import Path

import pytest

# pytest-xdist (make test) runs the tests that start a Ray cluster (but one, below) in one group
# (RAY_CLUSTER), in one process, one test at a time, while the other process runs the rest: two
# clusters side by side at full speed would share the two cores and each Ray test would take two
# to three times as long. Those of test_end_to_end.py share one local stack; the others (the
# two-host rehearsal, Ray Data) start a cluster of their own. Still, a test acts on its own
# cluster's processes only (a fault test kills a worker of its stack's process tree), never on
# the host's, and each stack keeps a Ray temp dir of its own (infra/local/up.sh), so a study or a
# demo beside the suite is left alone.
# The dashboard tests share one seeded store and one imported study, made once in the process
# that runs them.
RAY_CLUSTER = pytest.mark.xdist_group("ray-cluster")
DASHBOARD_STORE = pytest.mark.xdist_group("dashboard-store")
# The Ray group sets the suite's wall: its tests are chains of process starts, one after
# another, that use about one core of two. A process that runs the other tests yields the CPU
# to it and fills what is left: nice 19, inherited by the servers and trainings those tests
# start, below Ray's workers (the raylet starts them at nice 15, RAY_worker_niceness), which
# a process at nice 0 or 10 takes most of the CPU from. The S3 and PostgreSQL stack's grid
# (test_storage_end_to_end.py) runs there too, at nice 19 with its own cluster: where the Ray
# group would otherwise end minutes after the other process, it fills cores left idle. Run
# alone, in one process (TEST_WORKERS=0), nothing is reniced.
BACKGROUND_NICE = 19


def pytest_runtest_setup(item: pytest.Item) -> None:
    group = item.get_closest_marker("xdist_group")
    if os.environ.get("PYTEST_XDIST_WORKER") and not (group and group.args == RAY_CLUSTER.args):
        os.nice(BACKGROUND_NICE - os.nice(0))  # nothing once the process is there

WORDS = ("the king queen crown sword night day love death honour speak hear thou thee my lord "
         "lady fair foul sweet bitter cold warm house field river stone ship sea").split()


def write_corpus(directory: Path, n_docs: int = 12, words_per_doc: int = 4000,
                 seed: int = 0) -> str:
    """``n_docs`` text files of pseudo-English (a skewed word distribution); returns a glob."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(WORDS))]
    directory.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        lines = []
        for _ in range(words_per_doc // 10):
            lines.append(" ".join(rng.choices(WORDS, weights, k=10)) + ".")
        (directory / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
    return str(directory / "*.txt")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def corpus_glob(tmp_path: Path) -> str:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API server (moto) on 127.0.0.1, with test credentials in the environment;
    yields its endpoint URL. Buckets are made per test (``s3_bucket``)."""
    import os

    from moto.server import ThreadedMotoServer

    os.environ.update(AWS_ACCESS_KEY_ID="cemlab-test", AWS_SECRET_ACCESS_KEY="cemlab-test",
                      AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request) -> str:
    """A fresh, empty bucket on ``s3_server``; returns its name."""
    import uuid

    import boto3

    name = f"cemlab-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


PG_SERVER = os.environ.get("CEMLAB_TEST_POSTGRES",
                           "postgresql+psycopg2://postgres@127.0.0.1:5432")


@contextmanager
def postgres_database():
    """A database of its own on this machine's PostgreSQL (``CEMLAB_TEST_POSTGRES``, default
    127.0.0.1:5432), dropped on exit; yields its SQLAlchemy URL. Skips where no server
    answers."""
    import uuid

    import sqlalchemy as sa

    admin = sa.create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT",
                             connect_args={"connect_timeout": 5})
    name = f"cemlab_test_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as c:
            c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as e:
        pytest.skip(f"no PostgreSQL at {PG_SERVER} ({str(e.orig).strip().splitlines()[0]})")
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def postgres_db():
    """``postgres_database`` for the whole test run."""
    with postgres_database() as url:
        yield url


@pytest.fixture(scope="session")
def postgres_with_password():
    """A PostgreSQL server of its own (initdb into a temporary directory, scram-sha-256 password
    authentication, a free port on 127.0.0.1), stopped and removed after; yields
    ``(host, port, user, password)``. Skips where PostgreSQL's server binaries are absent."""
    import glob
    import shutil
    import subprocess
    import tempfile

    bindirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    bindir = bindirs[-1] if bindirs else os.path.dirname(shutil.which("initdb") or "")
    if not bindir:
        pytest.skip("no PostgreSQL server binaries (initdb)")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    base = tempfile.mkdtemp(prefix="cemlab-pg-")
    os.chmod(base, 0o755)
    user, password = "cemlab", "s3cret-never-printed"
    (Path(base) / "pw").write_text(password + "\n")
    if as_user:
        shutil.chown(base, "postgres")
        shutil.chown(Path(base) / "pw", "postgres")
    port = free_port()
    data = f"{base}/data"
    subprocess.run([*as_user, f"{bindir}/initdb", "-D", data, "-U", user, "--auth=scram-sha-256",
                    f"--pwfile={base}/pw"], check=True, capture_output=True, timeout=120)
    subprocess.run([*as_user, f"{bindir}/pg_ctl", "-D", data, "-w", "-l", f"{base}/log", "-o",
                    f"-c listen_addresses=127.0.0.1 -p {port} -k {base}", "start"],
                   check=True, capture_output=True, timeout=120)
    try:
        yield "127.0.0.1", port, user, password
    finally:
        subprocess.run([*as_user, f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


class PrivatePostgres:
    """A PostgreSQL server of the test's own (initdb into a temporary directory, trust auth, on
    127.0.0.1 at a free port), which the test may stop and start again: a real outage of a
    real database, and nobody else's server touched. As root the server runs as ``postgres``
    (it refuses root)."""

    def __init__(self, directory: Path) -> None:
        import glob
        import shutil
        import subprocess

        bindir = next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)), None)
        initdb = shutil.which("initdb") or (bindir and f"{bindir}/initdb")
        if not initdb or not Path(initdb).exists():
            pytest.skip("no PostgreSQL server binaries (initdb) on this machine")
        self.pg_ctl = str(Path(initdb).resolve().parent / "pg_ctl")
        self.user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        directory.mkdir(parents=True, exist_ok=True)
        if self.user:
            shutil.chown(directory, "postgres")
        self.data, self.port = directory / "data", free_port()
        subprocess.run([*self.user, initdb, "-D", str(self.data), "-A", "trust", "-U",
                        "postgres"], check=True, capture_output=True, timeout=120)
        self.options = f"-p {self.port} -k {directory} -c listen_addresses=127.0.0.1"
        self.log = directory / "server.log"
        self.url = f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        import subprocess

        subprocess.run([*self.user, self.pg_ctl, "-D", str(self.data), "-w", *args],
                       check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._ctl("-o", self.options, "-l", str(self.log), "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")


@pytest.fixture
def private_postgres():
    import shutil
    import subprocess
    import tempfile

    # Not under pytest's tmp_path: its parents are root's alone, and the server runs as postgres.
    directory = Path(tempfile.mkdtemp(prefix="cemlab-pg-"))
    try:
        server = PrivatePostgres(directory)
        server.start()
        yield server
        try:
            server.stop()
        except subprocess.CalledProcessError:
            pass  # the test left it stopped
    finally:
        shutil.rmtree(directory, ignore_errors=True)
