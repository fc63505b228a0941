"""Metric logging from a training worker straight to an MLflow run: buffered, exactly once
across resumes, and through tracking-server outages without losing a point."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from workloads.core.reach import check_tracking
from workloads.runtime.environ import environ

log = logging.getLogger(__name__)

PENDING = "metrics-pending.jsonl"  # unsent points, inside a checkpoint directory
_CHUNK = 10_000  # points per log_batch call when sending spilled points
# One try per request, each at most this long: a server that dies between its health answer and
# the points must not hold the train loop in MLflow's own retries (exponential backoff, minutes).
_SEND_TIMEOUT_S = 30


class MetricSink:
    """Buffers ``(key, value, step)`` metrics and sends them to MLflow run ``run_id`` on
    ``flush`` (``MlflowClient.log_batch``, which splits them into batches MLflow accepts).

    - **Exactly once.** ``skip_logged`` reads, per metric key, the last step the run already
      has; later points at or below it are replays (the steps between a trial's checkpoint
      and its crash, computed again after the restart) and are dropped, so every step lands
      once, with no gap.
    - **Outages.** A flush first asks the server for ``/health`` (``probe_timeout_s``) and then
      sends with one try per request (no retries inside MLflow), so an outage, even one that
      starts during a send, costs the train loop a second, not MLflow's minutes of retries;
      the points stay:
      up to ``max_buffered`` in memory, the older ones spilled to a JSONL file in
      ``spill_dir``, all sent with their original timestamps once the server answers
      (``flush(deadline_s=...)`` retries until a deadline). A resend of points already stored
      adds nothing: MLflow keeps one row per (key, value, timestamp, step).
    - **Crashes during an outage.** ``write_pending`` puts the unsent points into a checkpoint
      directory, ``add_pending`` takes them back after a restore.

    A sink with no ``run_id`` (or on a non-zero rank) only discards: every rank can call it.
    Metrics go through the tracking server at ``tracking_uri``; nothing opens a store directly.
    """

    def __init__(self, tracking_uri: str | None, run_id: str | None, enabled: bool = True,
                 max_buffered: int = 100_000, spill_dir: str | os.PathLike | None = None,
                 probe_timeout_s: float = 1.0) -> None:
        self.run_id = run_id if enabled else None
        self.tracking_uri = tracking_uri or ""
        self.max_buffered, self.probe_timeout_s = max_buffered, probe_timeout_s
        self.replayed = 0  # points dropped by skip_logged's rule
        self._buffer: list = []
        self._last_step: dict[str, int] = {}
        self._spill = Path(spill_dir or tempfile.gettempdir()) / f"cemlab-metrics-{run_id}.jsonl"
        self._n_spilled = sum(1 for _ in self._spilled()) if self.run_id else 0
        self._client = None
        if self.run_id:
            # Imported here: workloads must import without mlflow.
            from mlflow import MlflowClient
            from mlflow.entities import Metric

            self._client, self._metric = MlflowClient(tracking_uri), Metric

    def tag(self, key: str, value: str) -> None:
        """Set tag ``key`` of the run now (unbuffered)."""
        if self._client is not None:
            self._client.set_tag(self.run_id, key, value)

    def skip_logged(self) -> int:
        """Read the last step the run has of each metric: points at or below it are not logged
        again (points a previous attempt spilled on this node count as logged: the next flush
        sends them). Returns the largest such step (0 for a fresh run)."""
        if self._client is None:
            return 0
        for key in self._client.get_run(self.run_id).data.metrics:
            steps = [m.step for m in self._client.get_metric_history(self.run_id, key)]
            self._last_step[key] = max(steps, default=0)
        for point in self._spilled():  # a previous attempt's, on this node: sent at next flush
            self._last_step[point["key"]] = max(self._last_step.get(point["key"], 0),
                                                point["step"])
        return max(self._last_step.values(), default=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._client is None:
            return
        now = int(time.time() * 1000)
        for k, v in metrics.items():
            if step <= self._last_step.get(k, -1):
                self.replayed += 1
            else:
                self._buffer.append(self._metric(k, float(v), now, step))
        if len(self._buffer) > self.max_buffered:
            self._spill_buffer()

    @property
    def pending(self) -> int:
        """Points not sent yet (in memory and spilled)."""
        return len(self._buffer) + self._n_spilled

    def flush(self, deadline_s: float = 0.0) -> bool:
        """Send every pending point, spilled ones first; True when none is left.

        With ``deadline_s`` 0, one try that gives up at once when the server does not answer
        its health check (the points stay pending); else tries every few seconds until
        ``deadline_s`` has passed.

        Raises:
            mlflow.exceptions.RestException: the server answered and refused the points (an
                HTTP 4xx other than 429): a bug to see, not an outage to wait out.
        """
        if self._client is None:
            return True
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                check_tracking(self.tracking_uri, timeout_s=self.probe_timeout_s)
                with _one_try():
                    self._send()
                return True
            except Exception as e:  # ServiceError, MlflowException, connection errors
                if _rejected(e):
                    raise
                if time.monotonic() >= deadline:
                    log.warning("[metrics] tracking server unavailable (%s): %d point(s) kept "
                                "for the next flush", str(e).splitlines()[0], self.pending)
                    return False
                time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))

    def write_pending(self, directory: str | os.PathLike) -> int:
        """Write every unsent point into ``directory/metrics-pending.jsonl`` (for a checkpoint);
        returns how many (no file for none)."""
        points = [*self._spilled(), *map(_as_dict, self._buffer)]
        if points:
            with open(Path(directory) / PENDING, "w") as f:
                f.writelines(json.dumps(p) + "\n" for p in points)
        return len(points)

    def add_pending(self, directory: str | os.PathLike) -> int:
        """Queue the points a checkpoint directory carries (``write_pending``), with their
        original timestamps and never dropped as replays; returns how many."""
        path = Path(directory) / PENDING
        if self._client is None or not path.exists():
            return 0
        points = [self._from_dict(p) for p in _read_jsonl(path)]
        self._buffer[:0] = points
        return len(points)

    def _send(self) -> None:
        batch = []
        for point in self._spilled():
            batch.append(self._from_dict(point))
            if len(batch) == _CHUNK:
                self._client.log_batch(self.run_id, metrics=batch)
                batch = []
        if batch:
            self._client.log_batch(self.run_id, metrics=batch)
        self._spill.unlink(missing_ok=True)
        self._n_spilled = 0
        if self._buffer:
            self._client.log_batch(self.run_id, metrics=self._buffer)
            self._buffer = []

    def _spill_buffer(self) -> None:
        self._spill.parent.mkdir(parents=True, exist_ok=True)
        with open(self._spill, "a") as f:
            f.writelines(json.dumps(_as_dict(m)) + "\n" for m in self._buffer)
        self._n_spilled += len(self._buffer)
        self._buffer = []

    def _spilled(self) -> Iterator[dict]:
        return _read_jsonl(self._spill) if self._spill.exists() else iter(())

    def _from_dict(self, p: dict):
        return self._metric(p["key"], p["value"], p["timestamp"], p["step"])


def _one_try():
    """MLflow's HTTP requests in this block: no retry, at most ``_SEND_TIMEOUT_S`` each (MLflow
    reads these settings from the environment on every request; the sink's caller, the train
    loop, makes no other MLflow request meanwhile)."""
    return environ({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": str(_SEND_TIMEOUT_S)})


def _rejected(e: Exception) -> bool:
    """Whether the tracking server answered ``e`` as a refusal of the request itself."""
    from mlflow.exceptions import RestException

    return isinstance(e, RestException) and 400 <= e.get_http_status_code() < 500 \
        and e.get_http_status_code() != 429


def _as_dict(m) -> dict:
    return {"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}


def _read_jsonl(path: Path) -> Iterable[dict]:
    with open(path) as f:
        yield from (json.loads(line) for line in f if line.strip())
