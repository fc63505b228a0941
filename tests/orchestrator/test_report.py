"""The claims report: claims name real variants, intervals follow the t formula, verdicts follow
the intervals, each arm's learning rate is chosen once on its tuning seeds and tested on fresh
seeds' trained models, one pooled regression per comparison decides it, and REPORT.md with its
figures is written from a real ledger."""

import datetime as dt
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow import MlflowClient
from scipy.stats import t as student_t
from scipy.stats import ttest_ind

from orchestrator.cli import main
from orchestrator.planning.plan import arm_cells
from orchestrator.planning.spec import load_spec, parse_spec
from orchestrator.records.ledger import Ledger, Status
from orchestrator.science.claims import CLAIM_SETS, CLAIMS, Claim, ClaimSet, Comparison
from orchestrator.science.report import (
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
from orchestrator.science.results import (
    arm_rows,
    arm_steps,
    evaluations,
    experiment_rows,
    format_seeds,
    tuned_models,
    tuning,
)
from orchestrator.science.verdicts import (
    CONTRADICTS,
    EQUIVALENT,
    MIXED,
    NOT_RUN,
    SUPPORTS,
    UNDERPOWERED,
    Sample,
    combine,
    holm_levels,
    mde_se,
    verdict,
)
from orchestrator.table import format_table

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
    assert ("Setup: data shakespeare; every size (nano) on 0.25x its Chinchilla budget (20 "
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
    assert lr_protocol(parse_spec({**base, "learning_rates": {
        "grid": [0.001, 0.002, 0.004], "max_points": 6, "eval_seeds": [5, 6]}})) == (
        "own optimum on 0.001..0.004 (3), adapting to 6; tested on 2 fresh seeds there")


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
    # one LR, no evaluation seeds: the tuning seeds' models; the log ratio of their means
    assert results[0].effects[0].source == "tuning"
    assert results[0].effects[0].estimate == pytest.approx(
        (math.log(1.1) + math.log(1.2)) / 2, rel=1e-9)
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


def _row(ledger, exp_id, variant, seed, lr, status=Status.FINISHED, val=None, lr_round=None):
    row = ledger.ensure_trial(exp_id, f"{variant}-{seed}-{lr}", dataset="shakespeare",
                              variant=variant, size="nano", lr=lr, seed=seed, lr_round=lr_round)
    val = 100 * (1 + math.log2(lr / 0.002) ** 2 / 10) if val is None else val
    ledger.update_trial(row.id, status=status, val_metric=val, metric=1.02 * val)




def _spec(variants, sizes=("nano",), seeds=(0, 1, 2), eval_seeds=(5, 6, 7), grid=None):
    """A spec of ``variants`` with a fixed grid ``LRS`` (or ``grid``, a learning_rates mapping)
    and evaluation seeds."""
    lrs = grid or {"grid": LRS, "extend": False, "eval_seeds": list(eval_seeds)}
    return parse_spec({"name": "claims", "sizes": list(sizes), "seeds": list(seeds),
                       "variants": variants, "learning_rates": lrs})


def _val(lr: float, best: float = 0.002, level: float = 100.0) -> float:
    return level * (1 + math.log2(lr / best) ** 2 / 10)


def _pooled_ledger(tmp_path, spec, tests: dict[tuple[str, str], list[float]],
                   best: dict[int, float] | None = None, tune_test: float = 1e6,
                   name: str = "ledger.db") -> Ledger:
    """Tuning rows of every arm, size and tuning seed at every LR of ``LRS`` (validation
    ``_val`` with seed s's optimum at ``best[s]``, default 0.002; test ``tune_test``, never read
    once evaluation seeds finished) and evaluation rows at 0.002: ``tests[(variant, size)]``
    lists the test metric of each evaluation seed, in the spec's order."""
    best = best or {}
    ledger = Ledger(f"sqlite:///{tmp_path / name}")
    exp = ledger.ensure_experiment(spec.name, "language_model", "")
    for size in spec.sizes:
        for variant in spec.variants:
            for seed in spec.seeds:
                for lr in LRS:
                    row = ledger.ensure_trial(exp.id, f"{variant}-{size}-{seed}-{lr}",
                                              dataset="shakespeare", variant=variant, size=size,
                                              lr=lr, seed=seed)
                    ledger.update_trial(row.id, status=Status.FINISHED, metric=tune_test,
                                        val_metric=_val(lr, best.get(seed, 0.002)))
            for seed, test in zip(spec.eval_seeds, tests.get((variant, size), ()), strict=False):
                row = ledger.ensure_trial(exp.id, f"{variant}-{size}-{seed}-eval",
                                          dataset="shakespeare", variant=variant, size=size,
                                          lr=0.002, seed=seed)
                ledger.update_trial(row.id, status=Status.FINISHED, metric=test,
                                    val_metric=test)
    return ledger


def _two_sample(t_arm, c_arm):
    """The log ratio of two arms' test metrics, unpaired: the difference of mean logs, its
    pooled-variance standard error and degrees of freedom (scipy's ``ttest_ind``)."""
    lt, lc = np.log(t_arm), np.log(c_arm)
    ref = ttest_ind(lt, lc)
    est = lt.mean() - lc.mean()
    return est, est / ref.statistic, len(lt) + len(lc) - 2


LLAMA = [50.0, 50.2, 49.8]
CEM = [51.0, 51.1, 50.7]


def test_the_lr_is_chosen_once_per_arm_and_fresh_seeds_are_tested_there(tmp_path):
    """The tuning seeds disagree on their own optimum; the arm takes the trained LR of lowest
    mean log validation and its evaluation seeds' models there decide, as a log ratio of the
    arms' unpaired test metrics; the tuning seeds' test metrics (1e6) are never read."""
    spec = _spec({"llama": {}, "cem-attn": {"attention": "cem"}})
    best = {0: 0.0011, 1: 0.0021, 2: 0.0019}
    ledger = _pooled_ledger(tmp_path, spec, {("llama", "nano"): LLAMA,
                                             ("cem-attn", "nano"): CEM}, best)
    exp = ledger.experiment("claims")
    stale = ledger.ensure_trial(exp.id, "stale", dataset="shakespeare", variant="llama",
                                size="nano", lr=0.004, seed=5)  # before the choice moved
    ledger.update_trial(stale.id, status=Status.FINISHED, metric=1e9, val_metric=1e9)
    claim = Claim("x", "CEM within 5 %", "quote", "Sec. 0", "fig0",
                  (Comparison("cem-attn", "llama", "not_worse", 0.05),
                   Comparison("cem-attn", "llama")))
    result = evaluate(claim, spec, ledger)
    means = {lr: statistics.fmean(math.log(_val(lr, b)) for b in best.values()) for lr in LRS}
    chosen = min(means, key=means.get)
    assert chosen == 0.002
    assert [(a["variant"], a["LR (chosen)"], a["tuning seeds"], a["test seeds"])
            for a in result.arms] == [("cem-attn", "0.002", 3, "3 evaluation"),
                                      ("llama", "0.002", 3, "3 evaluation")]
    assert result.tests[("shakespeare", "nano", "llama")] == LLAMA
    within, better = result.effects
    est, se, df = _two_sample(CEM, LLAMA)
    assert within.source == "evaluation" and within.fit.df == df == 4
    assert within.estimate == pytest.approx(est, rel=1e-9)
    assert within.fit.se == pytest.approx(se, rel=1e-9)
    # Holm over the two, each at its own test: not worse by log(1.05), better than 0
    p_within = 2 * student_t.sf(abs(est - math.log(1.05)) / se, df)
    p_better = 2 * student_t.sf(abs(est) / se, df)
    assert [within.alpha, better.alpha] == pytest.approx(holm_levels([p_within, p_better]))
    assert within.ci[1] == pytest.approx(est + student_t.ppf(1 - within.alpha / 2, df) * se)
    assert within.verdict == SUPPORTS  # about +1.9 %: below the 5 % margin
    assert better.verdict == CONTRADICTS  # and surely worse than Llama
    assert result.verdict == MIXED  # within 5 %, yet worse: the comparisons disagree
    assert any("learning rate 0.004, not the chosen 0.002, not used" in n for n in result.notes)
    # the log ratio is antisymmetric: the other way round, the same effect negated
    back = evaluate(Claim("y", "y", "q", "Sec. 0", "fig0", (Comparison("llama", "cem-attn"),)),
                    spec, ledger).effects[0]
    assert back.estimate == pytest.approx(-within.estimate, rel=1e-12)
    # an evaluation trial not finished is missing, at its arm's chosen learning rate
    row = next(r for r in ledger.trials(exp.id) if r.trial_hash == "cem-attn-nano-7-eval")
    ledger.update_trial(row.id, status=Status.RUNNING)
    assert [(t.variant, t.lr, t.seed) for t in missing_trials(spec, ledger)] == [
        ("cem-attn", 0.002, 7)]


def test_without_evaluated_seeds_the_tuning_seeds_models_are_read_and_said(tmp_path):
    spec = _spec({"llama": {}, "cem-attn": {"attention": "cem"}})
    ledger = _pooled_ledger(tmp_path, spec, {}, tune_test=40.0)
    claim = Claim("x", "x", "q", "Sec. 0", "fig0", (Comparison("cem-attn", "llama"),))
    result = evaluate(claim, spec, ledger)
    (e,) = result.effects
    assert e.source == "tuning" and e.fit.n == 6
    assert result.tests[("shakespeare", "nano", "llama")] == [40.0] * 3  # trained at 0.002
    text = write_report([result], tmp_path / "out", "cpu", "experiments/paper/").read_text()
    assert ("- Tuning seeds: cem-attn vs llama (lower) reads the models its learning rates were "
            "chosen on: its evaluation seeds have not run.") in text
    assert len(missing_trials(spec, ledger)) == 2 * 3  # both arms' evaluation seeds


def test_a_test_time_arm_reads_the_same_trained_models_paired_by_seed(tmp_path):
    spec, ledger, client = _test_time_study(tmp_path)
    claim = Claim("j", "More steps at test time", "quote", "Sec. 0", "fig0",
                  (Comparison("cem@T4_scaled", "cem@T2_kept"), Comparison("cem@T8_kept", "cem")))
    result = evaluate(claim, spec, ledger, lambda run_id: client.get_run(run_id).data.metrics)
    (effect,) = result.effects  # T8 was never evaluated: that comparison has no models
    assert effect.fit.paired and effect.fit.n == 6 and effect.fit.df == 2
    assert effect.estimate == pytest.approx(math.log(0.97), rel=1e-9)
    assert effect.verdict == SUPPORTS
    # the values are the trained models' at LR 0.002 (the validation optimum), not interpolated
    trained = {r.seed: r.metric for r in ledger.trials(1) if r.lr == 0.002}
    assert result.tests[("shakespeare", "nano", "cem@T2_kept")] == [trained[s] for s in range(3)]
    assert evaluate(claim, spec, ledger).effects == ()  # no MLflow: no test-time models


def test_holm_takes_an_equivalence_comparisons_tost_p(tmp_path):
    spec = _spec({"llama": {}, "same": {"attention": "cem"}, "lower": {"mlp": "cem"}},
                 eval_seeds=(5, 6, 7, 8, 9))
    llama = [100 * math.exp(d) for d in (0.0, 0.001, -0.001, 0.0005, -0.0005)]
    same = [100 * math.exp(d) for d in (0.0002, -0.0008, 0.0011, -0.0004, 0.0001)]
    lower = [95 * math.exp(d) for d in (0.03, -0.04, 0.02, -0.01, 0.0)]
    ledger = _pooled_ledger(tmp_path, spec, {("llama", "nano"): llama, ("same", "nano"): same,
                                             ("lower", "nano"): lower})
    claim = Claim("x", "x", "q", "Sec. 0", "fig0",
                  (Comparison("same", "llama", "equivalent"), Comparison("lower", "llama")))
    eq, better = evaluate(claim, spec, ledger).effects
    # independently: TOST's p of `same` (±log 1.01) and the t-test's p of `lower`
    est, se, df = _two_sample(same, llama)
    margin = math.log(1.01)
    p_tost = max(student_t.sf((est + margin) / se, df), student_t.cdf((est - margin) / se, df))
    low, se_low, _ = _two_sample(lower, llama)
    p_lower = 2 * student_t.sf(abs(low) / se_low, df)
    assert [eq.alpha, better.alpha] == pytest.approx(holm_levels([p_tost, p_lower]))
    assert eq.verdict == SUPPORTS and eq.coverage == pytest.approx(1 - 2 * eq.alpha)
    assert eq.mde <= margin  # the margin is within the design's reach


def _row(ledger, exp_id, variant, seed, lr, status=Status.FINISHED, val=None, lr_round=None):
    row = ledger.ensure_trial(exp_id, f"{variant}-{seed}-{lr}", dataset="shakespeare",
                              variant=variant, size="nano", lr=lr, seed=seed, lr_round=lr_round)
    val = 100 * (1 + math.log2(lr / 0.002) ** 2 / 10) if val is None else val
    ledger.update_trial(row.id, status=status, val_metric=val, metric=1.02 * val)


def test_every_tuning_seed_needs_the_lrs_a_bracket_added_and_evaluation_seeds_need_none(
        tmp_path):
    spec = _spec({"llama": {}}, seeds=(0, 1, 2, 3), eval_seeds=(7, 8),
                 grid={"grid": LRS, "max_points": 6, "eval_seeds": [7, 8]})
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
    for seed in (7, 8):  # evaluation seeds: one LR each, the chosen one
        _row(ledger, exp.id, "llama", seed, 0.002)
    _row(ledger, exp.id, "llama", 7, 0.016)  # reachable by the bracket, never chosen
    assert {r.lr for r in experiment_rows(spec, ledger) if r.seed == 7} == {0.002, 0.016}
    claim = Claim("x", "x", "q", "Sec. 0", "fig0", (Comparison("llama", "llama"),))
    result = evaluate(claim, spec, ledger)
    assert result.incomplete == ("llama@nano (shakespeare) seed 2: 3 of 4 learning rates "
                                 "finished (not 0.008), left out",)
    assert result.diverged == (
        "llama@nano (shakespeare) seed 1: learning rate 0.004 diverged, counted as infinite "
        "validation loss (never chosen)",
        "llama@nano (shakespeare) seed 3: learning rate 0.008 diverged, counted as infinite "
        "validation loss (never chosen)")
    (arm,) = result.arms  # 0.004 and 0.008 diverged on a kept seed: never chosen
    assert (arm["LR (chosen)"], arm["LRs"], arm["tuning seeds"], arm["test seeds"]) == (
        "0.002", 4, 3, "2 evaluation")
    assert result.effects == ()  # llama against itself: no contrast
    # not finished: seed 2's added LR (pending) and seed 3's (failed: run trains it again)
    assert [(t.lr, t.seed) for t in missing_trials(spec, ledger)] == [(0.008, 2), (0.008, 3)]
    text = write_report([result], tmp_path / "out", "cpu", "experiments/paper/").read_text()
    assert "- Diverged: llama@nano (shakespeare) seed 1: learning rate 0.004" in text
    assert "evaluation trials at learning rate 0.016, not the chosen 0.002, not used" in text


def test_an_arm_whose_choice_is_the_grid_edge_says_it_is_no_optimum(tmp_path):
    spec = _spec({"llama": {}, "cem-attn": {"attention": "cem"}})
    ledger = _pooled_ledger(tmp_path, spec, {}, best={0: 0.01, 1: 0.01, 2: 0.01},
                            tune_test=40.0)
    result = evaluate(Claim("x", "x", "q", "Sec. 0", "fig0", (Comparison("cem-attn", "llama"),)),
                      spec, ledger)
    assert result.arms[0]["LR (chosen)"] == "0.004 edge"
    assert result.at_edge[0] == ("cem-attn@nano (shakespeare): learning rate 0.004 is the "
                                 "largest of the 3 it trained: no optimum")


def test_the_effect_column_gives_the_pooled_log_ratio_its_interval_mde_and_trend(
        tmp_path, monkeypatch):
    sizes = ("pico", "nano", "tiny")
    spec = _spec({"llama": {}, "cem-attn": {"attention": "cem"}}, sizes=sizes)
    rng = np.random.default_rng(8)
    tests = {(v, s): list(np.exp(np.log(40.0 * (1.1 if v == "cem-attn" else 1.0))
                                 + rng.normal(0, 0.02, 3)))
             for v in spec.variants for s in sizes}
    ledger = _pooled_ledger(tmp_path, spec, tests)
    claim = Claim("x", "x", "q", "Sec. 0", "fig0",
                  (Comparison("cem-attn", "llama"), Comparison("cem-attn", "llama", "not_worse",
                                                               0.05)), equivalence=0.03,
                  equivalence_why="a reason")
    result = evaluate(claim, spec, ledger)
    e = min(result.effects, key=lambda e: e.alpha)
    # independently: the mean over sizes of the difference of mean logs
    d = [np.log(tests[("cem-attn", s)]).mean() - np.log(tests[("llama", s)]).mean()
         for s in sizes]
    assert e.estimate == pytest.approx(float(np.mean(d)), rel=1e-9)
    assert e.fit.df == 2 * 3 * 3 - 3 - 2 and e.fit.slope is not None
    half = student_t.ppf(1 - e.alpha / 2, e.fit.df) * e.fit.se
    drawn = {}

    def save(plt, fig, path):
        ax = fig.axes[0]
        drawn.update(label=ax.get_xlabel(), ticks=[t.get_text() for t in ax.get_yticklabels()])
        plt.close(fig)

    monkeypatch.setattr("orchestrator.science.report._save_png", save)
    text = write_report([result], tmp_path / "out", "cpu", "experiments/paper/").read_text()
    pct = [100 * math.expm1(x) for x in (e.estimate, e.estimate - half, e.estimate + half)]
    assert f"{pct[0]:+.1f}% [{pct[1]:+.1f}, {pct[2]:+.1f}]" in text
    effect_table = text.split("```")[1].strip().split("\n\n")[0]
    for column in ("per 2x N", "sd (resid.)", "MDE (80 %)", "seeds for margin"):
        assert column in effect_table
    assert f"{100 * e.fit.sd:.1f}%" in effect_table
    assert f"{100 * math.expm1(e.mde):.1f}%" in effect_table
    assert "per size (detail, not a verdict):" in text and text.count("nano") >= 2
    assert "Holm-adjusted interval (level per row)" in drawn["label"]
    assert {t.rsplit(", ", 1)[1] for t in drawn["ticks"]} == {
        f"{100 * (1 - a):.3g} %" for a in sorted(x.alpha for x in result.effects)}
    assert e.margin == 0.03 and "- Equivalence margin: ±3 % (a reason)." in text
    # the effect's trend over sizes: per doubling of the control's parameter count
    assert e.fit.slope_se > 0 and f"{100 * math.expm1(e.fit.slope * math.log(2)):+.1f}%" in text


def test_a_margin_below_the_mde_cannot_show_equivalence_and_says_how_many_seeds_would(
        tmp_path):
    spec = _spec({"llama": {}, "cem-attn": {"attention": "cem"}})
    ledger = _pooled_ledger(tmp_path, spec, {("llama", "nano"): LLAMA,
                                             ("cem-attn", "nano"): [50.5, 51.0, 49.0]})
    result = evaluate(Claim("x", "x", "q", "Sec. 0", "fig0", (Comparison("cem-attn", "llama"),)),
                      spec, ledger)
    (e,) = result.effects
    assert e.verdict == UNDERPOWERED and e.margin_unreachable
    # the closed form of one size, two arms of n seeds: se = sd sqrt(2 / n), df = 2 n - 2
    target, n = math.log(1.01), e.seeds_needed
    assert mde_se(e.fit.sd * math.sqrt(2 / n), 2 * n - 2, e.alpha) <= target
    assert mde_se(e.fit.sd * math.sqrt(2 / (n - 1)), 2 * n - 4, e.alpha) > target
    text = write_report([result], tmp_path / "out", "cpu", "experiments/paper/").read_text()
    assert (f"- Cannot show equivalence: cem-attn vs llama (lower): its margin ±1 % lies below "
            f"the minimum detectable effect {100 * math.expm1(e.mde):.1f} % of this design (3 "
            f"evaluation seeds per arm and size over 1 size(s), residual sd "
            f"{100 * e.fit.sd:.1f} %); {n} seeds per arm and size would reach it.") in text


def _simulated_spec(effects: dict[str, tuple[float, float]], sizes, n_eval: int) -> dict:
    """The spec (a mapping) of llama and the variants of ``effects`` at ``sizes``, 3 tuning
    seeds over ``LRS`` and ``n_eval`` evaluation seeds from 10."""
    return {"name": "claims", "sizes": list(sizes), "seeds": [0, 1, 2],
            "variants": {"llama": {}, **{v: {"attention": "cem", "attn_steps": i + 1}
                                         for i, v in enumerate(effects)}},
            "learning_rates": {"grid": LRS, "extend": False,
                               "eval_seeds": list(range(10, 10 + n_eval))}}


def _simulated(tmp_path, rng, data: dict, effects: dict[str, tuple[float, float]], sd: float):
    """A ledger of the spec ``data`` (``_simulated_spec``): its tuning seeds with noisy
    validation bowls (optima near 0.002), its evaluation seeds at 0.002 with log test = size
    level + effect + trend x + N(0, sd), ``effects`` mapping a variant to (its log ratio at the
    sizes' geometric-mean N, its change per unit of log N), x the size's log N (llama's) less
    their mean; returns the spec and the ledger."""
    spec = parse_spec(data)
    logn = {s: math.log(cell(0.002, 0).params["total"])
            for (_, v, s), cell in arm_cells(spec).items() if v == "llama"}
    centre = statistics.fmean(logn.values())
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment(spec.name, "language_model", "")
    for i, size in enumerate(spec.sizes):
        for variant in spec.variants:
            shift, trend = effects.get(variant, (0.0, 0.0))
            for seed in spec.seeds:
                for lr in LRS:
                    val = _val(lr) * math.exp(rng.normal(0, 0.003))
                    row = ledger.ensure_trial(exp.id, f"{variant}-{size}-{seed}-{lr}",
                                              dataset="shakespeare", variant=variant,
                                              size=size, lr=lr, seed=seed)
                    ledger.update_trial(row.id, status=Status.FINISHED, val_metric=val,
                                        metric=val * math.exp(rng.normal(0, 0.003)))
            for seed in spec.eval_seeds:
                y = 4.0 - 0.3 * i + shift + trend * (logn[size] - centre) + rng.normal(0, sd)
                row = ledger.ensure_trial(exp.id, f"{variant}-{size}-{seed}-eval",
                                          dataset="shakespeare", variant=variant, size=size,
                                          lr=0.002, seed=seed)
                ledger.update_trial(row.id, status=Status.FINISHED, metric=math.exp(y),
                                    val_metric=math.exp(y))
    return spec, ledger


def test_a_simulated_known_effect_is_recovered_from_the_ledger(tmp_path):
    """Three sizes, 10 evaluation seeds per arm: a treatment 8 % worse at the geometric-mean N
    whose gap shrinks by 0.02 per unit of log N, and one with no effect, through the ledger,
    the LR choice, the pooled regression and the verdicts."""
    rng = np.random.default_rng(1)
    truth = {"worse": (math.log(1.08), -0.02), "same": (0.0, 0.0)}
    spec, ledger = _simulated(tmp_path, rng, _simulated_spec(truth, ("pico", "nano", "tiny"), 10),
                              truth, sd=0.004)
    claim = Claim("x", "x", "q", "Sec. 0", "fig0", (Comparison("worse", "llama"),
                                                    Comparison("same", "llama")))
    result = evaluate(claim, spec, ledger)
    worse, same = result.effects
    assert worse.verdict == CONTRADICTS and same.verdict == EQUIVALENT
    assert result.verdict == MIXED
    for e, (effect, trend) in zip((worse, same), truth.values(), strict=True):
        assert e.ci[0] < effect < e.ci[1]
        assert abs(e.fit.slope - trend) < 4 * e.fit.slope_se
        assert e.fit.sd == pytest.approx(0.004, rel=0.3)
        assert e.source == "evaluation" and e.seeds == (10, 10) and len(e.fit.blocks) == 3
    assert all(a["LR (chosen)"] == "0.002" for a in result.arms)


def test_the_seeds_diagnostic_prints_each_arms_seed_spread_at_the_chosen_lr(
        tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(6)
    data = _simulated_spec({"cem": (0.05, 0.0)}, ("nano",), 4)
    spec, ledger = _simulated(tmp_path, rng, data, {"cem": (0.05, 0.0)}, sd=0.01)
    rows = experiment_rows(spec, ledger)
    tuned = tuning(spec, rows)
    models = {**tuned_models(rows, tuned), **evaluations(spec, rows, tuned)[0]}
    steps = arm_steps(spec)
    table = {r["variant"]: r for r in arm_rows(tuned, models, detail=True, steps=steps,
                                               sequences=spec.training.eval_sequences)}
    cem = table["cem"]
    eval_logs = [math.log(r.metric) for r in rows if r.variant == "cem" and r.seed >= 10]
    tune = [r for r in rows if r.variant == "cem" and r.seed < 10]
    at = [math.log(r.val_metric) for r in tune if r.lr == 0.002]
    noise = statistics.stdev(math.log(r.val_metric) - math.log(r.metric) for r in tune)
    assert cem["LR (chosen)"] == "0.002" and cem["test seeds"] == "4 evaluation"
    assert cem["seed sd (log test)"] == f"{100 * statistics.stdev(eval_logs):.2f}%"
    assert cem["val sd (seeds)"] == f"{100 * statistics.stdev(at):.2f}%"
    assert cem["val-set noise <="] == f"{100 * noise:.2f}%"
    means = {lr: statistics.fmean(math.log(r.val_metric) for r in tune if r.lr == lr)
             for lr in LRS}
    gap = sorted(means.values())[1] - min(means.values())
    z = gap / (math.sqrt(2) * noise)
    assert cem["gap to runner-up"] == f"{100 * gap:.2f}%" and cem["z"] == f"{z:.2f}"
    needed = math.ceil(spec.training.eval_sequences * (1.6448536269514722 / z) ** 2)
    assert cem["val sequences for z>=1.64"] == needed
    assert cem["steps"] == arm_cells(spec)[("shakespeare", "cem", "nano")](0.002, 0).steps
    text = format_seeds(spec, rows)
    assert format_table(list(table.values())) in text
    spec_path = tmp_path / "claims.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("CEMLAB_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    assert main(["seeds", str(spec_path)]) == 0
    assert capsys.readouterr().out.strip() == text.strip()
