"""The evaluation round of ``cemlab run``: once the brackets settle, every arm's evaluation seeds
train at the learning rate chosen on its tuning seeds' mean validation, with the plan's trial
ids; the tuning trials keep theirs."""

import math
import statistics
from types import SimpleNamespace

import pytest

from orchestrator.execution import run
from orchestrator.planning.plan import arm_cells, plan
from orchestrator.planning.spec import parse_spec
from orchestrator.records.ledger import Ledger, Status
from tests.conftest import RAY_CLUSTER
from tests.orchestrator.conftest import orchestrator, write_spec

GRID = {"grid": [0.001, 0.002, 0.004], "max_points": 5}
BASE = {"name": "evalround", "sizes": ["nano"], "seeds": [0, 1],
        "variants": {"llama": {}, "cem": {"attention": "cem"}}}


def test_the_evaluation_round_trains_fresh_seeds_at_each_arms_chosen_lr(tmp_path, capsys):
    plain = parse_spec({**BASE, "learning_rates": GRID})
    spec = parse_spec({**BASE, "learning_rates": {**GRID, "eval_seeds": [7, 8]}})
    assert [t.trial_id for t in plan(spec)] == [t.trial_id for t in plan(plain)]
    cells = arm_cells(spec)
    cem = ("shakespeare", "cem", "nano")
    added = [cells[cem](0.008, seed) for seed in spec.seeds]  # a round went past 0.004
    trials = plan(spec) + added
    best = {"llama": 0.002, "cem": 0.02}  # cem's optimum lies beyond the bracket's reach
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment(spec.name, spec.workload, "")
    for t in trials:
        row = ledger.ensure_trial(exp.id, t.trial_id, dataset=t.dataset, variant=t.variant,
                                  size=t.size, lr=t.lr, seed=t.seed,
                                  lr_round=1 if t in added else None)
        val = 50 * (1 + math.log2(t.lr / best[t.variant]) ** 2 / 10) * (1 + 0.01 * t.seed)
        ledger.update_trial(row.id, status=Status.FINISHED, val_metric=val, metric=val)
    books = SimpleNamespace(ledger=ledger, experiment_row_id=exp.id)
    new = run.eval_trials(spec, trials, SimpleNamespace(data=None), books)
    assert [(t.variant, t.lr, t.seed) for t in new] == [
        ("cem", 0.008, 7), ("cem", 0.008, 8), ("llama", 0.002, 7), ("llama", 0.002, 8)]
    assert [t.trial_id for t in new] == [cells[("shakespeare", t.variant, "nano")](
        t.lr, t.seed).trial_id for t in new]
    out = capsys.readouterr().out
    assert ("evaluation round: cem@nano (shakespeare) chose learning rate 0.008 on 2 tuning "
            "seed(s) (at the edge of its learning rates: no optimum, the bracket could not pass "
            "it): training seed(s) 7, 8 there") in out
    assert run.eval_trials(plain, trials, SimpleNamespace(data=None), books) == []


@pytest.mark.slow
@RAY_CLUSTER
def test_a_run_trains_the_evaluation_seeds_after_its_brackets_settle(services, tmp_path):
    """GP regression through ``cemlab run``: a bracket of two learning rates extends once, then
    each arm's evaluation seeds train at the learning rate its tuning seeds' mean validation
    chose; ``cemlab seeds`` prints their spread."""
    _, env = services
    spec = {"name": "gp-evals", "workload": "gp_regression",
            "gp": {"kernels": ["rbf"], "n_train": 512, "n_val": 64, "n_test": 128,
                   "steps": 150},
            "sizes": ["gp-small"], "variants": {"t1": {"mlp_steps": 1}},
            "learning_rates": {"grid": [0.002, 0.004], "max_points": 3, "eval_seeds": [7, 8]},
            "seeds": [0, 1], "training": {"batch_size": 64, "eval_interval": 50},
            "resources": {"num_workers": 1}}
    path = write_spec(tmp_path, spec)
    proc = orchestrator(env, "run", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ledger = Ledger(env["CEMLAB_LEDGER_URL"])
    rows = ledger.trials(ledger.experiment("gp-evals").id)
    assert {r.status for r in rows} == {Status.FINISHED}
    tune = [r for r in rows if r.seed in (0, 1)]
    lrs = sorted({r.lr for r in tune})
    assert len(lrs) == 3  # the grid and the point its round added
    means = {lr: statistics.fmean(math.log(r.val_metric) for r in tune if r.lr == lr)
             for lr in lrs}
    chosen = min(means, key=means.get)
    evals = sorted((r.seed, r.lr) for r in rows if r.seed in (7, 8))
    assert evals == [(7, chosen), (8, chosen)]
    assert (f"evaluation round: t1@gp-small (gp-rbf) chose learning rate {chosen:g} on 2 "
            "tuning seed(s)") in proc.stdout
    seeds = orchestrator(env, "seeds", str(path))
    assert seeds.returncode == 0, seeds.stderr[-2000:]
    logs = [math.log(r.metric) for r in rows if r.seed in (7, 8)]
    assert f"{100 * statistics.stdev(logs):.2f}%" in seeds.stdout
    assert "2 evaluation" in seeds.stdout
