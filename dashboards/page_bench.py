"""Seed a real MLflow store and ledger with synthetic CEM Lab trials whose numbers follow a
known law, and time every dashboard page against it.

    python -m dashboards.page_bench --runs 1000   # seeds a fresh SQLite store, prints render times

The trials are planned by ``orchestrator.planning.plan`` from real specs (the paper's ``-cpu``
twins and a four-size scaling spec) and written through ``orchestrator.records.tracking`` and the
ledger, exactly as ``cemlab run`` writes them; only their metrics are synthetic. A
language-model trial's test perplexity is

    L = E + A * (N * s)^(-alpha) * (1 + LR_CURVATURE * log2(lr / LR_OPT)^2) * (1 + noise)

with N its non-embedding parameters and ``s = 1 / (1 - CEM_SAVING)`` for variants with a CEM
sublayer, ``s = 1`` for Llama: CEM reaches Llama's perplexity with exactly ``CEM_SAVING`` fewer
non-embedding parameters, a truth the Compare page's fit must recover. Validation perplexity is
``VAL_OFFSET`` above test. A CEM trial of the scaling spec also has test-time recursion
(``training.eval_steps``): at T_eval steps its perplexity is ``L * (1 + RECURSION_COST *
|log2(T_eval / T_train)|)`` with eta per step kept, half that excess with eta scaled. The tests
(``tests/dashboards``), the browser test and this benchmark share it.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Metric

from orchestrator.planning.plan import plan
from orchestrator.planning.spec import ExperimentSpec, load_spec, parse_spec
from orchestrator.records.ledger import Ledger, Status
from orchestrator.records.tracking import experiment_id, start_parent_run, start_trial_run
from orchestrator.science.results import optima, store_on_parent
from workloads.core.trial import Trial

ROOT = Path(__file__).resolve().parents[1]
TRUE_E, TRUE_A, TRUE_ALPHA = 12.0, 1500.0, 0.35
CEM_SAVING = 0.25  # fraction of non-embedding parameters CEM needs less for Llama's perplexity
LR_OPT = 0.008  # the synthetic optimum: the middle of fig3a-cpu's grid 0.002-0.032 (log2)
LR_CURVATURE = 0.04
VAL_OFFSET = 0.01  # validation perplexity = test * (1 + VAL_OFFSET)
NOISE = 0.002  # relative seed-to-seed noise of the metrics
RECURSION_COST = 0.05  # relative perplexity excess per doubling of T_eval away from T_train
EVAL_STEPS = [1, 2, 4, 8]
FAILED_ERROR = "RuntimeError: worker 0 on node 10.0.0.7 died (synthetic)"
PAPER_SPECS = ("fig2a-cpu", "fig3a-cpu", "fig3b-cpu", "fig4-cpu", "gp-table-cpu")


def scaling_spec(seeds: int = 3, lrs: tuple[float, ...] = (LR_OPT,),
                 variants: tuple[str, ...] = ("llama", "cem")) -> ExperimentSpec:
    """A four-size language-model spec (nano, tiny, micro, mini) for the Compare page's fits."""
    kinds = {"llama": {}, "cem": {"attention": "cem", "mlp": "cem"},
             "cem-attn": {"attention": "cem"}, "cem-mlp": {"mlp": "cem"}}
    return parse_spec({
        "name": "scaling-synthetic", "data": {"source": "shakespeare", "vocab_size": 512},
        "sizes": ["nano", "tiny", "micro", "mini"],
        "variants": {v: kinds[v] for v in variants}, "learning_rates": list(lrs),
        "seeds": list(range(seeds)),
        "budget": {"tokens_per_param": 20, "budget_scale": 0.05},
        "training": {"energy_diagnostics": True, "eval_steps": EVAL_STEPS}})


def is_cem(trial: Trial) -> bool:
    return "cem" in (trial.model.attention, trial.model.mlp)


def true_perplexity(trial: Trial, noise: float = 0.0) -> float:
    """The law of the module docstring for a language-model trial."""
    scale = 1 / (1 - CEM_SAVING) if is_cem(trial) else 1.0
    n = trial.params["non_embedding"] * scale
    lr_term = 1 + LR_CURVATURE * math.log2(trial.lr / LR_OPT) ** 2
    return (TRUE_E + TRUE_A * n ** -TRUE_ALPHA * lr_term) * (1 + noise)


def _true_rmse(trial: Trial, noise: float) -> float:
    return 0.16 * (1 + 0.02 * math.log2(trial.model.mlp_steps)) * (1 + noise)


@dataclass(frozen=True)
class Seeded:
    """What ``seed_store`` wrote: trials by experiment and how many of each status."""

    trials: dict[str, list[Trial]]
    failed: dict[str, str]  # experiment -> the failed trial's id
    running: dict[str, str]  # experiment -> the running trial's id

    @property
    def runs(self) -> int:
        return sum(map(len, self.trials.values()))


def _history(trial: Trial, final: float, val: float, points: int) -> list[Metric]:
    """Loss (falling from log(vocab) to log(final)), tokens_seen and validation perplexity."""
    now = int(time.time() * 1000)
    steps = np.unique(np.linspace(1, trial.steps, points).round().astype(int))
    start = math.log(trial.model.vocab_size)
    out = []
    for s in steps:
        loss = math.log(final) + (start - math.log(final)) * math.exp(-5 * s / trial.steps)
        out += [Metric("loss", loss, now, int(s)),
                Metric("tokens_seen", float(s * trial.tokens / trial.steps), now, int(s))]
    for s in steps[points // 4 - 1::max(points // 4, 1)]:
        out.append(Metric("val_perplexity", val * (1 + math.exp(-5 * s / trial.steps)), now,
                          int(s)))
    return out


def _diagnostics(trial: Trial, step: int) -> list[Metric]:
    """Energy falling at every step (deeper layers less), every token's energy falling."""
    now = int(time.time() * 1000)
    out = []
    for name, steps, kind in (("attn", trial.model.attn_steps, trial.model.attention),
                              ("mlp", trial.model.mlp_steps, trial.model.mlp)):
        if kind != "cem":
            continue
        for layer in range(trial.model.n_layer):
            for t in range(steps + 1):
                key = f"layer{layer}/step{t}"
                out.append(Metric(f"energy/{name}/{key}", -1.0 - t / (layer + 1), now, step))
                if t:
                    out.append(Metric(f"energy_fell/{name}/{key}", 1 - 0.05 * layer, now, step))
    return out


def recursion_perplexity(trial: Trial, test: float, t_eval: int, rule: str) -> float:
    """The law of the module docstring for a CEM trial of test perplexity ``test`` at T_eval
    (``rule``: ``kept`` or ``scaled``)."""
    t_train = trial.model.attn_steps if trial.model.attention == "cem" else trial.model.mlp_steps
    cost = RECURSION_COST * (1.0 if rule == "kept" else 0.5)
    return test * (1 + cost * abs(math.log2(t_eval / t_train)))


def _test_time(trial: Trial, test: float) -> list[Metric]:
    now = int(time.time() * 1000)
    return [Metric(f"test_time/T{t}_{rule}/perplexity",
                   recursion_perplexity(trial, test, t, rule), now, trial.steps)
            for t in trial.training.eval_steps for rule in ("kept", "scaled")]


def _final_metrics(trial: Trial, rng: np.random.Generator) -> list[Metric]:
    now = int(time.time() * 1000)
    noise = float(rng.normal(0, NOISE))
    if trial.workload == "gp_regression":
        test = _true_rmse(trial, noise)
        values = {"test_rmse": test, "val_rmse": test * (1 + VAL_OFFSET)}
    else:
        test = true_perplexity(trial, noise)
        values = {"test_perplexity": test, "val_perplexity": test * (1 + VAL_OFFSET),
                  "unigram_test_perplexity": 525.0}
    values.update({"time/startup_s": 10.0, "time/train_s": 60.0, "time/eval_s": 3.0,
                   "time/checkpoint_s": 0.5, "time/teardown_s": 1.5, "time/total_s": 75.0,
                   "time/queue_s": 0.0, "time/first_step_s": 12.0,
                   "train_mfu": 0.05, "peak_memory_mib": 900.0})
    return [Metric(k, v, now, trial.steps) for k, v in values.items()]


def seed_experiment(client: MlflowClient, ledger: Ledger, spec: ExperimentSpec, *,
                    history: int = 20, unfinished: bool = True) -> tuple[list[Trial], str, str]:
    """Write ``spec``'s whole grid as trial runs under one parent run, with the ledger's rows.

    With ``unfinished``, the last trial stays RUNNING (no final metrics) and the one before it
    FAILED with ``FAILED_ERROR``; every other trial is FINISHED with ``_final_metrics``. The
    experiment's Akima optima are stored on the parent run as ``cemlab run`` stores them.
    Returns the trials and the ids of the failed and the running trial ("" without).
    """
    trials = plan(spec)
    exp_id = experiment_id(client, spec.name)
    parent = start_parent_run(client, exp_id, spec, spec.name)
    row_exp = ledger.ensure_experiment(spec.name, spec.workload, "")
    ledger.update_experiment(row_exp.id, mlflow_experiment_id=exp_id, parent_run_id=parent)
    failed = trials[-2].trial_id if unfinished else ""
    running = trials[-1].trial_id if unfinished else ""
    rows = []
    for i, trial in enumerate(trials):
        rng = np.random.default_rng(i)
        run_id = start_trial_run(client, exp_id, parent, trial, spec.workload_impl.section, {})
        row = ledger.ensure_trial(row_exp.id, trial.trial_id, dataset=trial.dataset,
                                  variant=trial.variant, size=trial.size, lr=trial.lr,
                                  seed=trial.seed)
        ledger.update_trial(row.id, mlflow_run_id=run_id, status=Status.RUNNING)
        if trial.trial_id == running:
            client.log_batch(run_id, metrics=_history(trial, 60.0, 66.0, history)[:4])
            continue
        if trial.trial_id == failed:
            ledger.update_trial(row.id, status=Status.FAILED, error=FAILED_ERROR)
            client.set_terminated(run_id, "FAILED")
            continue
        final = _final_metrics(trial, rng)
        metrics = final + (_diagnostics(trial, trial.steps) if is_cem(trial) else [])
        if trial.workload == "language_model":
            values = {m.key: m.value for m in final}
            metrics += _history(trial, values["test_perplexity"], values["val_perplexity"],
                                history)
            if is_cem(trial) and trial.training.eval_steps:
                metrics += _test_time(trial, values["test_perplexity"])
        for start in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[start:start + 1000])
        client.set_terminated(run_id, "FINISHED")
        value = {m.key: m.value for m in final}
        metric = "test_rmse" if trial.workload == "gp_regression" else "test_perplexity"
        rows.append(ledger.update_trial(row.id, status=Status.FINISHED,
                                        metric=value[metric], val_metric=value[
                                            metric.replace("test_", "val_")]))
    table = optima(spec, rows)
    short = "rmse" if spec.workload == "gp_regression" else "perplexity"
    store_on_parent(client, parent, table, short)
    client.set_terminated(parent, "RUNNING" if unfinished else "FINISHED")
    return trials, failed, running


def register_versions(client: MlflowClient, experiment: str, trials: list[Trial]) -> list[str]:
    """Register the best finished trial (lowest validation perplexity) of each (variant, size)
    of ``experiment`` with ``orchestrator.records.model_registry``'s names, tags and ``best``
    alias; the first also gets a ``models eval`` result (``test_perplexity_recomputed``).
    Returns names."""
    from orchestrator.records.model_registry import ALIAS, model_name

    runs = {r.data.tags["cemlab.trial_id"]: r for r in client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id],
        "tags.`cemlab.role` = 'trial' and attributes.status = 'FINISHED'", max_results=5000)}
    best: dict[tuple[str, str], tuple[Trial, object]] = {}
    for t in trials:
        run = runs.get(t.trial_id)
        if run and ((t.variant, t.size) not in best or run.data.metrics["val_perplexity"]
                    < best[t.variant, t.size][1].data.metrics["val_perplexity"]):
            best[t.variant, t.size] = (t, run)
    names = []
    for (variant, size), (t, run) in sorted(best.items()):
        name = model_name(variant, size)
        client.create_registered_model(name, description=f"Best {variant} at size {size}")
        m = run.data.metrics
        version = client.create_model_version(name, f"runs:/{run.info.run_id}/model",
                                               run_id=run.info.run_id, tags={
            "trial_id": t.trial_id, "val_perplexity": repr(m["val_perplexity"]),
            "test_perplexity": repr(m["test_perplexity"]), "experiment": experiment,
            "variant": variant, "size": size, "lr": repr(t.lr), "seed": str(t.seed),
            "params_total": str(t.params["total"]), "tokens": str(t.tokens),
            "params_non_embedding": str(t.params["non_embedding"]),
            "data": t.config.model_dump_json(),
            "context_length": str(t.model.context_length)})
        client.set_registered_model_alias(name, ALIAS, version.version)
        if not names:
            client.set_model_version_tag(name, version.version, "test_perplexity_recomputed",
                                         repr(m["test_perplexity"] * (1 + 1e-5)))
        names.append(name)
    return names


def seed_store(tracking_uri: str, ledger_url: str, *, paper_specs: tuple[str, ...] = PAPER_SPECS,
               scaling_seeds: int = 3, scaling_lrs: tuple[float, ...] = (LR_OPT,),
               scaling_variants: tuple[str, ...] = ("llama", "cem"),
               history: int = 20) -> Seeded:
    """Seed ``paper_specs`` (stems of ``experiments/paper/``, each with one failed and one
    running trial) and the scaling spec (all finished; its best models registered)."""
    client = MlflowClient(tracking_uri)
    ledger = Ledger(ledger_url)
    trials, failed, running = {}, {}, {}
    for stem in paper_specs:
        spec = load_spec(ROOT / "experiments" / "paper" / f"{stem}.yaml")
        trials[spec.name], failed[spec.name], running[spec.name] = seed_experiment(
            client, ledger, spec, history=history)
    spec = scaling_spec(scaling_seeds, scaling_lrs, scaling_variants)
    trials[spec.name], _, _ = seed_experiment(client, ledger, spec, history=history,
                                              unfinished=False)
    register_versions(client, spec.name, trials[spec.name])
    return Seeded(trials, failed, running)


def seeds_for(runs: int, sizes: int = 4, variants: int = 4, lrs: int = 5) -> int:
    """Seeds of the scaling spec that bring the store to about ``runs`` trial runs."""
    paper = sum(len(plan(load_spec(ROOT / "experiments" / "paper" / f"{s}.yaml")))
                for s in PAPER_SPECS)
    return max(1, round((runs - paper) / (sizes * variants * lrs)))


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from dashboards.page_timing import time_pages

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1000, help="trial runs to seed (about)")
    p.add_argument("--history", type=int, default=100, help="points per metric history")
    p.add_argument("--store", help="SQLite file to seed (default: a temporary one)")
    args = p.parse_args(argv)
    path = Path(args.store or Path(tempfile.mkdtemp(prefix="cemlab-bench-")) / "mlflow.db")
    uri = f"sqlite:///{path}"
    start = time.perf_counter()
    seeded = seed_store(uri, uri, scaling_seeds=seeds_for(args.runs),
                        scaling_lrs=(0.002, 0.004, 0.008, 0.016, 0.032),
                        scaling_variants=("llama", "cem", "cem-attn", "cem-mlp"),
                        history=args.history)
    print(f"seeded {seeded.runs} trial runs with {args.history}-point histories into {uri} "
          f"in {time.perf_counter() - start:.0f} s")
    for line in time_pages(uri, uri):
        print(line, flush=True)


if __name__ == "__main__":
    main()
