"""The verdict logic on its own: TOST's p-value, a claim decided from its decided comparisons,
the minimum detectable effect against scipy's noncentral t, and known effects recovered from
simulated seeds."""

import math

import numpy as np
import pytest
from scipy.stats import nct
from scipy.stats import t as student_t

from orchestrator.claims import CLAIM_SETS
from orchestrator.verdicts import (
    CONTRADICTS,
    EQUIVALENT,
    MIXED,
    SUPPORTS,
    UNDERPOWERED,
    Sample,
    combine,
    holm_levels,
    mde,
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
