"""Metrics against a real MLflow server: every step exactly once across a resume, no point lost
through an outage (the server stopped and started again), none through a crash during one."""

import contextlib
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import RestException

from tests.conftest import free_port
from workloads.runtime.metrics import PENDING, MetricSink

pytestmark = pytest.mark.slow  # a real MLflow server, stopped and started again

# A flush to a server that is up: on busy cores its one-second health probe can go unanswered,
# so these retry until it answers (seconds), where a flush during an outage gives up at once.
LIVE = 60.0


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 over a SQLite store in ``home``; stop and start it again
    on the same port (an outage)."""

    def __init__(self, home: Path) -> None:
        self.home, self.port, self.proc = home, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        mlflow = Path(sys.executable).parent / "mlflow"
        self.proc = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.home}/mlflow.db",
             "--artifacts-destination", str(self.home / "artifacts")],
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # as up.sh runs it
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    raise RuntimeError(f"mlflow server on port {self.port} did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to the server's process group (mlflow runs uvicorn in a child), SIGKILL
        after 30 s; returns once the port is closed."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a child the parent left behind


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def new_run(server: MlflowServer) -> str:
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("metrics")
    exp_id = exp.experiment_id if exp else client.create_experiment("metrics")
    return client.create_run(exp_id).info.run_id


def steps_of(server: MlflowServer, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in MlflowClient(server.uri).get_metric_history(run_id, key))


def test_a_restarted_trial_logs_every_step_exactly_once(server, tmp_path):
    run_id = new_run(server)
    first = MetricSink(server.uri, run_id, spill_dir=tmp_path)
    assert first.skip_logged() == 0
    for step in range(1, 31):  # checkpoint at 20; flushed up to 25; crash at 30
        first.log({"loss": 1.0 / step}, step)
        if step % 5 == 0 and step <= 25:
            assert first.flush(deadline_s=LIVE)
    second = MetricSink(server.uri, run_id, spill_dir=tmp_path)  # resumes from step 20
    assert second.skip_logged() == 25
    for step in range(21, 41):
        second.log({"loss": 2.0 / step}, step)
    assert second.flush(deadline_s=LIVE)
    assert second.replayed == 5
    assert steps_of(server, run_id) == list(range(1, 41))  # no gap, no duplicate
    history = {m.step: m.value for m in MlflowClient(server.uri).get_metric_history(run_id,
                                                                                     "loss")}
    assert history[25] == 1.0 / 25 and history[26] == 2.0 / 26


def test_an_outage_loses_no_point_and_spills_what_memory_does_not_hold(server, tmp_path):
    run_id = new_run(server)
    sink = MetricSink(server.uri, run_id, max_buffered=16, spill_dir=tmp_path)
    for step in range(1, 11):
        sink.log({"loss": float(step), "lr": 0.1}, step)
    assert sink.flush(deadline_s=LIVE)
    server.stop()  # the outage: training goes on, flushes give up at once
    for step in range(11, 61):
        sink.log({"loss": float(step), "lr": 0.1}, step)
        if step % 5 == 0:
            assert not sink.flush()
    assert sink.pending == 100
    spill = tmp_path / f"cemlab-metrics-{run_id}.jsonl"
    assert spill.exists() and len(spill.read_text().splitlines()) >= 100 - 16
    server.start()
    assert sink.flush(deadline_s=LIVE)
    assert sink.pending == 0 and not spill.exists()
    assert steps_of(server, run_id) == list(range(1, 61))
    assert steps_of(server, run_id, "lr") == list(range(1, 61))


class HealthOnly(socketserver.ThreadingTCPServer):
    """A server on ``port`` that answers ``GET /health`` and drops every other request
    unanswered: the tracking server as it dies between its health answer and the points."""

    allow_reuse_address = daemon_threads = True

    def __init__(self, port: int) -> None:
        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                if self.rfile.readline().startswith(b"GET /health "):
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
                                     b"Connection: close\r\n\r\nOK")

        super().__init__(("127.0.0.1", port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_a_server_that_dies_during_a_send_costs_one_try_not_mlflows_retries(server, tmp_path):
    run_id = new_run(server)
    sink = MetricSink(server.uri, run_id, spill_dir=tmp_path)
    server.stop()
    with HealthOnly(server.port) as dying:
        sink.log({"loss": 1.0}, 1)
        started = time.monotonic()
        assert not sink.flush()  # healthy at the probe, gone at the send
        # MLflow's default (7 retries, backoff factor 2) waits minutes before it gives up.
        assert time.monotonic() - started < 20
        dying.shutdown()
    assert sink.pending == 1
    server.start()
    assert sink.flush(deadline_s=LIVE) and steps_of(server, run_id) == [1]


def test_points_kept_in_a_checkpoint_reach_the_run_once_after_a_crash(server, tmp_path):
    run_id = new_run(server)
    sink = MetricSink(server.uri, run_id, spill_dir=tmp_path / "node-a")
    for step in range(1, 6):
        sink.log({"loss": float(step)}, step)
    assert sink.flush(deadline_s=LIVE)
    server.stop()
    for step in range(6, 11):
        sink.log({"loss": float(step)}, step)
    assert not sink.flush()
    (tmp_path / "ckpt").mkdir()
    assert sink.write_pending(tmp_path / "ckpt") == 5  # checkpoint at step 10; then a crash
    assert len((tmp_path / "ckpt" / PENDING).read_text().splitlines()) == 5
    server.start()
    restarted = MetricSink(server.uri, run_id, spill_dir=tmp_path / "node-b")  # another node
    assert restarted.skip_logged() == 5
    assert restarted.add_pending(tmp_path / "ckpt") == 5
    for step in range(11, 16):
        restarted.log({"loss": float(step)}, step)
    assert restarted.flush(deadline_s=LIVE)
    assert steps_of(server, run_id) == list(range(1, 16))
    # A resend of points the run already has (a flush whose answer was lost) adds nothing.
    again = MetricSink(server.uri, run_id, spill_dir=tmp_path / "node-c")
    assert again.add_pending(tmp_path / "ckpt") == 5
    assert again.flush(deadline_s=LIVE)
    assert steps_of(server, run_id) == list(range(1, 16))


def test_a_refused_flush_is_an_error_not_an_outage(server, tmp_path):
    sink = MetricSink(server.uri, "0" * 32, spill_dir=tmp_path)  # no such run: HTTP 404
    sink.log({"loss": 1.0}, 1)
    with pytest.raises(RestException, match="RESOURCE_DOES_NOT_EXIST"):
        sink.flush(deadline_s=60)
