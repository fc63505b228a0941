"""The claims report: claims name real variants, intervals follow the t formula, verdicts follow
the intervals, and REPORT.md with its figures is written from a real ledger."""

import math
import statistics
from pathlib import Path

import pytest
from scipy.stats import t as student_t

from orchestrator.claims import CLAIMS, Claim, Comparison
from orchestrator.cli import main
from orchestrator.ledger import Ledger, Status
from orchestrator.report import (
    CONTRADICTS,
    INCONCLUSIVE,
    NOT_RUN,
    SUPPORTS,
    claim_spec_path,
    combine,
    confidence_interval,
    evaluate,
    missing_trials,
    verdict,
    write_report,
)
from orchestrator.spec import load_spec, parse_spec

PAPER = Path(__file__).resolve().parents[2] / "experiments" / "paper"
LRS = [0.001, 0.002, 0.004]


@pytest.mark.parametrize("scale", ["cpu", "paper"])
def test_every_claim_compares_variants_of_its_spec(scale):
    for claim in CLAIMS:
        spec = load_spec(claim_spec_path(PAPER, claim, scale))
        for comparison in claim.comparisons:
            assert set(comparison.arms) <= set(spec.variants), (claim.key, comparison)


def test_the_interval_is_the_student_t_interval_of_the_mean():
    xs = [0.031, -0.004, 0.012, 0.020]
    n, mean, sd = len(xs), statistics.fmean(xs), statistics.stdev(xs)
    half = student_t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    low, high = confidence_interval(xs)
    assert low == pytest.approx(mean - half, rel=1e-9)
    assert high == pytest.approx(mean + half, rel=1e-9)
    assert confidence_interval([0.1]) is None
    assert confidence_interval([0.1, 0.1]) == (0.1, 0.1)


def test_verdicts_follow_the_interval_and_the_margin():
    better, within = Comparison("a", "b"), Comparison("a", "b", "not_worse", 0.05)
    assert verdict(better, (-0.03, -0.01)) == SUPPORTS
    assert verdict(better, (0.01, 0.03)) == CONTRADICTS
    assert verdict(better, (-0.01, 0.01)) == INCONCLUSIVE
    assert verdict(better, None) == INCONCLUSIVE
    assert verdict(within, (0.01, 0.04)) == SUPPORTS  # worse, but by less than 5 %
    assert verdict(within, (0.06, 0.09)) == CONTRADICTS
    assert verdict(within, (0.03, 0.07)) == INCONCLUSIVE
    assert combine([SUPPORTS, SUPPORTS]) == SUPPORTS
    assert combine([SUPPORTS, INCONCLUSIVE]) == INCONCLUSIVE
    assert combine([SUPPORTS, CONTRADICTS]) == CONTRADICTS
    assert combine([]) == NOT_RUN


def _seed_ledger(tmp_path, spec, offsets: dict[str, list[float]]) -> Ledger:
    """Finished rows: validation perplexity 100 * (1 + offset) * (1 + (log2 lr/0.002)^2 / 10)
    (its optimum at LR 0.002), test = 1.02 x validation."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment(spec.name, "language_model", "")
    for variant, per_seed in offsets.items():
        for seed, offset in enumerate(per_seed):
            for lr in LRS:
                val = 100 * (1 + offset) * (1 + math.log2(lr / 0.002) ** 2 / 10)
                row = ledger.ensure_trial(exp.id, f"{variant}-{seed}-{lr}", dataset="shakespeare",
                                          variant=variant, size="nano", lr=lr, seed=seed)
                ledger.update_trial(row.id, status=Status.FINISHED, val_metric=val,
                                    metric=1.02 * val)
    return ledger


def test_effects_are_paired_by_seed_at_the_lr_chosen_on_validation(tmp_path):
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2],
                       "variants": {"llama": {}, "cem-attn": {"attention": "cem"}},
                       "learning_rates": LRS})
    ledger = _seed_ledger(tmp_path, spec, {"llama": [0.0, 0.1, -0.05],
                                           "cem-attn": [0.03, 0.13, -0.02]})
    claim = Claim("x", "CEM within 5 %", "quote", "Sec. 0", "fig0",
                  (Comparison("cem-attn", "llama", "not_worse", 0.05),
                   Comparison("cem-attn", "llama")))
    result = evaluate(claim, spec, ledger)
    within, better = result.effects
    # Independently: the optimum is LR 0.002 for every seed, so the effect is the offsets' ratio.
    expected = [1.03 / 1.0 - 1, 1.13 / 1.1 - 1, 0.98 / 0.95 - 1]
    assert within.seeds == (0, 1, 2)
    assert within.per_seed == pytest.approx(expected, rel=1e-6)
    assert within.verdict == SUPPORTS  # about +2.8 % +- 0.4 %: below the 5 % margin
    assert better.verdict == CONTRADICTS  # and surely worse than Llama
    assert result.verdict == CONTRADICTS
    assert [a["variant"] for a in result.arms] == ["cem-attn", "llama"]
    assert result.arms[1]["LR (val)"].startswith("2.00e-03")
    # A seed one arm lacks is left out of the pairs.
    for row in ledger.trials(1)[:3]:  # llama, seed 0, every LR
        ledger.update_trial(row.id, status=Status.FAILED)
    assert evaluate(claim, spec, ledger).effects[0].seeds == (1, 2)
    assert len(missing_trials(spec, ledger)) == 3
    # A seed whose grid is part-finished is left out too, and said: on LRs {0.001, 0.002}
    # alone, the optimum would sit at the edge 0.002 and be compared as if chosen on the grid.
    cem_seed_1 = [r for r in ledger.trials(1) if r.variant == "cem-attn" and r.seed == 1]
    ledger.update_trial(cem_seed_1[-1].id, status=Status.RUNNING)  # LR 0.004 not finished
    partial = evaluate(claim, spec, ledger)
    assert partial.effects[0].seeds == (2,)
    assert partial.incomplete == ("cem-attn@nano (shakespeare) seed 1: 2 of 3 learning rates "
                                  "finished, left out",)
    path = write_report([partial], tmp_path / "out", "cpu", "experiments/paper/")
    assert "- Incomplete: cem-attn@nano (shakespeare) seed 1: 2 of 3" in path.read_text()


def test_the_report_and_its_figures_are_written(tmp_path):
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2],
                       "variants": {"llama": {}, "cem-attn": {"attention": "cem"}},
                       "learning_rates": LRS})
    ledger = _seed_ledger(tmp_path, spec, {"llama": [0.0, 0.0, 0.0],
                                           "cem-attn": [-0.1, -0.12, -0.11]})
    done = evaluate(Claim("x", "CEM beats Llama", "It does.", "Sec. 0", "fig0",
                          (Comparison("cem-attn", "llama"),)), spec, ledger)
    empty = evaluate(Claim("y", "Nothing yet", "Later.", "Sec. 1", "fig1",
                           (Comparison("a", "b"),)), spec, ledger)
    path = write_report([done, empty], tmp_path / "out", "cpu", "experiments/paper/")
    text = path.read_text()
    assert "| (x) CEM beats Llama | **supports** | Sec. 0 |" in text
    assert "| (y) Nothing yet | **not run** | Sec. 1 |" in text
    assert "> It does. (Sec. 0)" in text and "-11.0% ± 1.0%" in text
    assert "python -m orchestrator run experiments/paper/claims.yaml" in text
    assert (tmp_path / "out" / "claim-x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "out" / "claim-y.png").exists()


def test_report_without_runs_marks_every_claim_not_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CEMLAB_HOME", str(tmp_path / "home"))
    assert main(["report", str(PAPER), "--no-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"claims report: {len(CLAIMS)} claims over {len(CLAIMS)} specs" in out
    text = (tmp_path / "out" / "REPORT.md").read_text()
    assert text.count("**not run**") == 2 * len(CLAIMS)  # the table and each section
    assert not list((tmp_path / "out").glob("*.png"))


def test_report_of_a_directory_without_the_specs_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--no-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: claim (a) needs {tmp_path / 'fig2a-cpu.yaml'}, which does not exist"]
