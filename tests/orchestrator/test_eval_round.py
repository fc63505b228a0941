"""The evaluation round of ``cemlab run``: once the brackets settle, every arm's evaluation seeds
train at the learning rate chosen on its tuning seeds' mean validation, with the plan's trial
ids; the tuning trials keep theirs. (Through a whole ``cemlab run`` on a Ray cluster:
``test_end_to_end.py``'s GP test.)"""

import math
from types import SimpleNamespace

from orchestrator.execution import run
from orchestrator.planning.plan import arm_cells, plan
from orchestrator.planning.spec import parse_spec
from orchestrator.records.ledger import Ledger, Status

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
