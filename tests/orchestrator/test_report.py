"""The claims report: claims name real variants, intervals follow the t formula, verdicts follow
the intervals, and REPORT.md with its figures is written from a real ledger."""

import datetime as dt
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from scipy.stats import t as student_t

from orchestrator.claims import CLAIM_SETS, CLAIMS, Claim, ClaimSet, Comparison
from orchestrator.cli import main
from orchestrator.ledger import Ledger, Status
from orchestrator.report import (
    TITLE_CHAR_EM,
    TITLE_POINTS,
    claim_spec_path,
    evaluate,
    figure,
    ladder_figure,
    lr_protocol,
    missing_trials,
    setup,
    title_chars,
    wrap_title,
    write_report,
)
from orchestrator.spec import load_spec, parse_spec
from orchestrator.verdicts import (
    CONTRADICTS,
    EQUIVALENT,
    MIXED,
    NOT_RUN,
    SUPPORTS,
    UNDERPOWERED,
    Sample,
    combine,
    holm_levels,
    verdict,
)

PAPER = Path(__file__).resolve().parents[2] / "experiments" / "paper"
STUDIES = PAPER.parent / "studies"
LRS = [0.001, 0.002, 0.004]


@pytest.mark.parametrize(("claims", "directory", "scale"), [
    ("paper", PAPER, "cpu"), ("paper", PAPER, "paper"), ("recursion", STUDIES, "cpu"),
    ("recursion-options", STUDIES, "cpu")])
def test_every_claim_compares_variants_of_its_spec(claims, directory, scale):
    claim_set = CLAIM_SETS[claims]
    assert set(claim_set.ladder) <= {c.key for c in claim_set.claims}
    assert len({c.key for c in claim_set.claims}) == len(claim_set.claims)
    for claim in claim_set.claims:
        spec = load_spec(claim_spec_path(directory, claim, scale))
        for comparison in claim.comparisons:
            assert comparison.variants <= set(spec.variants), (claim.key, comparison)
            for arm in comparison.arms:  # a test-time arm's T_eval is one the spec evaluates
                if "@" in arm:
                    t_eval = int(arm.split("@")[1].split("_")[0].removeprefix("T"))
                    assert t_eval in spec.training.eval_steps, (claim.key, arm)


def test_the_recursion_ladder_differs_only_in_training_tokens():
    """The ladder's specs train the same T=1 / T=2 models on budgets 1x, 4x and 16x."""
    claim_set = CLAIM_SETS["recursion"]
    by_key = {c.key: c for c in claim_set.claims}
    specs = [load_spec(claim_spec_path(STUDIES, by_key[k], "cpu")) for k in claim_set.ladder]
    for arm in ("t1", "t2"):
        assert len({s.variants[arm].resolve("tiny") for s in specs}) == 1
    scales = [s.budget.budget_scale for s in specs]
    assert [x / scales[0] for x in scales] == [1, 4, 16]


def test_the_interval_and_p_value_are_student_t_of_the_mean():
    xs = (0.031, -0.004, 0.012, 0.020)
    n, mean, sd = len(xs), statistics.fmean(xs), statistics.stdev(xs)
    se = sd / math.sqrt(n)
    for alpha in (0.05, 0.0125):
        half = student_t.ppf(1 - alpha / 2, n - 1) * se
        low, high = Sample(xs, 0.0, 0.01).interval(alpha)
        assert low == pytest.approx(mean - half, rel=1e-9)
        assert high == pytest.approx(mean + half, rel=1e-9)
    assert Sample(xs, 0.0, 0.01).p_value() == pytest.approx(
        2 * student_t.sf(mean / se, n - 1), rel=1e-9)
    assert Sample(xs, 0.05, 0.01).p_value() == pytest.approx(
        2 * student_t.sf((0.05 - mean) / se, n - 1), rel=1e-9)
    assert Sample((0.1,), 0.0, 0.01).interval(0.05) is None
    assert Sample((0.1, 0.1), 0.0, 0.01).interval(0.05) == (0.1, 0.1)


def test_holm_steps_down_until_the_first_test_it_keeps():
    # sorted: 0.001 <= 0.05/4, 0.011 <= 0.05/3, 0.03 > 0.05/2: stop; 0.04 keeps that level
    assert holm_levels([0.03, 0.001, 0.04, 0.011]) == pytest.approx(
        [0.025, 0.0125, 0.025, 0.05 / 3])
    assert holm_levels([0.5]) == [0.05]
    assert holm_levels([]) == []


def test_the_five_verdicts_follow_the_intervals_the_margins_and_the_sizes():
    def test(mean, spread, threshold=0.0, margin=0.01, n=5):
        return Sample(tuple(mean + spread * d for d in (-2, -1, 0, 1, 2)[:n]), threshold, margin)

    assert verdict(test(-0.05, 0.002), 0.05) == SUPPORTS
    assert verdict(test(0.05, 0.002), 0.05) == CONTRADICTS
    assert verdict(test(0.0002, 0.0005), 0.05) == EQUIVALENT  # straddles 0, inside ±1 %
    assert verdict(test(0.001, 0.02), 0.05) == UNDERPOWERED  # straddles 0, wider than ±1 %
    assert verdict(test(-0.05, 0.002, n=1), 0.05) == UNDERPOWERED  # one seed: no interval
    assert verdict(test(0.03, 0.002, threshold=0.05), 0.05) == SUPPORTS  # worse, by < 5 %
    assert verdict(test(0.07, 0.002, threshold=0.05), 0.05) == CONTRADICTS
    # a stricter Holm level widens the interval: the same effects, no longer decided
    assert verdict(test(-0.01, 0.004), 0.05) == SUPPORTS
    assert verdict(test(-0.01, 0.004), 0.001) == UNDERPOWERED
    assert combine([SUPPORTS, SUPPORTS]) == SUPPORTS
    assert combine([EQUIVALENT]) == EQUIVALENT
    assert combine([SUPPORTS, CONTRADICTS]) == MIXED  # the sizes disagree
    assert combine([SUPPORTS, EQUIVALENT, UNDERPOWERED]) == MIXED
    assert combine([SUPPORTS, UNDERPOWERED]) == SUPPORTS  # the decided ones agree
    assert combine([UNDERPOWERED, UNDERPOWERED]) == UNDERPOWERED  # none decided
    assert combine([]) == NOT_RUN


def _seed_ledger(tmp_path, spec, offsets: dict[str, list[float]]) -> Ledger:
    """Finished rows: validation perplexity 100 * (1 + offset) * (1 + (log2 lr/0.002)^2 / 10)
    (its optimum at LR 0.002), test = 1.02 x validation, at every LR of ``spec``."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment(spec.name, "language_model", "")
    for variant, per_seed in offsets.items():
        for seed, offset in enumerate(per_seed):
            for lr in spec.learning_rates:
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
    assert within.nearest == pytest.approx(expected, rel=1e-6)  # 0.002 was trained
    assert within.verdict == SUPPORTS  # about +2.8 % +- 0.4 %: below the 5 % margin
    assert better.verdict == CONTRADICTS  # and surely worse than Llama
    assert result.verdict == MIXED  # within 5 %, yet worse: the comparisons disagree
    # Holm over the two: the smaller p (better's, far from 0) at 0.025, the other at 0.05
    assert sorted([within.alpha, better.alpha]) == pytest.approx([0.025, 0.05])
    assert [a["variant"] for a in result.arms] == ["cem-attn", "llama"]
    assert result.arms[1]["LR (val)"].startswith("2.00e-03")
    assert result.arms[1]["at grid edge"] == "0 of 3" and result.at_edge == ()
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
                                  "finished (not 0.004), left out",
                                  "llama@nano (shakespeare) seed 0: every learning rate "
                                  "diverged, left out")
    path = write_report([partial], tmp_path / "out", "cpu", "experiments/paper/")
    assert "- Incomplete: cem-attn@nano (shakespeare) seed 1: 2 of 3" in path.read_text()


def _test_time_study(tmp_path):
    """A CEM arm trained at T = 2 over ``LRS`` and 3 seeds, each trial's MLflow run (a SQLite
    store in ``tmp_path``) holding its test perplexity at T_eval = 2 and, 3 % better at every
    LR, at T_eval = 4: returns the spec, the ledger and the MLflow client."""
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2],
                       "variants": {"cem": {"attention": "cem", "attn_steps": 2}},
                       "learning_rates": LRS})
    ledger = _seed_ledger(tmp_path, spec, {"cem": [0.0, 0.1, -0.05]})
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp_id = client.create_experiment("claims")
    for row in ledger.trials(1):
        run_id = client.create_run(exp_id).info.run_id
        client.log_metric(run_id, "test_time/T2_kept/perplexity", row.metric)
        client.log_metric(run_id, "test_time/T4_scaled/perplexity", 0.97 * row.metric)
        ledger.update_trial(row.id, mlflow_run_id=run_id)
    return spec, ledger, client


def test_a_test_time_arm_reads_the_trained_model_nearest_the_chosen_lr_from_mlflow(tmp_path):
    spec, ledger, client = _test_time_study(tmp_path)
    claim = Claim("j", "More steps at test time", "quote", "Sec. 0", "fig0",
                  (Comparison("cem@T4_scaled", "cem@T2_kept"), Comparison("cem@T8_kept", "cem")))
    result = evaluate(claim, spec, ledger, lambda run_id: client.get_run(run_id).data.metrics)
    (effect,) = result.effects  # T8 was never evaluated: that comparison has no seeds
    assert effect.seeds == (0, 1, 2) and effect.per_seed == pytest.approx([-0.03] * 3)
    assert effect.verdict == SUPPORTS
    # the values are the trained model's at LR 0.002 (the validation optimum), not interpolated
    trained = {r.seed: r.metric for r in ledger.trials(1) if r.lr == 0.002}
    assert result.tests[("shakespeare", "nano", "cem@T2_kept")] == [trained[s] for s in range(3)]
    row = next(a for a in result.arms if a["variant"] == "cem@T4_scaled")
    assert row["LR (val)"].startswith("2.00e-03") and row["seeds"] == 3
    assert evaluate(claim, spec, ledger).effects == ()  # no MLflow: no test-time seeds


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
    stale = tmp_path / "out" / "claim-y.png"  # drawn by an earlier report of claim (y)
    stale.parent.mkdir()
    stale.write_bytes(b"\x89PNG\r\n\x1a\n earlier")
    path = write_report([done, empty], tmp_path / "out", "cpu", "experiments/paper/")
    text = path.read_text()
    grid = f"own optimum on {LRS[0]:g}..{LRS[-1]:g} ({len(LRS)})"
    assert f"| (x) CEM beats Llama | **supports** | {grid} | Sec. 0 |" in text
    assert f"| (y) Nothing yet | **not run** | {grid} | Sec. 1 |" in text
    assert (f"Spec `claims`; verdict **supports** (1 of 1 comparisons decided); learning rate: "
            f"{grid}.") in text
    assert "> It does. (Sec. 0)" in text and "-11.0% [" in text
    assert "`cemlab run experiments/paper/claims.yaml`" in text
    assert (tmp_path / "out" / "claim-x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "out" / "claim-y.png").exists()


def test_the_report_states_data_seeds_budget_fraction_trials_and_wall(tmp_path):
    base = {"name": "claims", "seeds": [0, 1, 2], "learning_rates": LRS,
            "variants": {"llama": {}, "cem-attn": {"attention": "cem"}}}
    equal = parse_spec({**base, "sizes": ["nano"], "budget": {"budget_scale": 0.25}})
    ledger = _seed_ledger(tmp_path, equal, {"llama": [0.0] * 3, "cem-attn": [0.01] * 3})
    start = dt.datetime(2026, 1, 1, 8, 0)
    for i, row in enumerate(ledger.trials(1)):  # 18 trials, one every 10 minutes, 5 min each
        ledger.update_trial(row.id, started_at=start + dt.timedelta(minutes=10 * i),
                            finished_at=start + dt.timedelta(minutes=10 * i + 5))
    claim = Claim("x", "CEM within 5 %", "quote", "Sec. 0", "fig0",
                  (Comparison("cem-attn", "llama", "not_worse", 0.05),))
    text = write_report([evaluate(claim, equal, ledger)], tmp_path / "out", "cpu",
                        "experiments/paper/").read_text()
    assert ("Setup: data shakespeare; every size (nano) on 0.25 of its Chinchilla budget (20 "
            "tokens per parameter); 3 seeds per arm; 18 distinct trials finished, 2.9 h from "
            "the first start to the last finish.") in text  # 17 x 10 min + 5 min
    unequal = parse_spec({**base, "sizes": ["nano", "tiny"],
                          "budget": {"budget_scale": {"nano": 1.0, "tiny": 0.25}}})
    line = setup([evaluate(claim, unequal, Ledger(f"sqlite:///{tmp_path / 'empty.db'}"))])
    assert line == ("Setup: data shakespeare; budget fractions differ by size, so size stands "
                    "in for budget: nano 1, tiny 0.25; 3 seeds per arm; 0 distinct trials "
                    "finished.")
    gp = parse_spec({"name": "gp", "workload": "gp_regression", "sizes": ["gp-small"],
                     "variants": {"t1": {}}, "seeds": [0, 1, 2, 3, 4, 5, 6],
                     "learning_rates": LRS})
    idle = evaluate(Claim("y", "GP", "quote", "Sec. 1", "gp", (Comparison("t1", "t1"),)), gp,
                    ledger)
    both = setup([evaluate(claim, equal, ledger), idle])  # (y) has no finished trial
    assert both.startswith("Setup: data shakespeare; every size (nano) on 0.25")
    assert "; 3 seeds per arm; 18 distinct" in both
    assert both.endswith(" Claims not run yet: (y).")


def test_the_report_says_how_each_claim_sets_its_learning_rates():
    base = {"name": "claims", "sizes": ["nano"], "variants": {"llama": {}}}
    assert lr_protocol(parse_spec({**base, "learning_rates": [0.002]})) == (
        "fixed at 0.002 (not chosen)")
    assert lr_protocol(parse_spec({**base, "learning_rates": [0.001, 0.002, 0.004]})) == (
        "own optimum on 0.001..0.004 (3)")
    assert lr_protocol(parse_spec({**base, "learning_rates": {
        "grid": [0.001, 0.002, 0.004], "max_points": 6}})) == (
        "own optimum on 0.001..0.004 (3), adapting to 6")


def test_report_without_runs_marks_every_claim_not_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CEMLAB_HOME", str(tmp_path / "home"))
    assert main(["report", str(PAPER), "--no-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    specs = len({c.figure for c in CLAIMS})  # (j) reads (e)'s spec again
    assert f"claims report: {len(CLAIMS)} claims over {specs} specs" in out
    text = (tmp_path / "out" / "REPORT.md").read_text()
    assert text.count("**not run**") == 2 * len(CLAIMS)  # the table and each section
    assert not list((tmp_path / "out").glob("*.png"))


def test_report_of_a_directory_without_the_specs_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--no-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: claim (a) needs {tmp_path / 'fig2a-cpu.yaml'}, which does not exist"]


def test_a_token_ladder_draws_each_arm_against_its_specs_tokens(tmp_path):
    """Two specs that differ only in tokens: the ladder figure and its link in REPORT.md; each
    arm's tests are its seeds' test perplexities at the chosen LR (1.02 x 100 x (1 + offset))."""
    def spec(name, tokens):
        return parse_spec({"name": name, "sizes": ["nano"], "seeds": [0, 1],
                           "variants": {"t1": {"attention": "cem"},
                                        "t2": {"attention": "cem", "attn_steps": 2}},
                           "learning_rates": [0.002], "budget": {"tokens": tokens}})

    short, long = spec("short", 20480), spec("long", 81920)
    claims = [Claim(k, f"T=2 beats T=1 on {s.name}", "q", "Sec. 4", s.name,
                    (Comparison("t2", "t1"),)) for k, s in (("x1", short), ("x4", long))]
    results = []
    for claim, s, t2 in ((claims[0], short, [0.1, 0.2]), (claims[1], long, [-0.1, -0.2])):
        ledger = _seed_ledger(tmp_path, s, {"t1": [0.0, 0.0], "t2": t2})  # one ledger
        results.append(evaluate(claim, s, ledger))
    assert results[1].tests[("shakespeare", "nano", "t2")] == pytest.approx([91.8, 81.6])
    assert results[0].effects[0].per_seed == pytest.approx([0.1, 0.2])
    assert not ladder_figure(results[:1], tmp_path / "one.png")  # one budget: no ladder
    assert not (tmp_path / "one.png").exists()
    ladder = ClaimSet("study", "A study", tuple(claims), ladder=("x1", "x4"))
    path = write_report(results, tmp_path / "out", "cpu", "experiments/studies/", ladder)
    text = path.read_text()
    assert text.startswith("# A study at CPU scale")
    assert "![tokens](ladder.png)" in text
    assert (tmp_path / "out" / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


LONG_TITLE = ("More recursion steps at test time lower perplexity on every corpus, every size "
              "and every seed trained (the paper's future work, Sec. 5, against Llama)")


def test_a_long_title_wraps_to_lines_that_fit_the_figure_width():
    for width_in in (7.0, 8.0):
        chars = title_chars(width_in)
        # a line of `chars` characters at the widest average character fits across the figure
        assert chars * TITLE_CHAR_EM * TITLE_POINTS <= width_in * 72
        lines = wrap_title(LONG_TITLE, width_in).splitlines()
        assert len(lines) >= 2 and max(len(line) for line in lines) <= chars
        assert " ".join(lines) == LONG_TITLE  # broken at spaces, nothing lost
    assert wrap_title("(x) Short: supports", 8.0) == "(x) Short: supports"
    with pytest.raises(ValueError, match="must be positive"):
        title_chars(0.0)


def test_a_long_claim_title_is_drawn_inside_the_png(tmp_path):
    """The claim's figure with a title far wider than one line: no ink in the PNG's outermost
    pixel columns (a title cut at the edge leaves its letters there)."""
    from matplotlib.image import imread

    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2],
                       "variants": {"llama": {}, "cem-attn": {"attention": "cem"}},
                       "learning_rates": LRS})
    ledger = _seed_ledger(tmp_path, spec, {"llama": [0.0, 0.0, 0.0],
                                           "cem-attn": [-0.1, -0.12, -0.11]})
    result = evaluate(Claim("x", LONG_TITLE, "q", "Sec. 0", "fig0",
                            (Comparison("cem-attn", "llama"),)), spec, ledger)
    figure(result, tmp_path / "claim-x.png")
    ink = imread(tmp_path / "claim-x.png")[..., :3].min(axis=2) < 0.9  # (H, W): not white
    assert ink.any()
    assert not ink[:, :3].any() and not ink[:, -3:].any()


def _effects_ledger(tmp_path, spec, effects: dict[str, list[float]]) -> Ledger:
    """``_seed_ledger`` with llama's offsets 0, 0.1, -0.05, ... and each other variant's set
    so that its effect against llama at the validation optimum is exactly ``effects[v][seed]``."""
    n = len(next(iter(effects.values())))
    base = [(0.0, 0.1, -0.05)[s % 3] for s in range(n)]
    return _seed_ledger(tmp_path, spec, {"llama": base, **{
        v: [(1 + b) * (1 + e) - 1 for b, e in zip(base, es, strict=True)]
        for v, es in effects.items()}})


def test_holm_takes_an_equivalence_comparisons_tost_p(tmp_path):
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2],
                       "variants": {"llama": {}, "same": {"attention": "cem"},
                                    "lower": {"mlp": "cem"}}, "learning_rates": LRS})
    same, lower = [0.001, -0.001, 0.0005], [-0.05, -0.03, -0.07]
    ledger = _effects_ledger(tmp_path, spec, {"same": same, "lower": lower})
    claim = Claim("x", "x", "q", "Sec. 0", "fig0",
                  (Comparison("same", "llama", "equivalent"), Comparison("lower", "llama")))
    eq, better = evaluate(claim, spec, ledger).effects
    # independently: TOST's p of `same` (±1 %) and the t-test's p of `lower`
    se = statistics.stdev(same) / math.sqrt(3)
    p_tost = max(student_t.sf((statistics.fmean(same) + 0.01) / se, 2),
                 student_t.cdf((statistics.fmean(same) - 0.01) / se, 2))
    p_lower = 2 * student_t.sf(abs(statistics.fmean(lower)) / (statistics.stdev(lower)
                                                                / math.sqrt(3)), 2)
    assert p_tost < 0.025 < p_lower <= 0.05  # Holm: TOST first at 0.025, then 0.05
    assert (eq.alpha, better.alpha) == pytest.approx((0.025, 0.05))
    assert eq.verdict == SUPPORTS and eq.coverage == pytest.approx(0.95)  # TOST's 1 - 2 alpha


def _row(ledger, exp_id, variant, seed, lr, status=Status.FINISHED, val=None, lr_round=None):
    row = ledger.ensure_trial(exp_id, f"{variant}-{seed}-{lr}", dataset="shakespeare",
                              variant=variant, size="nano", lr=lr, seed=seed, lr_round=lr_round)
    val = 100 * (1 + math.log2(lr / 0.002) ** 2 / 10) if val is None else val
    ledger.update_trial(row.id, status=status, val_metric=val, metric=1.02 * val)


def test_every_seed_needs_the_lrs_a_bracket_added_and_a_diverged_lr_keeps_its_seed(tmp_path):
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2, 3],
                       "variants": {"llama": {}}, "learning_rates": {"grid": LRS,
                                                                     "max_points": 5}})
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment(spec.name, "language_model", "")
    for seed in range(4):
        for lr in LRS:
            diverged = seed == 1 and lr == 0.004
            _row(ledger, exp.id, "llama", seed, lr, val=math.nan if diverged else None)
        # a bracket's round added 0.008 for every seed; seed 2's trial has not run yet, seed 3's
        # failed (counted as diverged)
        status = {2: Status.PENDING, 3: Status.FAILED}.get(seed, Status.FINISHED)
        _row(ledger, exp.id, "llama", seed, 0.008, status, lr_round=1)
    claim = Claim("x", "x", "q", "Sec. 0", "fig0", (Comparison("llama", "llama"),))
    result = evaluate(claim, spec, ledger)
    assert result.effects[0].seeds == (0, 1, 3)  # seed 2 lacks the added LR; 1 and 3 stay
    assert result.incomplete == ("llama@nano (shakespeare) seed 2: 3 of 4 learning rates "
                                 "finished (not 0.008), left out",)
    assert result.diverged == (
        "llama@nano (shakespeare) seed 1: learning rate 0.004 diverged, counted as infinite "
        "validation loss (never chosen)",
        "llama@nano (shakespeare) seed 3: learning rate 0.008 diverged, counted as infinite "
        "validation loss (never chosen)")
    text = write_report([result], tmp_path / "out", "cpu", "experiments/paper/").read_text()
    assert "- Diverged: llama@nano (shakespeare) seed 1: learning rate 0.004" in text


def test_the_effect_column_gives_the_verdicts_interval_and_sd_apart(tmp_path, monkeypatch):
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2],
                       "variants": {"llama": {}, "cem-attn": {"attention": "cem"}},
                       "learning_rates": LRS})
    effects = [-0.10, -0.12, -0.11]
    ledger = _effects_ledger(tmp_path, spec, {"cem-attn": effects})
    claim = Claim("x", "x", "q", "Sec. 0", "fig0",
                  (Comparison("cem-attn", "llama"), Comparison("cem-attn", "llama", "not_worse",
                                                               0.05)), equivalence=0.03,
                  equivalence_why="a reason")
    result = evaluate(claim, spec, ledger)
    e = min(result.effects, key=lambda e: e.alpha)  # two comparisons, both rejected
    mean, sd = statistics.fmean(effects), statistics.stdev(effects)
    half = student_t.ppf(1 - e.alpha / 2, 2) * sd / math.sqrt(3)
    assert sorted(x.alpha for x in result.effects) == pytest.approx([0.025, 0.05])
    drawn = {}

    def save(plt, fig, path):
        ax = fig.axes[0]
        drawn.update(label=ax.get_xlabel(), ticks=[t.get_text() for t in ax.get_yticklabels()])
        plt.close(fig)

    monkeypatch.setattr("orchestrator.report._save_png", save)
    text = write_report([result], tmp_path / "out", "cpu", "experiments/paper/").read_text()
    assert f"{100 * mean:+.1f}% [{100 * (mean - half):+.1f}, {100 * (mean + half):+.1f}]" in text
    effect_table = text.split("```")[1].strip().split("\n\n")[0]
    assert "sd (seeds)" in effect_table and f"{100 * sd:.1f}%" in effect_table
    assert "±" not in effect_table.replace("±3%", "")  # no ± beside the effect, only the margin
    assert "Holm-adjusted interval (level per row)" in drawn["label"]  # not "95 %"
    assert {t.rsplit(", ", 1)[1] for t in drawn["ticks"]} == {"97.5 %", "95 %"}
    one = evaluate(Claim("y", "y", "q", "Sec. 0", "fig0", claim.comparisons[:1]), spec, ledger)
    figure(one, tmp_path / "one.png")
    assert "bars: Holm-adjusted 95 % intervals" in drawn["label"]
    # the margin is the claim's, stated with its reason, and the MDE beside the effect
    assert e.margin == 0.03 and "- Equivalence margin: ±3 % (a reason)." in text
    assert "MDE (80 %)" in text and f"{100 * e.mde:.1f}%" in text


def test_a_margin_below_the_mde_is_said_unreachable(tmp_path):
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": [0, 1, 2],
                       "variants": {"llama": {}, "cem-attn": {"attention": "cem"}},
                       "learning_rates": LRS})
    ledger = _effects_ledger(tmp_path, spec, {"cem-attn": [0.02, -0.01, 0.005]})
    result = evaluate(Claim("x", "x", "q", "Sec. 0", "fig0", (Comparison("cem-attn", "llama"),)),
                      spec, ledger)
    (e,) = result.effects
    assert e.verdict == UNDERPOWERED and e.margin_unreachable and e.seeds_needed > 3
    text = write_report([result], tmp_path / "out", "cpu", "experiments/paper/").read_text()
    assert (f"- Margin unreachable: cem-attn vs llama (lower) (shakespeare, nano): ±1 % lies "
            f"below the minimum detectable effect {100 * e.mde:.1f} % of 3 seeds") in text
    assert f"{e.seeds_needed} seeds would reach it" in text


def test_a_simulated_known_effect_is_recovered_from_the_ledger(tmp_path):
    """Ten seeds of a true effect of +8 % (sd 2 %) and of none (sd 0.2 %), through the ledger,
    the LR choice and the verdicts."""
    rng = np.random.default_rng(2024)
    spec = parse_spec({"name": "claims", "sizes": ["nano"], "seeds": list(range(10)),
                       "variants": {"llama": {}, "worse": {"attention": "cem"},
                                    "same": {"mlp": "cem"}}, "learning_rates": LRS})
    ledger = _effects_ledger(tmp_path, spec, {"worse": list(rng.normal(0.08, 0.02, 10)),
                                              "same": list(rng.normal(0.0, 0.002, 10))})
    claim = Claim("x", "x", "q", "Sec. 0", "fig0", (Comparison("worse", "llama"),
                                                    Comparison("same", "llama")))
    worse, same = evaluate(claim, spec, ledger).effects
    assert worse.verdict == CONTRADICTS and same.verdict == EQUIVALENT
    assert worse.mean == pytest.approx(0.08, abs=0.02)
