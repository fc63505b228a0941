"""The verdict logic on its own: TOST's p-value, a claim decided from its decided comparisons,
the minimum detectable effect against scipy's noncentral t, known effects recovered from
simulated seeds, and the pooled regression against its closed forms, scipy's t-tests and a
power simulation."""

import math

import numpy as np
import pytest
from scipy.stats import nct, ttest_ind, ttest_rel
from scipy.stats import t as student_t

from orchestrator.science.claims import CLAIM_SETS
from orchestrator.science.verdicts import (
    CONTRADICTS,
    EQUIVALENT,
    MIXED,
    SUPPORTS,
    UNDERPOWERED,
    Estimate,
    Observation,
    Sample,
    combine,
    holm_levels,
    mde,
    mde_se,
    pooled_fit,
    seeds_for,
    verdict,
)


def test_tost_p_is_the_larger_one_sided_p_and_the_family_takes_it():
    xs = (0.001, -0.002, 0.0005, 0.0015)
    n, mean = len(xs), float(np.mean(xs))
    se = float(np.std(xs, ddof=1)) / math.sqrt(n)
    lower = student_t.sf((mean + 0.01) / se, n - 1)  # H0: mean <= -1 %
    upper = student_t.cdf((mean - 0.01) / se, n - 1)  # H0: mean >= +1 %
    sample = Sample(xs, 0.0, 0.01, tost=True)
    assert sample.p_tost() == pytest.approx(max(lower, upper), rel=1e-9)
    assert sample.p_value() == sample.p_tost()  # its own test's p enters Holm's family
    assert Sample(xs, 0.0, 0.01).p_value() == Sample(xs, 0.0, 0.01).p_threshold()
    assert sample.p_tost() < 0.01 < sample.p_threshold()
    assert verdict(sample, 0.05) == SUPPORTS  # the claim of equality holds
    assert verdict(Sample((0.05, 0.052, 0.049), 0.0, 0.01, tost=True), 0.05) == CONTRADICTS
    assert verdict(Sample((0.05, -0.05, 0.0), 0.0, 0.01, tost=True), 0.05) == UNDERPOWERED


def test_a_claim_takes_the_verdict_its_decided_comparisons_share():
    assert combine([SUPPORTS, UNDERPOWERED, SUPPORTS]) == SUPPORTS
    assert combine([CONTRADICTS, UNDERPOWERED]) == CONTRADICTS
    assert combine([SUPPORTS, CONTRADICTS, UNDERPOWERED]) == MIXED
    assert combine([UNDERPOWERED, UNDERPOWERED]) == UNDERPOWERED


def test_claim_e_with_every_effect_above_3_percent_contradicts_not_underpowered():
    """Claim (e), not worse than Llama by 1 %: 30 per-seed effects, all above +3 %, over four
    comparisons; the one with 2 seeds is undecided, the others contradict."""
    rng = np.random.default_rng(7)
    groups = [tuple(0.05 + 0.005 * rng.standard_normal(k)) for k in (8, 8, 12)]
    groups.append((0.031, 0.30))  # two seeds far apart: no interval narrow enough
    assert sum(map(len, groups)) == 30 and min(min(g) for g in groups) > 0.03
    samples = [Sample(g, 0.01, 0.01) for g in groups]
    levels = holm_levels([s.p_value() for s in samples])
    found = [verdict(s, a) for s, a in zip(samples, levels, strict=True)]
    assert found == [CONTRADICTS, CONTRADICTS, CONTRADICTS, UNDERPOWERED]
    assert combine(found) == CONTRADICTS


@pytest.mark.parametrize(("n", "alpha"), [(2, 0.05), (3, 0.05), (3, 0.0125), (5, 0.05 / 3),
                                          (10, 0.05), (30, 0.025)])
def test_the_mde_has_80_percent_power_by_the_noncentral_t(n, alpha):
    sd = 0.013
    found = mde(sd, n, alpha)
    crit = student_t.ppf(1 - alpha / 2, n - 1)  # one side of the verdict's interval
    power = nct.sf(crit, n - 1, found * math.sqrt(n) / sd)
    assert power == pytest.approx(0.80, abs=1e-3)
    approx = (crit + student_t.ppf(0.80, n - 1)) * sd / math.sqrt(n)  # the central-t form
    if n >= 10:
        assert found == pytest.approx(approx, rel=0.03)


def test_the_mde_by_simulation():
    """At the MDE, the share of simulated 5-seed samples whose verdict is decided (supports) is
    80 %, within the simulation's error."""
    rng = np.random.default_rng(11)
    sd, n, alpha = 0.01, 5, 0.05
    shift = mde(sd, n, alpha)
    draws = rng.normal(-shift, sd, size=(20000, n))
    hits = np.mean([verdict(Sample(tuple(d), 0.0, 1e-9), alpha) == SUPPORTS for d in draws])
    assert hits == pytest.approx(0.80, abs=0.015)


def test_seeds_for_is_the_fewest_seeds_whose_mde_reaches_the_margin():
    for sd, target, alpha in ((0.02, 0.01, 0.05), (0.01, 0.01, 0.0125), (0.004, 0.01, 0.05)):
        n = seeds_for(sd, target, alpha)
        assert mde(sd, n, alpha) <= target
        assert n == 2 or mde(sd, n - 1, alpha) > target
    assert mde(0.01, 1, 0.05) is None and mde(0.0, 4, 0.05) == 0.0
    assert seeds_for(0.01, 0.0, 0.05) is None


def test_known_simulated_effects_are_recovered():
    rng = np.random.default_rng(2024)
    worse = tuple(rng.normal(0.08, 0.02, 10))  # the treatment 8 % worse, sd 2 %, 10 seeds
    better = tuple(rng.normal(-0.08, 0.02, 10))
    null = tuple(rng.normal(0.0, 0.002, 10))
    assert verdict(Sample(worse, 0.0, 0.01), 0.05) == CONTRADICTS
    assert verdict(Sample(better, 0.0, 0.01), 0.05) == SUPPORTS
    assert verdict(Sample(worse, 0.12, 0.01), 0.05) == SUPPORTS  # not worse by 12 %
    assert verdict(Sample(null, 0.0, 0.01), 0.05) == EQUIVALENT  # tight margin, no effect
    assert verdict(Sample(null, 0.0, 0.01, tost=True), 0.05) == SUPPORTS
    assert verdict(Sample(null, 0.0, 0.0005), 0.05) == UNDERPOWERED  # margin below the MDE
    assert mde(float(np.std(null, ddof=1)), 10, 0.05) > 0.0005


def test_every_claim_states_its_equivalence_margin_and_why():
    for claim_set in CLAIM_SETS.values():
        for claim in claim_set.claims:
            assert 0 < claim.equivalence < 0.2 and claim.equivalence_why, claim.key
    paper = {c.key: c for c in CLAIM_SETS["paper"].claims}
    assert paper["a"].equivalence == 0.05  # beside its 5 % not-worse margin
    assert paper["c"].equivalence == 0.02


def _two_arms(rng, sizes: dict[str, float], n: int, effect: float, slope: float, sd: float):
    """Observations of a treatment and a control at each block of ``sizes`` (block -> log N),
    ``n`` seeds each: log metric = block level + (effect + slope x) [treatment] + N(0, sd),
    x the block's log N less the blocks' mean."""
    centre = float(np.mean(list(sizes.values())))
    obs = []
    for i, (block, logn) in enumerate(sizes.items()):
        for seed in range(n):
            obs.append(Observation("c", block, seed, 3.0 + 0.5 * i + rng.normal(0, sd)))
            obs.append(Observation("t", block, seed, 3.0 + 0.5 * i + effect
                                   + slope * (logn - centre) + rng.normal(0, sd)))
    return obs


SIZES = {"d/pico": math.log(2.0e5), "d/nano": math.log(8.0e5), "d/tiny": math.log(3.2e6)}


def test_the_pooled_fit_of_one_size_is_the_pooled_variance_two_sample_t():
    rng = np.random.default_rng(3)
    t_arm, c_arm = rng.normal(0.05, 0.02, 5), rng.normal(0.0, 0.02, 7)
    obs = ([Observation("t", "d/nano", s, y) for s, y in enumerate(t_arm)]
           + [Observation("c", "d/nano", s, y) for s, y in enumerate(c_arm)])
    fit = pooled_fit(obs, {"t": 1.0, "c": -1.0}, {"d/nano": 1.0})
    ref = ttest_ind(t_arm, c_arm)  # equal variances: the pooled-variance t
    assert fit.estimate == pytest.approx(t_arm.mean() - c_arm.mean(), rel=1e-12)
    assert fit.estimate / fit.se == pytest.approx(ref.statistic, rel=1e-9)
    assert fit.df == 10 and fit.slope is None
    est = Estimate(fit.estimate, fit.se, fit.df, 0.0, 0.01)
    assert est.p_threshold() == pytest.approx(ref.pvalue, rel=1e-9)
    # se = sd sqrt(2 / n), df = 2 n - 2
    assert (fit.design.variance, fit.design.df_per_seed, fit.design.df_fixed) == (
        pytest.approx(2.0), 2, 2)


def test_the_pooled_fit_over_sizes_matches_its_closed_form():
    """Balanced: 2 arms x 3 sizes x n seeds. With d_s the per-size difference of cell means and
    x_s the centred log N: effect = mean(d_s), trend = sum x d / sum x^2, residual sum of squares
    = within-cell sums of squares + (n / 2) sum (d_s - effect - trend x_s)^2 on 2 n S - S - 2
    degrees of freedom, se(effect) = sd sqrt(2 / (n S)), se(trend) = sd sqrt(2 / (n sum x^2))."""
    rng = np.random.default_rng(5)
    n = 6
    obs = _two_arms(rng, SIZES, n, effect=0.03, slope=-0.01, sd=0.02)
    fit = pooled_fit(obs, {"t": 1.0, "c": -1.0}, SIZES)
    x = np.array(list(SIZES.values())) - np.mean(list(SIZES.values()))
    cell = {(a, b): np.array([o.y for o in obs if (o.arm, o.block) == (a, b)])
            for a in "tc" for b in SIZES}
    d = np.array([cell[("t", b)].mean() - cell[("c", b)].mean() for b in SIZES])
    effect, trend = d.mean(), (x @ d) / (x @ x)
    within = sum(((v - v.mean()) ** 2).sum() for v in cell.values())
    rss = within + n / 2 * ((d - effect - trend * x) ** 2).sum()
    df = 2 * n * 3 - 3 - 2
    sd = math.sqrt(rss / df)
    assert fit.df == df and fit.n == 2 * n * 3
    assert fit.estimate == pytest.approx(effect, rel=1e-9)
    assert fit.slope == pytest.approx(trend, rel=1e-9)
    assert fit.sd == pytest.approx(sd, rel=1e-9)
    assert fit.se == pytest.approx(sd * math.sqrt(2 / (n * 3)), rel=1e-9)
    assert fit.slope_se == pytest.approx(sd * math.sqrt(2 / (n * (x @ x))), rel=1e-9)
    assert fit.design.se(fit.sd, n) == pytest.approx(fit.se, rel=1e-9)
    assert fit.design.df(n) == df
    assert sorted(b.block for b in fit.blocks) == sorted(SIZES)
    for b in fit.blocks:  # each size's contrast: detail
        block = b.block
        assert b.value == pytest.approx(cell[("t", block)].mean() - cell[("c", block)].mean())
        assert b.se == pytest.approx(sd * math.sqrt(2 / n)) and b.counts == (n, n)
    # the trend is relative to the blocks' mean log N: shifting every N changes nothing
    shifted = pooled_fit(obs, {"t": 1.0, "c": -1.0}, {b: v + 7.0 for b, v in SIZES.items()})
    assert shifted.estimate == pytest.approx(fit.estimate, rel=1e-9)


def test_a_block_without_every_arm_is_left_out_and_a_gain_contrast_has_four_arms():
    rng = np.random.default_rng(9)
    obs = _two_arms(rng, SIZES, 4, effect=0.02, slope=0.0, sd=0.01)
    obs = [o for o in obs if not (o.block == "d/tiny" and o.arm == "t")]
    fit = pooled_fit(obs, {"t": 1.0, "c": -1.0}, SIZES)
    assert [b.block for b in fit.blocks] == ["d/nano", "d/pico"] and fit.left_out == ("d/tiny",)
    # (t - tb) - (c - cb) of four arms at one size: the difference of the two gains' means
    arms = {a: rng.normal(mu, 0.01, 5) for a, mu in (("t", 0.1), ("tb", 0.3), ("c", 0.2),
                                                      ("cb", 0.25))}
    obs = [Observation(a, "d/nano", s, y) for a, ys in arms.items() for s, y in enumerate(ys)]
    fit = pooled_fit(obs, {"t": 1.0, "c": -1.0, "tb": -1.0, "cb": 1.0}, {"d/nano": 0.0})
    means = {a: ys.mean() for a, ys in arms.items()}
    assert fit.estimate == pytest.approx(means["t"] - means["tb"] - means["c"] + means["cb"])
    within = sum(((ys - ys.mean()) ** 2).sum() for ys in arms.values())
    assert fit.df == 16 and fit.sd == pytest.approx(math.sqrt(within / 16), rel=1e-9)
    assert fit.se == pytest.approx(fit.sd * math.sqrt(4 / 5), rel=1e-9)
    with pytest.raises(ValueError, match="sum to 0"):
        pooled_fit(obs, {"t": 1.0, "c": 1.0}, {"d/nano": 0.0})


def test_a_paired_fit_is_the_paired_t_of_one_model_at_two_settings():
    rng = np.random.default_rng(4)
    model = rng.normal(0.0, 0.3, 8)  # each seed's trained model: a large common level
    t4, t2 = model - 0.03 + rng.normal(0, 0.005, 8), model + rng.normal(0, 0.005, 8)
    obs = ([Observation("cem@T4", "d/nano", s, y) for s, y in enumerate(t4)]
           + [Observation("cem@T2", "d/nano", s, y) for s, y in enumerate(t2)])
    paired = pooled_fit(obs, {"cem@T4": 1.0, "cem@T2": -1.0}, {"d/nano": 0.0}, paired=True)
    ref = ttest_rel(t4, t2)
    assert paired.estimate / paired.se == pytest.approx(ref.statistic, rel=1e-9)
    assert paired.df == 7 and (paired.design.variance, paired.design.df_per_seed,
                               paired.design.df_fixed) == (pytest.approx(2.0), 1, 1)
    unpaired = pooled_fit(obs, {"cem@T4": 1.0, "cem@T2": -1.0}, {"d/nano": 0.0})
    assert unpaired.se > 10 * paired.se  # the models' spread, which pairing removes


def test_the_pooled_mde_has_80_percent_power_by_simulation():
    """At the design's MDE (from the noncentral t on its residual sd), the share of simulated
    data sets whose pooled interval at the Holm level clears 0 is 80 %, within the simulation's
    error; and ``seeds_for`` is the fewest seeds per cell whose MDE reaches the target."""
    rng = np.random.default_rng(17)
    sd, n, alpha = 0.03, 4, 0.025
    design = pooled_fit(_two_arms(rng, SIZES, n, 0.0, 0.0, sd), {"t": 1.0, "c": -1.0},
                        SIZES).design
    shift = mde(sd, n, alpha, design=design)
    assert shift == pytest.approx(mde_se(sd * math.sqrt(2 / (3 * n)), 2 * n * 3 - 5, alpha))
    hits = 0
    runs = 3000
    for _ in range(runs):
        fit = pooled_fit(_two_arms(rng, SIZES, n, -shift, 0.0, sd), {"t": 1.0, "c": -1.0},
                         SIZES)
        hits += verdict(Estimate(fit.estimate, fit.se, fit.df, 0.0, 1e-9), alpha) == SUPPORTS
    assert hits / runs == pytest.approx(0.80, abs=0.025)
    needed = seeds_for(sd, 0.02, alpha, design=design)
    assert mde(sd, needed, alpha, design=design) <= 0.02 < mde(sd, needed - 1, alpha,
                                                                  design=design)


def test_an_equivalence_needs_a_margin_at_least_the_mde():
    """TOST inside ±margin alone is not enough: where the margin lies below the design's
    minimum detectable effect, the comparison stays underpowered."""
    tight = Estimate(0.0, 0.004, 20, 0.0, 0.01)  # TOST interval inside ±1 %, MDE about 1.2 %
    assert tight.interval(0.1) is not None and -0.01 < tight.interval(0.1)[0]
    assert tight.mde(0.05) > 0.01 and verdict(tight, 0.05) == UNDERPOWERED
    assert verdict(Estimate(0.0, 0.004, 20, 0.0, 0.01, tost=True), 0.05) == UNDERPOWERED
    wide = Estimate(0.0, 0.004, 20, 0.0, 0.02)
    assert wide.mde(0.05) < 0.02 and verdict(wide, 0.05) == EQUIVALENT
