"""Ray Tune over a grid of trials, each trial one Ray Train run (``TorchTrainer``).

Tune runs ``trial_driver`` once per trial; the driver starts the trial's ``TorchTrainer`` with
its workload's ``train_loop_per_worker`` bound to the job (the typed ``Job`` and the workload are
all that cross to the workers) and
records the outcome in the ledger, which MLflow then follows (``record``); a failure is recorded by
the submission itself (``SettleFailures``), and every record only under the trial's lease. The
Train run is named after the trial hash under ``ray_results/trials/<experiment>`` of the storage
root (a local path, or ``s3://...`` that every node reaches): launching the same trial of the same
experiment again makes Ray Train restore its checkpoint manager, so the workers resume from the
last checkpoint, as they do within a submission when a worker or its node dies
(``resources.max_failures``). Ray Train keeps a trial's last two checkpoints: the previous one is
the fallback when the latest does not verify (``workloads.runtime.checkpoints``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.tune
from mlflow import MlflowClient
from ray.train import CheckpointConfig, ControllerError, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback

from orchestrator import tracking
from orchestrator.ledger import Ledger, Status
from workloads.core.config import TRIAL_ACTORS_GB
from workloads.core.storage import StorageRoot
from workloads.core.trial import Job
from workloads.core.workload import Workload

_TRIALS = ("ray_results", "trials")  # Ray Train runs under the storage root, by experiment
_TUNE = ("ray_results", "tune")  # Ray Tune's experiment state, one directory per submission
# Ray Train settings every trial's controller and workers get (Ray Train propagates them from
# the trial's driver), unless the environment already sets them: the controller polls its
# workers every 0.5 s instead of 2 s, so that a trial's end is seen at once, and no preemption
# watcher actor is started per worker group (it only logs spot-instance notices; a preempted
# node's trial resumes from its checkpoint either way, max_failures).
PLACEMENT_GROUP_REMOVED = "since its placement group was removed"  # Ray's worker exit detail
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
                 "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def driver_resources() -> dict[str, float]:
    """What Tune reserves for one ``trial_driver``: no CPU (it only waits on its Train run,
    whose workers hold the CPUs/GPUs), the host memory of the trial's actors other than its
    workers (``TRIAL_ACTORS_GB``), on this node, the one that submitted the grid, so the ledger
    URL and MLflow client it uses never leave this host."""
    return {"CPU": 0, "memory": TRIAL_ACTORS_GB * 2**30,
            f"node:{ray.util.get_node_ip_address()}": 0.001}


@dataclass(frozen=True)
class Task:
    """One pending trial of experiment ``experiment`` for ``trial_driver``: its ``Job``, the
    ``Workload`` that trains it, its ledger row, where the ledger is, the storage root its
    checkpoints go to (the same trial in two experiments keeps two runs: each resumes only its own),
    and the lease it is trained under (``owner``, renewed for ``lease_s`` seconds); when its
    submission started (``submitted_at``) and handed it to Ray Tune (``queued_at``), UNIX
    seconds."""

    job: Job
    workload: Workload
    experiment: str
    row_id: int
    ledger_url: str
    storage: StorageRoot
    owner: str
    lease_s: float
    submitted_at: float | None = None
    queued_at: float | None = None

    @property
    def name(self) -> str:
        return f"trial-{self.job.trial.trial_id}"

    def uri(self, *parts: str) -> str:
        """URI of ``parts`` under this trial's Ray Train run directory."""
        return self.storage.uri_of(*_TRIALS, self.experiment, self.name, *parts)


def ray_storage(storage: StorageRoot, *parts: str) -> dict:
    """``RunConfig`` keywords that put a run under ``parts`` of the storage root."""
    fs, _ = storage.filesystem()
    return {"storage_path": storage.path(*parts),
            "storage_filesystem": fs if storage.is_remote else None}


def record(ledger: Ledger, client: MlflowClient, row_id: int, run_id: str, status: Status,
           *, owner: str | None = None, **fields) -> bool:
    """Set a trial's status (and ``fields``) in the ledger, then make its MLflow run follow;
    with ``owner``, only while ``owner`` holds the trial's lease. Returns whether it did."""
    if ledger.update_trial(row_id, owner=owner, status=status, **fields) is None:
        return False
    tracking.mirror_status(client, run_id, status)
    return True


@functools.cache
def _ledger(url: str) -> Ledger:
    """One ``Ledger`` (one connection pool) per URL in a trial driver's process: Tune reuses the
    process for the next trial (``reuse_actors``)."""
    return Ledger(url)


def _trainer(task: Task, job: Job) -> TorchTrainer:
    r = job.trial.resources
    return TorchTrainer(
        functools.partial(task.workload.train_loop_per_worker, job),
        scaling_config=ScalingConfig(num_workers=r.num_workers, use_gpu=r.use_gpu,
                                     resources_per_worker={
                                         "CPU": r.cpus_per_worker,
                                         "memory": r.memory_per_worker_gb * 2**30},
                                     placement_strategy=r.placement_strategy),
        run_config=RunConfig(name=task.name,
                             **ray_storage(task.storage, *_TRIALS, task.experiment),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(max_failures=r.max_failures),
                             callbacks=[TuneReportCallback()]))


def fit(task: Task, job: Job) -> ray.train.Result:
    """Run ``job``'s Ray Train run (``TorchTrainer``) to its end and return its result.

    A run whose worker group dies while it starts because Ray removed its placement group is
    started again (it resumes from its last checkpoint), up to ``resources.max_failures``
    times (-1: always). Ray Train's ``PlacementGroupCleaner`` takes a State API query that
    finds no controller for a dead controller and removes the live run's placement group;
    Ray Train retries worker failures (``FailureConfig.max_failures``), not this controller
    error.

    Raises:
        ray.train.TrainingFailedError: the run failed otherwise, or more often than allowed.
    """
    limit = job.trial.resources.max_failures
    restarts = 0
    while True:
        try:
            return _trainer(task, job).fit()
        except ControllerError as e:
            if PLACEMENT_GROUP_REMOVED not in str(e) or restarts == limit:
                raise
            restarts += 1
            print(f"[cemlab] {job.trial.label}: Ray removed its placement group while its "
                  f"workers started; starting it again (restart {restarts})", flush=True)


def trial_driver(config: dict[str, str], tasks: dict[str, Task]) -> None:
    """Tune trainable: train ``tasks[config["trial_id"]]`` with Ray Train, recording it in the
    ledger (and so in MLflow) as RUNNING, then FINISHED, while its submission holds the trial's
    lease. A failure is raised to Tune, whose ``SettleFailures`` in the submission records it:
    a driver whose submission died records nothing, so its lease lapses and the trial is taken
    over (and resumed) by the next submission.

    Raises:
        ray.train.TrainingFailedError: the Train run failed.
    """
    task = tasks[config["trial_id"]]
    job = task.job
    ledger, client = _ledger(task.ledger_url), MlflowClient(job.tracking_uri)
    lease = ledger.acquire(task.row_id, task.owner, task.lease_s)
    if not (lease.acquired and record(ledger, client, task.row_id, job.run_id, Status.RUNNING,
                                      owner=task.owner, checkpoint_path=task.uri())):
        # lost while it waited for a slot (a heartbeat-less lapse)
        print(f"[cemlab] {job.trial.label}: another submission holds its lease now: not "
              "trained here", flush=True)
        return
    for name, value in RAY_TRAIN_ENV.items():
        os.environ.setdefault(name, value)
    job = dataclasses.replace(job, submitted_at=time.time())  # time/startup_s starts here
    result = fit(task, job)
    tracking.log_timing(client, job.run_id, tracking.breakdown(
        result.metrics, job.submitted_at, time.time(), task.queued_at, task.submitted_at))
    workload = task.workload
    if not record(ledger, client, task.row_id, job.run_id, Status.FINISHED, owner=task.owner,
                  metric=result.metrics[workload.metric],
                  val_metric=result.metrics[workload.selection_metric], error=None,
                  checkpoint_path=task.uri(result.checkpoint.path.rsplit("/", 1)[-1])
                  if result.checkpoint else None):
        print(f"[cemlab] {job.trial.label}: finished, but another submission took its lease "
              "over meanwhile: that one records it", flush=True)


def failure_text(error_txt: str) -> str:
    """What a failed Tune trial's driver raised, as ``<type>: <message>``, from the text of
    Tune's ``error.txt``: a header and the driver actor's title, the driver's stack (indented
    lines), then its exception from the first unindented line on
    (``ray.train.WorkerGroupError: ...``). The whole text when it has no stack."""
    lines = error_txt.strip().splitlines()
    stack = next((i for i, line in enumerate(lines) if line[:1].isspace()), len(lines))
    start = next((i for i in range(stack, len(lines)) if lines[i] and not lines[i][0].isspace()),
                 None)
    if start is None:
        return error_txt.strip()
    kind, colon, message = lines[start].partition(": ")
    head = f"{kind.rsplit('.', 1)[-1]}{colon}{message}"  # WorkerGroupError: ...
    return "\n".join([head, *lines[start + 1:]])


class SettleFailures(ray.tune.Callback):
    """In the submission, while Tune runs the grid: a trial whose driver failed (its Train run
    failed, or its driver's actor died) is recorded FAILED with what it raised, under the
    submission's lease."""

    def __init__(self, tasks: dict[str, Task]) -> None:
        self.tasks = tasks

    def __getstate__(self) -> dict:
        """Tune pickles its callbacks into the storage root (``tuner.pkl``): not the tasks,
        whose ledger URL may hold a password. Nothing restores this callback from there."""
        return {"tasks": {}}

    def on_trial_error(self, iteration: int, trials: list, trial: ray.tune.experiment.Trial,
                       **info) -> None:
        task = self.tasks[trial.config["trial_id"]]
        written = trial.error_file and Path(trial.error_file)  # Tune's, on this node, just now
        error = (written and written.exists() and failure_text(written.read_text())
                 or "its trial driver failed (Tune kept no error text)")
        if len(error) > 4000:  # the exception's first line, and the end of its message
            error = f"{error[:1000]}\n[...]\n{error[-3000:]}"
        if record(_ledger(task.ledger_url), MlflowClient(task.job.tracking_uri), task.row_id,
                  task.job.run_id, Status.FAILED, owner=task.owner, error=error):
            print(f"[cemlab] {task.job.trial.label}: FAILED ({error.splitlines()[0]})",
                  flush=True)


def run_grid(name: str, tasks: list[Task], storage: StorageRoot, concurrency: int,
             submitted_at: float | None = None) -> None:
    """Run ``tasks`` of the submission started at ``submitted_at`` (UNIX seconds) with Ray Tune,
    ``concurrency`` at once; each outcome lands in the ledger and MLflow."""
    queued_at = time.time()
    by_id = {t.job.trial.trial_id: dataclasses.replace(t, submitted_at=submitted_at,
                                                       queued_at=queued_at) for t in tasks}
    # Tune pickles its search state, name creator included, into the storage root: the creator
    # sees the labels only, never a Task (whose ledger URL may hold a password).
    labels = {i: t.job.trial.label.replace(" ", "_") for i, t in by_id.items()}
    print(f"[cemlab] Ray Tune: {len(tasks)} trial(s), up to {concurrency} at once", flush=True)
    tuner = ray.tune.Tuner(
        ray.tune.with_resources(ray.tune.with_parameters(trial_driver, tasks=by_id),
                                driver_resources()),
        param_space={"trial_id": ray.tune.grid_search(list(by_id))},
        tune_config=ray.tune.TuneConfig(
            max_concurrent_trials=concurrency,
            reuse_actors=True,
            trial_name_creator=lambda t: labels[t.config["trial_id"]],
        ),
        run_config=ray.tune.RunConfig(name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
                                      **ray_storage(storage, *_TUNE), verbose=1,
                                      callbacks=[SettleFailures(by_id)]))
    tuner.fit()
