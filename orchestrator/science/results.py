"""From the ledger to an experiment's results: its rows on the current grid (tuning seeds at
every learning rate, evaluation seeds at their arm's chosen one), each arm's learning rate
chosen on its tuning seeds' mean validation and its trained models there (``tuning``,
``evaluations``), the arms' seed spread and learning-rate choice diagnostics (``format_seeds``),
Akima optima per (dataset, variant, size) for display, stored on the MLflow parent run and
printed; progress by status."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

from orchestrator.planning.spec import ExperimentSpec
from orchestrator.records.ledger import Ledger, Status, TrialRow
from orchestrator.science.analysis import ArmChoice, Point, choose_lr, optima_table, set_noise
from orchestrator.science.brackets import reachable, same_lr
from orchestrator.table import format_table
from workloads.core.trial import PHASES

TABLE_ARTIFACT = "akima_optima.json"


def metric_name(spec: ExperimentSpec) -> str:
    """The test metric a trial of ``spec`` is judged by (the workload's, e.g. test perplexity)."""
    return spec.workload_impl.metric


def short_metric(spec: ExperimentSpec) -> str:
    """``metric_name`` without ``test_`` (``perplexity``, ``rmse``): the optima's column."""
    return metric_name(spec).removeprefix("test_")


def on_grid(spec: ExperimentSpec) -> Callable[[TrialRow], bool]:
    """Whether a ledger row lies on the spec's current grid (a spec edited to a smaller grid
    keeps its old rows in the ledger, outside the analysis); with brackets that extend, a
    learning rate that a round added (``lr_round``) counts as the grid's where the grid's
    brackets can reach it (``brackets.reachable``), and so does a row of an evaluation seed
    (``learning_rates.eval_seeds``: trained at its arm's chosen learning rate, which a round
    may have added). The grid is resolved once, not per row."""
    datasets = set(spec.workload_impl.datasets(spec.workload_config))
    grid = spec.lr_grid
    added = reachable(grid, spec.lr_max_points) if spec.lr_max_points else []
    tune, evals = set(spec.seeds), set(spec.eval_seeds)

    def check(row: TrialRow) -> bool:
        lrs = [*grid, *added] if row.lr_round or row.seed in evals else grid
        return (row.dataset in datasets and row.variant in spec.variants
                and row.size in spec.sizes and (row.seed in tune or row.seed in evals)
                and any(same_lr(row.lr, lr) for lr in lrs))
    return check


def experiment_rows(spec: ExperimentSpec, ledger: Ledger,
                    trial_ids: set[str] | None = None) -> list[TrialRow]:
    """The ledger rows of ``spec``'s experiment (empty if never run): those of ``trial_ids``
    when given, else those on the spec's current grid, the newest row per grid point (an edited
    spec gives its trials new hashes)."""
    exp = ledger.experiment(spec.name)
    rows = ledger.trials(exp.id) if exp else []
    if trial_ids is not None:
        return [r for r in rows if r.trial_hash in trial_ids]
    grid = on_grid(spec)
    newest = {(r.dataset, r.variant, r.size, r.lr, r.seed): r for r in rows if grid(r)}
    return sorted(newest.values(), key=lambda r: r.id)


def finished_points(rows: list[TrialRow]) -> list[Point]:
    """The finished rows as ``Point``s, those with finite validation and test metrics: a trial
    finished before validation metrics were recorded has none, and one that diverged (NaN or
    infinite metrics) chooses nothing; both are left out."""
    return [Point(r.dataset, r.variant, r.size, r.seed, r.lr, r.val_metric, r.metric)
            for r in rows if r.status == Status.FINISHED and r.metric is not None
            and r.val_metric is not None and math.isfinite(r.metric)
            and math.isfinite(r.val_metric)]


def optima(spec: ExperimentSpec, rows: list[TrialRow]) -> list[dict]:
    """``optima_table`` of the finished rows of the tuning seeds (``finished_points``; an
    evaluation seed trains at one learning rate and chooses nothing)."""
    points = finished_points([r for r in rows if r.seed in spec.seeds])
    return optima_table(points, short_metric(spec)) if points else []


Arm = tuple[str, str, str]  # (dataset, variant, size)
Z_CHOICE = 1.6448536269514722  # the normal's 95th percentile: a flip by the set's noise < 5 %


def outcome(row: TrialRow) -> str:
    """``finished`` (FINISHED with finite validation and test metrics), ``diverged`` (FAILED;
    or FINISHED with a non-finite metric, or with no test metric at all: SQLite stores NaN as
    NULL) or ``missing`` (not yet run, or finished with a test metric but no validation metric
    recorded)."""
    if row.status == Status.FAILED or (row.status == Status.FINISHED and row.metric is None):
        return "diverged"
    if row.status != Status.FINISHED or row.val_metric is None:
        return "missing"
    finite = math.isfinite(row.metric) and math.isfinite(row.val_metric)
    return "finished" if finite else "diverged"


def required_lrs(spec: ExperimentSpec, rows: list[TrialRow]) -> dict[Arm, list[float]]:
    """Per (dataset, variant, size): the learning rates every tuning seed must have, ascending:
    the spec's grid and every learning rate any tuning seed of the arm has a row at (what its
    bracket's rounds added, ``lr_round``), whatever the row's status. Evaluation seeds' rows
    add none."""
    out: dict[Arm, list[float]] = defaultdict(lambda: list(spec.lr_grid))
    for r in rows:
        if r.seed not in spec.seeds:
            continue
        lrs = out[(r.dataset, r.variant, r.size)]
        if not any(same_lr(r.lr, lr) for lr in lrs):
            lrs.append(r.lr)
    return {arm: sorted(lrs) for arm, lrs in out.items()}


@dataclass(frozen=True)
class Tuning:
    """The tuning seeds of an experiment and each arm's learning rate chosen on them.

    ``points``: the finished points of the (arm, seed) groups with an outcome at every learning
    rate of their arm (``required_lrs``); ``lrs``: each arm's learning rates; ``choices``: each
    arm's ``analysis.ArmChoice`` (``choose_lr``: a diverged learning rate of a kept seed counts
    as infinite validation loss); ``incomplete``, ``diverged`` and ``unchosen``: one line per
    seed left out, per kept seed with diverged learning rates, per arm without a choice."""

    points: tuple[Point, ...]
    lrs: dict[Arm, list[float]]
    choices: dict[Arm, ArmChoice]
    incomplete: tuple[str, ...]
    diverged: tuple[str, ...]
    unchosen: tuple[str, ...]

    def points_of(self, arm: Arm) -> list[Point]:
        """The arm's finished tuning points."""
        return [p for p in self.points if (p.dataset, p.variant, p.size) == arm]


def tuning(spec: ExperimentSpec, rows: list[TrialRow]) -> Tuning:
    """``Tuning`` of the tuning seeds' ``rows`` (rows of other seeds are ignored). An LR
    chosen on part of the grid is not the one the full grid would choose, so a seed without an
    outcome at every learning rate of its arm is left out; a diverged LR counts as present with
    infinite validation loss: the seed stays and that LR is never chosen (a seed whose every LR
    diverged is left out)."""
    rows = [r for r in rows if r.seed in spec.seeds]
    required = required_lrs(spec, rows)
    groups: dict[tuple, list[TrialRow]] = defaultdict(list)
    for r in rows:
        groups[(r.dataset, r.variant, r.size, r.seed)].append(r)
    kept: list[Point] = []
    left_out, diverged = [], []
    val: dict[Arm, dict[int, dict[float, float]]] = defaultdict(dict)
    for (d, v, s, seed), rs in sorted(groups.items()):
        lrs = required[(d, v, s)]
        done = [r for r in rs if outcome(r) != "missing"]
        missing = [lr for lr in lrs if not any(same_lr(r.lr, lr) for r in done)]
        finite = finished_points([r for r in done if outcome(r) == "finished"])
        bad = sorted(r.lr for r in done if outcome(r) == "diverged")
        name = f"{v}@{s} ({d}) seed {seed}"
        if missing:
            left_out.append(f"{name}: {len(lrs) - len(missing)} of {len(lrs)} learning rates "
                            f"finished (not {', '.join(f'{lr:g}' for lr in missing)}), left out")
        elif not finite:
            left_out.append(f"{name}: every learning rate diverged, left out")
        else:
            kept += finite
            val[(d, v, s)][seed] = {lr: next((p.val for p in finite if same_lr(p.lr, lr)),
                                             math.inf) for lr in lrs}
            if bad:
                diverged.append(f"{name}: learning rate {', '.join(f'{lr:g}' for lr in bad)} "
                                "diverged, counted as infinite validation loss (never chosen)")
    choices, unchosen = {}, []
    for arm, by_seed in sorted(val.items()):
        choice = choose_lr(required[arm], by_seed)
        if choice is None:
            unchosen.append(f"{arm[1]}@{arm[2]} ({arm[0]}): a tuning seed diverged at every "
                            "learning rate, none chosen")
        else:
            choices[arm] = choice
    return Tuning(tuple(kept), required, choices, tuple(left_out), tuple(diverged),
                  tuple(unchosen))


@dataclass(frozen=True)
class Models:
    """One arm's trained models at its chosen learning rate: ``tests`` (seed -> test metric,
    finite), ``runs`` (seed -> the trial's MLflow run id, or None), ``diverged`` (seeds whose
    trial there diverged) and ``source``: ``evaluation`` (fresh seeds,
    ``learning_rates.eval_seeds``) or ``tuning`` (the seeds the learning rate was chosen on)."""

    source: str
    tests: dict[int, float]
    runs: dict[int, str | None]
    diverged: tuple[int, ...] = ()


def evaluations(spec: ExperimentSpec, rows: list[TrialRow], tuned: Tuning,
                ) -> tuple[dict[Arm, Models], tuple[str, ...]]:
    """Per arm with a choice, the evaluation seeds' trained models at its chosen learning rate
    (arms without any such row left out), and one line per evaluation row at another learning
    rate (trained before the choice moved; not used) or diverged at the choice."""
    out: dict[Arm, Models] = {}
    notes = []
    by_arm: dict[Arm, list[TrialRow]] = defaultdict(list)
    for r in rows:
        if r.seed in spec.eval_seeds:
            by_arm[(r.dataset, r.variant, r.size)].append(r)
    for arm, rs in sorted(by_arm.items()):
        choice = tuned.choices.get(arm)
        name = f"{arm[1]}@{arm[2]} ({arm[0]})"
        here = [r for r in rs if choice and same_lr(r.lr, choice.lr)]
        other = sorted({r.lr for r in rs if r not in here})
        if other:
            notes.append(f"{name}: evaluation trials at learning rate "
                         f"{', '.join(f'{lr:g}' for lr in other)}, not the chosen "
                         f"{f'{choice.lr:g}' if choice else '(none)'}, not used")
        finished = [r for r in here if r.status == Status.FINISHED and r.metric is not None
                    and math.isfinite(r.metric)]
        bad = tuple(sorted(r.seed for r in here if r not in finished
                           and (r.status == Status.FAILED or r.status == Status.FINISHED)))
        if bad:
            notes.append(f"{name}: evaluation seed {', '.join(map(str, bad))} diverged at the "
                         "chosen learning rate, left out")
        if finished or bad:
            out[arm] = Models("evaluation", {r.seed: r.metric for r in finished},
                              {r.seed: r.mlflow_run_id for r in finished}, bad)
    return out, tuple(notes)


def tuned_models(rows: list[TrialRow], tuned: Tuning) -> dict[Arm, Models]:
    """Per arm with a choice, the tuning seeds' trained models at its chosen learning rate
    (the seeds it was chosen on: their test metric carries the choice's selection)."""
    run_of = {(r.dataset, r.variant, r.size, r.seed, r.lr): r.mlflow_run_id for r in rows}
    out = {}
    for arm, choice in tuned.choices.items():
        at = [p for p in tuned.points_of(arm) if same_lr(p.lr, choice.lr)]
        out[arm] = Models("tuning", {p.seed: p.test for p in at},
                          {p.seed: run_of.get((*arm, p.seed, p.lr)) for p in at})
    return out


def choice_noise(choice: ArmChoice, points: list[Point], sequences: int | None,
                 ) -> tuple[float | None, float | None, int | None]:
    """How far the validation set's noise can move ``choice`` (docs/statistics.md):
    ``(sigma, z, needed)`` with ``sigma`` the set noise bound of one trial's log validation
    (``analysis.set_noise`` over the arm's tuning ``points``), ``z = gap / (sqrt(2) sigma)`` the
    choice's gap to its runner-up in units of that noise on a difference of two learning rates,
    and ``needed`` the validation sequences at which ``z`` reaches ``Z_CHOICE`` (noise falls
    as 1/sqrt(sequences)): ``ceil(sequences (Z_CHOICE / z)^2)``. Nones where undefined."""
    sigma = set_noise(points)
    if sigma is None or choice.gap is None:
        return sigma, None, None
    if sigma == 0:
        return sigma, math.inf, sequences
    z = choice.gap / (math.sqrt(2) * sigma)
    if not sequences:
        return sigma, z, None
    return sigma, z, (math.ceil(sequences * (Z_CHOICE / z) ** 2) if z > 0 else None)


def arm_rows(tuned: Tuning, models: dict[Arm, Models], detail: bool = False,
             steps: dict[Arm, int] | None = None, sequences: int | None = None) -> list[dict]:
    """One row per arm with a choice: its chosen learning rate (``edge`` where it is the
    grid's smallest or largest: no optimum), learning rates trained, tuning seeds and their
    standard deviation of log validation at the choice, the models its test is read from
    (``models``: seeds and source), their test metric (mean ± sd) and their seed standard
    deviation of log test (in %, as all log spreads here). With ``detail``, also the steps per
    trial (``steps``), the gap to the runner-up learning rate, the validation-set noise bound,
    its z and the validation sequences for z >= ``Z_CHOICE`` (``choice_noise``)."""
    rows = []
    for arm, choice in sorted(tuned.choices.items(), key=lambda kv: (kv[0][0], kv[0][2],
                                                                       kv[0][1])):
        dataset, variant, size = arm
        m = models.get(arm)
        tests = list(m.tests.values()) if m else []
        logs = [math.log(t) for t in tests]
        row = {"dataset": dataset, "size": size, "variant": variant,
               "LR (chosen)": f"{choice.lr:.3g}" + (" edge" if choice.at_edge else ""),
               "LRs": len(choice.lrs), "tuning seeds": len(choice.seeds),
               "val sd (seeds)": _pct_sd(choice.val_sd, len(choice.seeds)),
               "test seeds": f"{len(tests)} {m.source}" if m else "0",
               "test": _pm(statistics.fmean(tests), _std(tests), "{:.3f}") if tests else "-",
               "seed sd (log test)": _pct_sd(_std(logs), len(logs))}
        if detail:
            sigma, z, needed = choice_noise(choice, tuned.points_of(arm), sequences)
            row.update({"steps": steps.get(arm, "-") if steps else "-",
                        "gap to runner-up": f"{100 * choice.gap:.2f}%"
                        if choice.gap is not None else "-",
                        "val-set noise <=": f"{100 * sigma:.2f}%" if sigma is not None else "-",
                        "z": f"{z:.2f}" if z is not None and math.isfinite(z) else "-",
                        "val sequences for z>=1.64": needed if needed is not None else "-"})
        rows.append(row)
    return rows


def _pct_sd(sd: float, n: int) -> str:
    return f"{100 * sd:.2f}%" if n > 1 else "-"


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def arm_steps(spec: ExperimentSpec) -> dict[Arm, int]:
    """Each arm's optimizer steps per trial (planned without the prepared data: the spec's
    vocabulary)."""
    from orchestrator.planning.plan import arm_cells

    return {arm: cell(spec.lr_grid[0], spec.seeds[0]).steps
            for arm, cell in arm_cells(spec).items()}


def format_seeds(spec: ExperimentSpec, rows: list[TrialRow]) -> str:
    """``cemlab seeds``: per arm the learning rate chosen on its tuning seeds' mean validation,
    the seed spread there (of validation on the tuning seeds, of test on the models the claims
    read: the evaluation seeds where any finished, else the tuning seeds), the steps per trial,
    and how far the validation set's noise can move the choice (``arm_rows`` with
    ``detail``); then the seeds and arms left out."""
    tuned = tuning(spec, rows)
    evaluated, notes = evaluations(spec, rows, tuned)
    models = {**tuned_models(rows, tuned), **evaluated}
    sequences = spec.training.eval_sequences if spec.workload_impl.unit == "tokens" else None
    table = arm_rows(tuned, models, detail=True, steps=arm_steps(spec), sequences=sequences)
    head = (f"experiment {spec.name}: {len(spec.seeds)} tuning seed(s), "
            f"{len(spec.eval_seeds)} evaluation seed(s); learning rate chosen per arm on the "
            "tuning seeds' mean log validation; spreads are standard deviations of log metrics "
            f"(%); z: the gap to the runner-up over the validation-set noise on it, "
            f"{sequences or '-'} validation sequences now")
    lines = [head, format_table(table) if table else "no arm has a complete tuning seed yet",
             *[f"incomplete: {line}" for line in tuned.incomplete],
             *[f"diverged: {line}" for line in tuned.diverged],
             *[f"no choice: {line}" for line in tuned.unchosen],
             *[f"evaluation: {line}" for line in notes]]
    return "\n".join(lines)


def store_on_parent(client: MlflowClient, parent_run_id: str, table: list[dict],
                    metric: str) -> None:
    """Log the optima as metrics ``<dataset>/<variant>/<size>/opt_lr`` (the LR chosen on
    validation), ``opt_val_<metric>``, ``opt_<metric>`` (test at that LR), with ``_std``, and
    ``nearest_<metric>``, timestamped now so that they are the run's latest values; and the
    whole table as artifact ``akima_optima.json`` of the parent run, replacing the one an
    earlier submission of the spec stored (``MlflowClient.log_table`` appends to it instead:
    every resubmission would repeat the rows), in ``log_table``'s format and marked as a table
    the same way (``MlflowClient.load_table`` reads it)."""
    keys = ("opt_lr", "opt_lr_std", f"opt_val_{metric}", f"opt_val_{metric}_std",
            f"opt_{metric}", f"opt_{metric}_std", f"nearest_{metric}")
    now_ms = int(time.time() * 1000)  # the newest submission's value is the run's latest
    metrics = [Metric(f"{row['dataset']}/{row['variant']}/{row['size']}/{key}",
                      float(row[key]), now_ms, 0) for row in table for key in keys]
    if not metrics:
        return
    client.log_batch(parent_run_id, metrics=metrics)
    client.log_text(parent_run_id, pd.DataFrame(table).to_json(orient="split", index=False,
                                                               date_format="iso"),
                    TABLE_ARTIFACT)
    logged = json.loads(client.get_run(parent_run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS,
                                                                      "[]"))
    entry = {"path": TABLE_ARTIFACT, "type": "table"}
    if entry not in logged:
        client.set_tag(parent_run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*logged, entry]))


def format_optima(table: list[dict], metric: str) -> str:
    """The optima as a terminal table (mean ± std over seeds: the LR chosen on validation,
    validation there, test there), then warnings."""
    rows = [{"dataset": r["dataset"], "variant": r["variant"], "size": r["size"],
             "seeds": r["seeds"], "LRs": r["lrs"],
             "optimal LR (val)": _pm(r["opt_lr"], r["opt_lr_std"], "{:.2e}"),
             f"val {metric}": _pm(r[f"opt_val_{metric}"], r[f"opt_val_{metric}_std"], "{:.3f}"),
             f"optimal {metric} (test)": _pm(r[f"opt_{metric}"], r[f"opt_{metric}_std"],
                                             "{:.3f}"),
             f"test {metric}, nearest LR": f"{r[f'nearest_{metric}']:.3f}"} for r in table]
    warnings = [f"warning: {r['variant']}@{r['size']} ({r['dataset']}): {r['warning']}"
                for r in table if r["warning"]]
    return "\n".join([format_table(rows), *warnings])


def _pm(mean: float, std: float, fmt: str) -> str:
    return f"{fmt.format(mean)} ± {fmt.format(std)}"


def status_counts(rows: list[TrialRow]) -> dict[Status, int]:
    """How many rows have each status, every ``Status`` present."""
    return {s: sum(r.status == s for r in rows) for s in Status}


def format_time_split(trials: list[dict]) -> str:
    """One line: the share of the ``trials``' wall time (``tracking.finished_trials``) spent in
    train steps, and the seconds of every phase (``workloads.runtime.timing``), summed over them
    (``compile`` only where a trial compiled); then, where logged (``tracking.breakdown``), their
    seconds queued for a slot of the grid (summed) and the first train step after submit (the
    earliest of any trial: a submission's, when ``trials`` are one submission's)."""
    seconds: dict[str, float] = {}
    for trial in trials:
        for k, v in trial["metrics"].items():
            if k.startswith("time/"):
                seconds[k] = seconds.get(k, 0.0) + v
    total = seconds.get("time/total_s", 0.0)
    if not trials or total <= 0:
        return "time split: no finished trial has logged one yet"
    parts = ", ".join(f"{name} {seconds.get(f'time/{name}_s', 0.0):,.0f} s"
                      for name in (*PHASES, "teardown")
                      if name != "compile" or seconds.get("time/compile_s", 0.0) > 0)
    line = (f"time split of {len(trials)} finished trial(s): "
            f"{seconds.get('time/train_s', 0.0) / total:.0%} in train steps ({parts}; "
            f"{total:,.0f} s in all)")
    if "time/queue_s" in seconds:
        line += f"; before that, {seconds['time/queue_s']:,.0f} s queued for a slot of the grid"
    firsts = [t["metrics"]["time/first_step_s"] for t in trials
              if "time/first_step_s" in t["metrics"]]
    if firsts:
        line += f"; first train step {min(firsts):,.1f} s after submit"
    return line


def format_efficiency(trials: list[dict]) -> str:
    """Per (variant, size) of the ``trials`` (``tracking.finished_trials``): MFU over the train
    steps (``train_mfu``: mean, min and max) and the most memory a worker held
    (``peak_memory_mib``)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for trial in trials:
        if "train_mfu" in trial["metrics"]:
            groups.setdefault((trial["variant"], trial["size"]), []).append(trial["metrics"])
    if not groups:
        return "MFU and peak memory: no finished trial has logged them yet"
    rows = []
    for (variant, size), ms in groups.items():
        mfu = [m["train_mfu"] for m in ms]
        rows.append({"variant": variant, "size": size, "trials": len(ms),
                     "MFU mean": f"{sum(mfu) / len(mfu):.1%}",
                     "MFU min-max": f"{min(mfu):.1%}-{max(mfu):.1%}",
                     "peak memory/worker": f"{max(m['peak_memory_mib'] for m in ms):,.0f} MiB"})
    return "MFU (model FLOPs over the devices' peak, train steps) and peak memory:\n" + (
        format_table(rows))


def format_status(spec: ExperimentSpec, rows: list[TrialRow], planned: int) -> str:
    """Progress of an experiment: counts by status, the tuning trials not yet submitted (of
    ``planned``) and the evaluation trials of its evaluation seeds, one line per trial, then
    the first line of what each failed trial raised (the whole of it is the ledger row's
    ``error``)."""
    tune = [r for r in rows if r.seed not in spec.eval_seeds]
    head = (f"experiment {spec.name}: {planned} trial(s) planned, "
            + ", ".join(f"{n} {s.lower()}" for s, n in status_counts(rows).items())
            + f", {max(planned - len(tune), 0)} not yet submitted")
    if spec.eval_seeds:
        arms = (len(spec.workload_impl.datasets(spec.workload_config)) * len(spec.sizes)
                * len(spec.variants))
        head += (f"; and {arms * len(spec.eval_seeds)} evaluation trial(s) (seeds "
                 f"{', '.join(map(str, spec.eval_seeds))} at each arm's chosen learning rate, "
                 f"planned once its bracket settles), {len(rows) - len(tune)} of them in the "
                 "ledger")
    table = [{"trial": r.trial_hash, "dataset": r.dataset, "variant": r.variant,
              "size": r.size, "lr": f"{r.lr:g}", "seed": r.seed,
              "status": f"{r.status} (cached)" if r.source_trial_id else str(r.status),
              metric_name(spec): r.metric, "mlflow run": r.mlflow_run_id,
              "updated": r.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
              "checkpoint": r.checkpoint_path} for r in rows]
    failures = [f"{r.trial_hash} failed: {r.error.strip().splitlines()[0]}" for r in rows
                if r.status == Status.FAILED and r.error and r.error.strip()]
    return "\n".join([head, format_table(table), *failures]) if table else head
