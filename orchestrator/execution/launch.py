"""Ray Tune over a grid of trials, trained in packs: each pack one Ray Train run (``TorchTrainer``)
whose worker group trains the pack's same-shaped trials in turn.

``packs`` (``orchestrator.execution.packs``) groups the trials by shape (resources; on GPUs also the
model, whose compile cache then stays warm) and splits each group into as many packs as run at
once, balanced by FLOPs (``resources.reuse_workers: false``: a pack per trial). Tune runs
``pack_driver`` once per pack; the driver starts the pack's ``TorchTrainer`` with its workload's
``train_loop_per_worker`` bound to the jobs (the typed ``Job`` s and the workload are all the
train function carries). Its Train controller, on the driver's node, settles each trial as the
workers report it (``SettleTrials``, ``orchestrator.execution.settle``: Ray Train unpickles it in
every worker too, so it imports neither MLflow nor the ledger until the controller uses them):
RUNNING when it starts, FINISHED with its metrics, checkpoint and time split when its final
checkpoint is in; the ledger decides, MLflow follows (``record``), only under the trial's
lease. A trial whose Train run fails is recorded FAILED by the driver, which starts the trials
after it in a new run; a driver that dies is settled by its submission (``SettleFailures``).

The Train run is named after its trials under ``ray_results/trials/<experiment>`` of the storage
root (a local path, or ``s3://...`` that every node reaches). A worker group that restarts
(``resources.max_failures``, a worker or its node died) resumes each trial from its own newest
checkpoint that verifies; a trial resubmitted later also looks in the run that trained it before
(the ledger's ``checkpoint_path``). Ray Train keeps each trial's final checkpoint and the two
newest others (``workloads.core.pack``): the previous one is the fallback when the latest does
not verify (``workloads.runtime.checkpoints``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path

import ray
import ray.tune
from ray.train import (
    CheckpointConfig,
    ControllerError,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from ray.train.torch import TorchTrainer

from orchestrator.execution.packs import TRIALS_DIR, Pack, Task, packs
from orchestrator.execution.settle import SettleTrials, ledger_for, record_task
from orchestrator.records.ledger import Status
from workloads.core import pack as pack_protocol
from workloads.core.config import TRIAL_ACTORS_GB
from workloads.core.storage import StorageRoot

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
    """What Tune reserves for one ``pack_driver``: no CPU (it only waits on its Train run,
    whose workers hold the CPUs/GPUs), the host memory of the trial's actors other than its
    workers (``TRIAL_ACTORS_GB``), on this node, the one that submitted the grid, so the ledger
    URL and MLflow client it uses never leave this host."""
    return {"CPU": 0, "memory": TRIAL_ACTORS_GB * 2**30,
            f"node:{ray.util.get_node_ip_address()}": 0.001}


def ray_storage(storage: StorageRoot, *parts: str) -> dict:
    """``RunConfig`` keywords that put a run under ``parts`` of the storage root."""
    fs, _ = storage.filesystem()
    return {"storage_path": storage.path(*parts),
            "storage_filesystem": fs if storage.is_remote else None}


def _trainer(pack: Pack, settle: SettleTrials) -> TorchTrainer:
    r = pack.tasks[0].job.trial.resources
    head = pack.tasks[0]
    return TorchTrainer(
        functools.partial(head.workload.train_loop_per_worker, [t.job for t in pack.tasks],
                          pack.sizes),
        scaling_config=ScalingConfig(num_workers=r.num_workers, use_gpu=r.use_gpu,
                                     resources_per_worker={
                                         "CPU": r.cpus_per_worker,
                                         "memory": r.memory_per_worker_gb * 2**30},
                                     placement_strategy=r.placement_strategy),
        run_config=RunConfig(name=pack.name,
                             **ray_storage(head.storage, *TRIALS_DIR, head.experiment),
                             checkpoint_config=CheckpointConfig(
                                 num_to_keep=pack_protocol.num_to_keep(
                                     len(pack.tasks), pack.largest_stack),
                                 checkpoint_score_attribute=pack_protocol.KEEP,
                                 checkpoint_score_order="max"),
                             failure_config=FailureConfig(max_failures=r.max_failures),
                             # SettleTrials records each trial in the ledger and MLflow; Ray's
                             # TuneReportCallback is left out: a queue actor (a process) per
                             # pack, for metrics that nothing reads from Tune
                             callbacks=[settle]))


def fit(pack: Pack, settle: SettleTrials) -> ray.train.Result:
    """Run ``pack``'s Ray Train run (``TorchTrainer``) to its end and return its result.

    A run whose worker group dies while it starts because Ray removed its placement group is
    started again (each trial resumes from its last checkpoint), up to
    ``resources.max_failures`` times (-1: always). Ray Train's ``PlacementGroupCleaner`` takes a
    State API query that finds no controller for a dead controller and removes the live run's
    placement group; Ray Train retries worker failures (``FailureConfig.max_failures``), not
    this controller error.

    Raises:
        ray.train.TrainingFailedError: the run failed otherwise, or more often than allowed.
    """
    limit = pack.tasks[0].job.trial.resources.max_failures
    restarts = 0
    while True:
        try:
            return _trainer(pack, settle).fit()
        except ControllerError as e:
            if PLACEMENT_GROUP_REMOVED not in str(e) or restarts == limit:
                raise
            restarts += 1
            print(f"[cemlab] {pack.label}: Ray removed its placement group while its "
                  f"workers started; starting it again (restart {restarts})", flush=True)


def error_text(error: str) -> str:
    """``error``, cut to its first 1,000 and last 3,000 characters when longer than 4,000."""
    return error if len(error) <= 4000 else f"{error[:1000]}\n[...]\n{error[-3000:]}"


def pack_driver(config: dict[str, str], packs: dict[str, Pack]) -> None:
    """Tune trainable: train ``packs[config["pack"]]`` with Ray Train, each trial recorded in
    the ledger (and so in MLflow) as its workers report it (``SettleTrials``), while its
    submission holds the trial's lease. When the run fails, the trial it was training is
    recorded FAILED with what the run raised, and the unsettled trials after it whose leases
    it still holds start in a new run.
    A driver whose submission died records nothing, so its leases lapse and its trials are
    taken over (and resumed) by the next submission."""
    for name, value in RAY_TRAIN_ENV.items():
        os.environ.setdefault(name, value)
    def held(task: Task) -> bool:
        if _held(task):
            return True
        # lost while it waited for a slot (a heartbeat-less lapse)
        print(f"[cemlab] {task.label}: another submission holds its lease now: not "
              "trained here", flush=True)
        return False

    pack = packs[config["pack"]].where(held)
    while pack.tasks:
        handed_over = time.time()  # time/startup_s of the run's first trials starts here
        first = pack.stacks[0]
        pack = Pack(tuple(dataclasses.replace(t, job=dataclasses.replace(
            t.job, submitted_at=handed_over)) if t in first else t for t in pack.tasks),
            pack.sizes)
        try:
            fit(pack, SettleTrials(pack))
            return  # every trial reported; one left unsettled lost its lease to the new holder
        except TrainingFailedError as e:
            error = f"{type(e).__name__}: {e}"
        # the stacks ran in order: the first with a trial not settled is the one the run was
        # training, all its unsettled trials at once
        failed = next((t for t in pack.tasks if _status(t) != Status.FINISHED), None)
        if failed is None:
            return
        for task in pack.stack_of(failed):
            if _status(task) != Status.FINISHED and record_task(task, Status.FAILED,
                                                                 error=error_text(error)):
                print(f"[cemlab] {task.label}: FAILED ({error.splitlines()[0]})", flush=True)
        pack = pack.after(failed).where(lambda t: _status(t) != Status.FINISHED and _held(t))


def _held(task: Task) -> bool:
    """Whether ``task``'s submission holds its trial's lease (acquired or renewed now)."""
    return ledger_for(task.ledger_url).acquire(task.row_id, task.owner, task.lease_s).acquired


def _status(task: Task) -> Status | None:
    row = ledger_for(task.ledger_url).trial_by_id(task.row_id)
    return row.status if row else None


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
    """In the submission, while Tune runs the grid: the unsettled trials of a pack whose driver
    failed (its actor died, or it raised) are recorded FAILED with what it raised, under the
    submission's lease."""

    def __init__(self, packs: dict[str, Pack]) -> None:
        self.packs = packs

    def __getstate__(self) -> dict:
        """Tune pickles its callbacks into the storage root (``tuner.pkl``): not the tasks,
        whose ledger URL may hold a password. Nothing restores this callback from there."""
        return {"packs": {}}

    def on_trial_error(self, iteration: int, trials: list, trial: ray.tune.experiment.Trial,
                       **info) -> None:
        written = trial.error_file and Path(trial.error_file)  # Tune's, on this node, just now
        error = error_text(written and written.exists() and failure_text(written.read_text())
                           or "its driver failed (Tune kept no error text)")
        for task in self.packs[trial.config["pack"]].tasks:
            if _status(task) in (Status.FINISHED, Status.FAILED):
                continue
            if record_task(task, Status.FAILED, error=error):
                print(f"[cemlab] {task.label}: FAILED ({error.splitlines()[0]})", flush=True)


def run_grid(name: str, tasks: list[Task], storage: StorageRoot, concurrency: int,
             submitted_at: float | None = None) -> None:
    """Run ``tasks`` of the submission started at ``submitted_at`` (UNIX seconds) with Ray Tune
    in ``packs``, ``concurrency`` at once; each outcome lands in the ledger and MLflow."""
    queued_at = time.time()
    by_name = {p.name: p for p in packs(
        [dataclasses.replace(t, submitted_at=submitted_at, queued_at=queued_at) for t in tasks],
        concurrency)}
    # Tune pickles its search state, name creator included, into the storage root: the creator
    # sees the labels only, never a Task (whose ledger URL may hold a password).
    labels = {n: p.label.replace(" ", "_") for n, p in by_name.items()}
    print(f"[cemlab] Ray Tune: {len(tasks)} trial(s) in {len(by_name)} worker group(s), up to "
          f"{concurrency} at once", flush=True)
    tuner = ray.tune.Tuner(
        ray.tune.with_resources(ray.tune.with_parameters(pack_driver, packs=by_name),
                                driver_resources()),
        param_space={"pack": ray.tune.grid_search(list(by_name))},
        tune_config=ray.tune.TuneConfig(
            max_concurrent_trials=concurrency,
            reuse_actors=True,
            trial_name_creator=lambda t: labels[t.config["pack"]],
        ),
        run_config=ray.tune.RunConfig(name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
                                      **ray_storage(storage, *_TUNE), verbose=1,
                                      callbacks=[SettleFailures(by_name)]))
    tuner.fit()
