"""Results from the ledger: the rows of a spec's current grid, progress by status."""

from orchestrator.ledger import Ledger, Status
from orchestrator.results import experiment_rows, format_status, status_counts
from orchestrator.spec import parse_spec


def test_results_read_the_newest_row_per_grid_point(tmp_path):
    spec = parse_spec({"name": "edited", "sizes": ["nano"], "variants": {"llama": {}},
                       "learning_rates": [0.002, 0.004]})
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment("edited", "language_model", "")
    point = {"dataset": "shakespeare", "variant": "llama", "size": "nano", "seed": 0}
    old = ledger.ensure_trial(exp.id, "old", lr=0.002, **point)
    new = ledger.ensure_trial(exp.id, "new", lr=0.002, **point)  # same point, edited science
    other = ledger.ensure_trial(exp.id, "other", lr=0.004, **point)
    ledger.ensure_trial(exp.id, "off-grid", lr=0.008, **point)
    assert [r.id for r in experiment_rows(spec, ledger)] == [new.id, other.id]
    assert [r.id for r in experiment_rows(spec, ledger, {"old"})] == [old.id]


def test_status_counts_and_progress_come_from_the_ledger(tmp_path):
    spec = parse_spec({"name": "progress", "sizes": ["nano"], "variants": {"llama": {}},
                       "learning_rates": [0.001, 0.002, 0.004]})
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment("progress", "language_model", "")
    point = {"dataset": "shakespeare", "variant": "llama", "size": "nano", "seed": 0}
    done = ledger.ensure_trial(exp.id, "a", lr=0.001, **point)
    ledger.update_trial(done.id, status=Status.FINISHED, metric=123.25)
    running = ledger.ensure_trial(exp.id, "b", lr=0.002, **point)
    ledger.update_trial(running.id, status=Status.RUNNING)
    rows = experiment_rows(spec, ledger)
    assert status_counts(rows) == {Status.PENDING: 0, Status.RUNNING: 1, Status.FINISHED: 1,
                                   Status.FAILED: 0}
    text = format_status(spec, rows, planned=3)
    assert text.splitlines()[0] == ("experiment progress: 3 trial(s) planned, 0 pending, "
                                    "1 running, 1 finished, 0 failed, 1 not yet submitted")
    assert "123.25" in text and "RUNNING" in text
