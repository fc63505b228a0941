"""Drive an experiment, in stages a reader can follow top to bottom (``run_experiment``):

0. ``check_services``: storage, ledger and tracking server answer, and on a cluster nothing
   host-only crosses to another node (``check_reach``); nothing starts otherwise.
1. ``prepare``: the workload prepares its data; the plan is computed once from it.
2. ``open_books``: the ledger's experiment row and the MLflow experiment and parent run.
3. ``claim``: a ledger row per trial, and for each unfinished one that no other live
   submission holds, its lease and its one MLflow run; finished trials are skipped, and a
   trial that another experiment of the ledger finished is copied from it (the trial cache).
4. ``launch``: Ray Tune runs the claimed trials (in packs of same-shaped trials, each pack a
   Ray Train run whose worker group trains them in turn); then ``claim`` and
   ``launch`` again whatever another submission held until its lease lapsed, waiting for the
   rest to settle there (``leases.wait_for_holders``). A heartbeat keeps this submission's
   leases alive meanwhile. With brackets that adapt (``learning_rates: {grid, extend,
   max_points}``), ``extend_brackets`` then plans the next learning rate beyond the edge of
   every arm whose validation optimum sits there, and those are claimed and launched in turn,
   round after round. Once the brackets settle, ``eval_trials`` plans the evaluation seeds
   (``learning_rates.eval_seeds``) of every arm at the learning rate chosen on its tuning
   seeds' mean validation, and those are claimed and launched too.
5. ``analyse``: the ledger's rows of this plan, Akima optima stored on the parent run.
6. ``report``: the results table and the optima, printed.
7. ``register``: the best model per (variant, size) into the MLflow registry.
8. ``close``: the parent run's status follows the ledger.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from mlflow import MlflowClient

from orchestrator.execution import launch as tune
from orchestrator.execution import leases
from orchestrator.execution.packs import Task
from orchestrator.execution.settle import record
from orchestrator.planning.plan import (
    SUMMARY_ABOVE,
    arm_cells,
    cells,
    concurrency,
    format_plan,
    format_summary,
    plan,
)
from orchestrator.planning.spec import ExperimentSpec
from orchestrator.records import tracking
from orchestrator.records.ledger import Ledger, Status, TrialRow
from orchestrator.records.model_registry import register_best
from orchestrator.science import brackets
from orchestrator.science.results import (
    experiment_rows,
    finished_points,
    format_optima,
    metric_name,
    optima,
    short_metric,
    store_on_parent,
    tuning,
)
from orchestrator.settings import Settings
from orchestrator.table import format_table
from workloads.core.reach import ServiceError, check_database, check_tracking, node_only
from workloads.core.trial import Job, Prepared, Trial


@dataclass(frozen=True)
class Books:
    """Where an experiment is recorded: the ledger (which decides every trial's status) and
    MLflow (which follows it)."""

    settings: Settings
    ledger: Ledger
    client: MlflowClient
    experiment: str
    experiment_row_id: int
    mlflow_experiment_id: str
    parent_run_id: str


def check_services(settings: Settings) -> None:
    """Storage root, ledger database and tracking server answer from here; on a cluster
    (``RAY_ADDRESS``: inside ``ray job submit``), nothing host-only crosses to another node
    (``check_reach``).

    Raises:
        ServiceError: one line naming the setting and the cause (no password in it).
    """
    settings.storage.check()
    check_database(settings.ledger_url, "CEMLAB_LEDGER_URL")
    check_tracking(settings.tracking_uri)
    if os.environ.get("RAY_ADDRESS"):
        connect()
        check_reach(settings)


def connect() -> None:
    """Join the cluster that ``RAY_ADDRESS`` names, else start a local Ray instance here
    (never whatever cluster last ran on this machine, possibly a dead one); once.

    Raises:
        ServiceError: no Ray cluster answers at ``RAY_ADDRESS``.
    """
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or "local"
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as e:
        raise ServiceError(f"RAY_ADDRESS {address}: {str(e).splitlines()[0]}") from None


def check_reach(settings: Settings) -> None:
    """Nothing that crosses to the workers names this host only, unless every Ray node is this
    host: the tracking URI and the storage root go to every worker.

    Raises:
        ServiceError: e.g. a loopback ``MLFLOW_TRACKING_URI`` on a cluster with a node at
            another address.
    """
    here = ray.util.get_node_ip_address()
    others = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} - {here})
    if not others:
        return
    for setting, uri in (("MLFLOW_TRACKING_URI", settings.tracking_uri),
                         ("CEMLAB_STORAGE", settings.storage.uri)):
        if node_only(uri):
            raise ServiceError(f"{setting} {uri} is only reachable on this host ({here}), but "
                               f"the Ray cluster has nodes at {', '.join(others)}: give an "
                               "address (or s3:// root) that every node reaches")


def prepare(spec: ExperimentSpec, settings: Settings) -> tuple[Prepared, list[Trial]]:
    """The workload's data, prepared on the Ray cluster (``connect``; the corpus is a Ray Data
    pipeline), ready on this node and published to the storage root (where every node's
    workers fetch it), and the plan computed from it."""
    connect()
    workload = spec.workload_impl
    print(f"[cemlab] preparing the data of '{spec.name}' ({workload.name}) in "
          f"{settings.data_dir}", flush=True)
    prepared = workload.prepare(spec.workload_config, str(settings.data_dir))
    if prepared.summary:
        print(f"[cemlab] {prepared.summary}", flush=True)
    prepared = dataclasses.replace(prepared, data=workload.publish(prepared.data,
                                                                   settings.storage))
    trials = plan(spec, prepared.data)
    print(format_plan(spec, trials) if len(trials) <= SUMMARY_ABOVE
          else format_summary(spec, cells(spec, prepared.data)), flush=True)
    return prepared, trials


def open_books(spec: ExperimentSpec, spec_yaml: str, settings: Settings) -> Books:
    """The experiment's ledger row, MLflow experiment and parent run (created once, then
    reused), with the parent run marked running."""
    ledger = Ledger(settings.ledger_url)
    client = MlflowClient(settings.tracking_uri)
    exp = ledger.ensure_experiment(spec.name, spec.workload, spec_yaml)
    exp_id = tracking.experiment_id(client, spec.name)
    parent = exp.parent_run_id
    if not parent:  # two submissions may both get here: the first to record its run wins
        created = tracking.start_parent_run(client, exp_id, spec, spec_yaml)
        parent = ledger.set_parent_run(exp.id, created)
        if parent != created:
            client.delete_run(created)
    ledger.update_experiment(exp.id, mlflow_experiment_id=exp_id)
    tracking.mirror_status(client, parent, Status.RUNNING)
    return Books(settings, ledger, client, spec.name, exp.id, exp_id, parent)


def claim(spec: ExperimentSpec, trials: list[Trial], prepared: Prepared, books: Books,
          owner: str, cache: bool = True, lr_round: int = 0,
          ) -> tuple[list[Task], list[Trial]]:
    """A ledger row per trial of ``spec`` (with ``lr_round``, the bracket round that added their
    learning rates); for each unfinished trial whose lease ``owner`` gets (no other live
    submission holds it, in this experiment or another), with ``cache`` and a FINISHED row of the
    same trial id in another experiment, its copy (``settle_from_cache``); otherwise one MLflow
    run (never two, even after a crash between creating the run and recording it) and a Tune
    task. Returns the tasks, and the trials that another submission holds (each said in one
    line)."""
    tasks, held = [], []
    for trial in trials:
        row = books.ledger.ensure_trial(books.experiment_row_id, trial.trial_id,
                                        dataset=trial.dataset, variant=trial.variant,
                                        size=trial.size, lr=trial.lr, seed=trial.seed,
                                        lr_round=lr_round or None)
        lease = (None if row.status == Status.FINISHED else
                 books.ledger.acquire(row.id, owner, books.settings.lease_s))
        if lease is None or lease.status == Status.FINISHED:
            print(f"[cemlab] {trial.label} ({trial.trial_id}): finished, skipped", flush=True)
            continue
        if not lease.acquired:
            until = f" until {lease.expires_at:%H:%M:%S} UTC" if lease.expires_at else ""
            print(f"[cemlab] {trial.label} ({trial.trial_id}): held by "
                  f"{lease.owner or 'another submission'}{until}, which trains it", flush=True)
            held.append(trial)
            continue
        # under the lease, so a holder in another experiment has settled; a row with a run of
        # its own has started training here, and resumes
        source = books.ledger.finished_copy(trial.trial_id, books.experiment_row_id) \
            if cache and row.mlflow_run_id is None else None
        if source is not None:
            settle_from_cache(trial, row, source, books, owner)
            continue
        taken = f", taken over from {lease.previous_owner}, whose lease expired"
        print(f"[cemlab] {trial.label} ({trial.trial_id}): claimed by {owner}"
              f"{taken if lease.previous_owner else ''}", flush=True)
        run_id = row.mlflow_run_id or (
            tracking.find_trial_run(books.client, books.mlflow_experiment_id, trial.trial_id)
            or tracking.start_trial_run(books.client, books.mlflow_experiment_id,
                                        books.parent_run_id, trial, spec.workload_impl.section,
                                        prepared.metrics, lr_round))
        record(books.ledger, books.client, row.id, run_id, Status.PENDING, mlflow_run_id=run_id)
        earlier = row.checkpoint_path and books.settings.storage.path_of_uri(row.checkpoint_path)
        job = Job(trial, prepared.data, books.settings.tracking_uri, run_id,
                  earlier_runs=(earlier,) if earlier else ())
        tasks.append(Task(job, spec.workload_impl, books.experiment, row.id,
                          books.settings.ledger_url, books.settings.storage, owner,
                          books.settings.lease_s))
    return tasks, held


def settle_from_cache(trial: Trial, row: TrialRow, source: TrialRow, books: Books,
                      owner: str) -> None:
    """Settle ``row`` (whose lease ``owner`` holds) from ``source``, the FINISHED row of the same
    trial id that another experiment trained: an MLflow run of this experiment copied from the
    source's (``tracking.copy_trial_run``), and the source's metrics and checkpoint, pointing to
    it (``source_trial_id``). A source imported from a result bundle has no MLflow run here:
    neither has its copy."""
    run_id = tracking.copy_trial_run(books.client, books.mlflow_experiment_id,
                                     books.parent_run_id, source.mlflow_run_id) \
        if source.mlflow_run_id else None
    books.ledger.update_trial(row.id, owner=owner, status=Status.FINISHED, mlflow_run_id=run_id,
                              metric=source.metric, val_metric=source.val_metric,
                              checkpoint_path=source.checkpoint_path, source_trial_id=source.id)
    where = books.ledger.experiment_name(source.experiment_id)
    print(f"[cemlab] {trial.label} ({trial.trial_id}): cached, trained in experiment "
          f"'{where}' (run {source.mlflow_run_id or 'none: imported'})", flush=True)


def launch(spec: ExperimentSpec, tasks: list[Task], settings: Settings,
           submitted_at: float | None = None) -> None:
    """Run ``tasks`` of the submission started at ``submitted_at`` (UNIX seconds) with Ray Tune
    (``connect``)."""
    if not tasks:
        return
    connect()
    tune.run_grid(spec.name, tasks, settings.storage, concurrency(spec), submitted_at)


def train(spec: ExperimentSpec, trials: list[Trial], prepared: Prepared, books: Books,
          owner: str, cache: bool, submitted_at: float, lr_round: int = 0) -> None:
    """``claim`` and ``launch`` ``trials``, then again whatever another submission held until its
    lease lapsed, waiting for the rest to settle there (``leases.wait_for_holders``)."""
    pending = trials
    while pending:
        tasks, held = claim(spec, pending, prepared, books, owner, cache, lr_round)
        launch(spec, tasks, books.settings, submitted_at)
        pending = leases.wait_for_holders(books.ledger, books.experiment_row_id, held,
                                          poll_s=min(5.0, books.settings.lease_s / 4))


def extend_brackets(spec: ExperimentSpec, trials: list[Trial], prepared: Prepared,
                    books: Books, lr_round: int) -> list[Trial]:
    """Round ``lr_round`` of the brackets that adapt (``orchestrator.science.brackets``): for each
    arm of ``trials`` whose validation optimum sits at an edge of its learning rates, its trials at
    the next learning rate beyond that edge, every seed, each arm said in one line; none for a
    fixed grid."""
    if spec.lr_max_points is None:
        return []
    rows = experiment_rows(spec, books.ledger, {t.trial_id for t in trials})
    more = brackets.next_round(rows, finished_points(rows), spec.lr_max_points)
    grid = arm_cells(spec, prepared.data)
    new = []
    for (dataset, variant, size), lrs in sorted(more.items()):
        had = sorted({r.lr for r in rows if (r.dataset, r.variant, r.size)
                      == (dataset, variant, size)})
        print(f"[cemlab] learning-rate bracket, round {lr_round}: {variant}@{size} ({dataset}) "
              f"has its validation optimum at an edge of {', '.join(f'{lr:g}' for lr in had)}: "
              f"adding {', '.join(f'{lr:g}' for lr in lrs)} for {len(spec.seeds)} seed(s)",
              flush=True)
        new += [grid[(dataset, variant, size)](lr, seed) for lr in lrs for seed in spec.seeds]
    return new


def eval_trials(spec: ExperimentSpec, trials: list[Trial], prepared: Prepared,
                books: Books) -> list[Trial]:
    """The evaluation round, after the brackets of ``trials`` (the tuning trials) settle: for
    each arm with a learning rate chosen on its tuning seeds' mean validation
    (``results.tuning``: the complete seeds, a trained learning rate, never interpolated), its
    trials of every evaluation seed at that learning rate, each arm said in one line (at a grid
    edge: said to be no optimum); none without evaluation seeds. Their trial ids are the
    plan's (``plan.arm_cells``) at that learning rate and seed."""
    if not spec.eval_seeds:
        return []
    rows = experiment_rows(spec, books.ledger, {t.trial_id for t in trials})
    tuned = tuning(spec, rows)
    grid = arm_cells(spec, prepared.data)
    new = []
    for line in (*tuned.incomplete, *tuned.unchosen):
        print(f"[cemlab] evaluation round: {line}", flush=True)
    for (dataset, variant, size), choice in sorted(tuned.choices.items()):
        edge = (" (at the edge of its learning rates: no optimum, the bracket could not pass "
                "it)" if choice.at_edge else "")
        print(f"[cemlab] evaluation round: {variant}@{size} ({dataset}) chose learning rate "
              f"{choice.lr:g} on {len(choice.seeds)} tuning seed(s){edge}: training seed(s) "
              f"{', '.join(map(str, spec.eval_seeds))} there", flush=True)
        new += [grid[(dataset, variant, size)](choice.lr, seed) for seed in spec.eval_seeds]
    return new


def analyse(spec: ExperimentSpec, trials: list[Trial], books: Books,
            ) -> tuple[list[TrialRow], list[dict[str, Any]]]:
    """The ledger rows of this plan and their Akima optima, stored on the parent run."""
    rows = experiment_rows(spec, books.ledger, {t.trial_id for t in trials})
    table = optima(spec, rows)
    store_on_parent(books.client, books.parent_run_id, table, short_metric(spec))
    return rows, table


def report(spec: ExperimentSpec, trials: list[Trial], rows: list[TrialRow],
           table: list[dict[str, Any]], wall_s: float) -> None:
    """Print every trial's status and metrics, then the optima."""
    metric = metric_name(spec)
    selection = spec.workload_impl.selection_metric
    by_hash = {r.trial_hash: r for r in rows}
    print(f"\n[cemlab] results of '{spec.name}' (wall {wall_s:.0f}s)")
    print(format_table([{"dataset": t.dataset, "variant": t.variant, "size": t.size,
                         "lr": f"{t.lr:g}", "seed": t.seed, "params": t.params["total"],
                         "tokens": t.tokens, "status": str(by_hash[t.trial_id].status),
                         selection: by_hash[t.trial_id].val_metric,
                         metric: by_hash[t.trial_id].metric}
                        for t in trials if t.trial_id in by_hash]))
    if table:
        print(f"\n[cemlab] Akima optima over log2(LR): chosen on {selection}, {metric} "
              "reported there")
        print(format_optima(table, short_metric(spec)))


def register(spec: ExperimentSpec, trials: list[Trial], rows: list[TrialRow],
             books: Books) -> None:
    """Register the best finished trial per (variant, size), when the workload's models are
    registrable."""
    if not spec.workload_impl.registers_models:
        return
    for line in register_best(books.client, spec.name, spec.workload_impl, trials,
                              model_runs(rows, books.ledger)):
        print(f"[cemlab] {line}")


def model_runs(rows: list[TrialRow], ledger: Ledger) -> dict[str, tuple[str, float, float]]:
    """``register_best``'s results: trial id -> (the MLflow run holding its model, validation
    metric, test metric) for the ``rows`` evaluated. A cached trial's model is its source run's,
    where it was trained (and is registered once); a trial imported from a result bundle has
    no run here, and no model to register."""
    trained = {r.id: r.mlflow_run_id for r in ledger.rows_of_trials(
        {r.trial_hash for r in rows if r.source_trial_id is not None})}
    runs = {r.trial_hash: (trained.get(r.source_trial_id, r.mlflow_run_id), r.val_metric,
                         r.metric) for r in rows if r.val_metric is not None}
    return {trial: run for trial, run in runs.items() if run[0]}


def close(books: Books, done: bool) -> None:
    """The parent run finishes when every trial has, else fails; print where to look."""
    tracking.mirror_status(books.client, books.parent_run_id,
                           Status.FINISHED if done else Status.FAILED)
    uri = books.settings.tracking_uri
    url = tracking.ui_url(uri, books.mlflow_experiment_id)
    print(f"\nMLflow: {url or uri}\nDashboard: make dashboard", flush=True)


def submission_time() -> float:
    """When this driver's job was submitted to the Ray cluster (``ray job submit``), UNIX
    seconds, from the cluster's job records: the job's runtime environment and this driver's
    start and imports count in ``time/first_step_s``. Now for a driver started any other way
    (``cemlab run`` in a shell), and where no job server answers."""
    from ray.job_submission import JobSubmissionClient, JobType

    if not ray.is_initialized():  # a submitted job's driver has joined its cluster by now
        return time.time()
    job_id = ray.get_runtime_context().get_job_id()
    try:
        jobs = JobSubmissionClient().list_jobs()
    except Exception:  # a cluster without its job server: no job was submitted to it
        return time.time()
    return next((job.start_time / 1000 for job in jobs if job.job_id == job_id
                 and job.type == JobType.SUBMISSION and job.start_time), time.time())


def run_experiment(spec: ExperimentSpec, spec_yaml: str, cache: bool = True) -> bool:
    """Run every trial of ``spec`` not yet FINISHED in the ledger; analyse; register. With
    ``cache``, a trial that another experiment of the ledger has FINISHED is copied from it,
    not trained again.

    Exactly once: a trial's ledger row keeps its single MLflow run (nested under the
    experiment's parent run); a finished trial is skipped, an unfinished one resumes from its
    last Ray Train checkpoint; a trial is trained only under this submission's lease, so a
    concurrent submission of the same spec trains the others and waits for these (and takes
    them over if this one dies). Failed trials do not stop the others.

    Returns:
        True when every trial of the grid has finished.
    """
    started = time.perf_counter()
    settings = Settings()
    check_services(settings)
    submitted_at = submission_time()
    prepared, trials = prepare(spec, settings)
    books = open_books(spec, spec_yaml, settings)
    owner = leases.owner_id()
    with leases.Heartbeat(books.ledger, owner, settings.lease_s):
        lr_round, added = 0, trials
        while added:
            train(spec, added, prepared, books, owner, cache, submitted_at, lr_round)
            lr_round += 1
            added = extend_brackets(spec, trials, prepared, books, lr_round)
            trials = trials + added
        evaluation = eval_trials(spec, trials, prepared, books)
        if evaluation:
            train(spec, evaluation, prepared, books, owner, cache, submitted_at)
            trials = trials + evaluation
    rows, table = analyse(spec, trials, books)
    report(spec, trials, rows, table, time.perf_counter() - started)
    done = len(rows) == len(trials) and all(r.status == Status.FINISHED for r in rows)
    if done:
        register(spec, trials, rows, books)
    close(books, done)
    return done
