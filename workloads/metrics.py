"""Buffered metric logging from a training worker straight to an MLflow run."""

from __future__ import annotations

import time


class MetricSink:
    """Buffers ``(key, value, step)`` metrics and sends them to MLflow run ``run_id`` on
    ``flush`` (``MlflowClient.log_batch`` splits them into batches MLflow accepts).

    A sink with no ``run_id`` (or on a non-zero rank) only discards: every rank can call it.
    Metrics go through the tracking server at ``tracking_uri``; nothing opens a store directly.
    """

    def __init__(self, tracking_uri: str | None, run_id: str | None, enabled: bool = True) -> None:
        self.run_id = run_id if enabled else None
        self._buffer: list = []
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

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._client is None:
            return
        now = int(time.time() * 1000)
        self._buffer.extend(self._metric(k, float(v), now, step) for k, v in metrics.items())

    def flush(self) -> None:
        if self._buffer and self._client is not None:
            self._client.log_batch(self.run_id, metrics=self._buffer)
            self._buffer = []
