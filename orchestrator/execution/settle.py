"""Settling a pack's trials as its workers report them (``SettleTrials``), and recording a
trial's status in the ledger with its MLflow run following (``record``).

Ray Train ships a run's ``RunConfig``, callbacks included, to its controller and to every one of
its workers, and each unpickles ``SettleTrials``, so each imports this module. Only the controller
runs it: MLflow and the ledger (SQLAlchemy) are imported in the functions that use them, not
here, so unpickling it costs a worker neither (about 2 s of a core and 22 MiB; rank 0 still
imports MLflow for its metrics).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from ray.train import UserCallback

from orchestrator.execution.packs import Pack, Task
from workloads.core import pack as pack_protocol

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from orchestrator.records.ledger import Ledger, Status


def record(ledger: Ledger, client: MlflowClient, row_id: int, run_id: str, status: Status,
           *, owner: str | None = None, **fields) -> bool:
    """Set a trial's status (and ``fields``) in the ledger, then make its MLflow run follow;
    with ``owner``, only while ``owner`` holds the trial's lease. Returns whether it did."""
    from orchestrator.records import tracking

    if ledger.update_trial(row_id, owner=owner, status=status, **fields) is None:
        return False
    tracking.mirror_status(client, run_id, status)
    return True


@functools.cache
def ledger_for(url: str) -> Ledger:
    """One ``Ledger`` (one connection pool) per URL in a driver's or controller's process:
    Tune reuses a driver's process for the next pack (``reuse_actors``)."""
    from orchestrator.records.ledger import Ledger

    return Ledger(url)


def record_task(task: Task, status: Status, **fields) -> bool:
    """``record`` ``task``'s status (and ``fields``) under its submission's lease."""
    from mlflow import MlflowClient

    return record(ledger_for(task.ledger_url), MlflowClient(task.job.tracking_uri), task.row_id,
                  task.job.run_id, status, owner=task.owner, **fields)


class SettleTrials(UserCallback):
    """In a pack's Ray Train controller (on its driver's node): each trial RUNNING when its
    workers report its start, its run directory recorded at its first checkpoint there (where a
    later submission resumes it from), FINISHED (metrics, final checkpoint, then its time split
    in MLflow) when they report its final checkpoint (``workloads.core.pack``), under its
    submission's lease, once: a trial reported again after a restart of the worker group is
    not settled twice. It lives in the controller's process, so it tells the driver nothing:
    the ledger does. A ledger or MLflow error is printed, not raised: raised, it would fail the
    controller and with it the pack's other trials."""

    def __init__(self, pack: Pack) -> None:
        self.pack = pack
        self.tasks = {t.trial_id: t for t in pack.tasks}
        self.started: dict[str, float] = {}  # when each trial's clock started, UNIX seconds
        self.checkpointed: set[str] = set()  # trials with a checkpoint in this run
        self.settled: set[str] = set()

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        from orchestrator.records.ledger import Status

        reported = metrics[0]
        task = self.tasks.get(reported.get(pack_protocol.TRIAL))
        if task is None or task.trial_id in self.settled:
            return
        try:
            if pack_protocol.STARTED_AT in reported:
                self.started.setdefault(task.trial_id, reported[pack_protocol.STARTED_AT])
                if not record_task(task, Status.RUNNING):
                    print(f"[cemlab] {task.label}: another submission holds its lease now",
                          flush=True)
            elif pack_protocol.FINAL in reported:
                self.settle(task, reported, checkpoint.path if checkpoint
                            else reported[pack_protocol.CHECKPOINT])
            elif checkpoint and task.trial_id not in self.checkpointed:
                self.checkpointed.add(task.trial_id)
                ledger_for(task.ledger_url).update_trial(task.row_id, owner=task.owner,
                                                         checkpoint_path=self.pack.uri())
        except Exception as e:  # the ledger or MLflow: the trial settles on a later report
            print(f"[cemlab] {task.label}: could not record its report ({type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''})", flush=True)

    def settle(self, task: Task, reported: dict, checkpoint_path: str) -> None:
        """Record ``task`` FINISHED with ``reported``'s metrics and its final checkpoint, then
        its time split when this run started it."""
        from mlflow import MlflowClient

        from orchestrator.records import tracking
        from orchestrator.records.ledger import Status

        workload = task.workload
        if not record_task(task, Status.FINISHED, metric=reported[workload.metric],
                           val_metric=reported[workload.selection_metric], error=None,
                           checkpoint_path=_uri(task, checkpoint_path)):
            print(f"[cemlab] {task.label}: finished, but another submission took its lease "
                  "over meanwhile: that one records it", flush=True)
            return
        self.settled.add(task.trial_id)
        print(f"[cemlab] {task.label}: FINISHED ({workload.metric} "
              f"{reported[workload.metric]:.4g})", flush=True)
        started = self.started.get(task.trial_id)
        if started is not None:
            tracking.log_timing(MlflowClient(task.job.tracking_uri), task.job.run_id,
                                tracking.breakdown(reported, started, time.time(),
                                                   task.queued_at, task.submitted_at))


def _uri(task: Task, path: str) -> str:
    """The URI of ``path`` (a path on the storage root's filesystem, under the root)."""
    return task.storage.uri_of(path.removeprefix(task.storage.root).strip("/"))
