"""Scaling-law fits against known laws: exact recovery, recovery under seed noise with the true
curve inside the bootstrap band, a treatment built to need exactly 25% fewer parameters, the
'not enough sizes' headline, the inverse, and bad input."""

import math

import numpy as np
import pytest

from orchestrator.science.scaling import (
    AT_BOUND_TOL,
    MIN_SIZES,
    PowerLaw,
    at_bounds,
    bootstrap_band,
    fit_family,
    fit_parameters,
    fit_power_law,
    headline,
    parameter_saving,
)

TRUE = PowerLaw(E=20.0, A=3e3, alpha=0.35)
SIZES = np.array([1e6, 2e6, 4e6, 8e6, 16e6])
# A_t = A·0.75^alpha: L_t(0.75·N) = E + A·0.75^alpha·(0.75·N)^-alpha = L(N) at every N.
TREATMENT = PowerLaw(E=TRUE.E, A=TRUE.A * 0.75**TRUE.alpha, alpha=TRUE.alpha)


def seeded(law: PowerLaw, noise: float, seeds: int = 3, draw: int = 1):
    """``seeds`` points per size, each the law times (1 + noise·standard normal)."""
    n = np.repeat(SIZES, seeds)
    rng = np.random.default_rng(draw)
    return n, law(n) * (1 + noise * rng.standard_normal(len(n)))


def test_exact_data_from_a_known_law_is_recovered():
    fit = fit_power_law(SIZES.tolist(), TRUE(SIZES).tolist())
    for got, want in ((fit.E, TRUE.E), (fit.A, TRUE.A), (fit.alpha, TRUE.alpha)):
        assert got == pytest.approx(want, rel=1e-3)
    # Units: A is in N's own units, not N / N_ref's.
    assert fit(3e6) == pytest.approx(20.0 + 3e3 * 3e6**-0.35, rel=1e-6)


def test_order_and_scale_do_not_matter():
    order = np.array([3, 0, 4, 1, 2])
    fit = fit_power_law(SIZES[order], TRUE(SIZES)[order])
    assert fit.alpha == pytest.approx(TRUE.alpha, rel=1e-3)
    billions = PowerLaw(E=2.5, A=40.0, alpha=0.2)  # losses, not perplexities, at 1e8..1.6e9
    big = SIZES * 100
    fit = fit_power_law(big, billions(big))
    assert (fit.E, fit.A, fit.alpha) == pytest.approx((2.5, 40.0, 0.2), rel=1e-3)


def test_noisy_seeds_recover_alpha_and_the_band_holds_the_true_curve():
    # One fixed draw of 1% noise, 3 seeds per size; across draws 0..19, 16 of 20 had alpha
    # within 0.05 and 14 of 20 had the true curve inside the band at >= 80% of the grid.
    n, loss = seeded(TRUE, noise=0.01)
    fit, band, fits = bootstrap_band(n, loss, samples=200, seed=0)
    assert abs(fit.alpha - TRUE.alpha) < 0.05
    assert len(fits) > 190 and len(band.n) == 100
    assert band.n[0] == pytest.approx(1e6) and band.n[-1] == pytest.approx(16e6)
    assert np.all(band.low <= band.high) and np.all(band.high - band.low > 0)
    inside = (band.low <= TRUE(band.n)) & (TRUE(band.n) <= band.high)
    assert inside.mean() >= 0.8
    assert np.allclose(band.mid, fit(band.n))


def test_band_on_a_given_grid_and_seeded_resamples_repeat():
    n, loss = seeded(TRUE, noise=0.01)
    grid = np.array([1e6, 4e6, 32e6])
    _, a, _ = bootstrap_band(n, loss, samples=30, seed=5, grid=grid)
    _, b, _ = bootstrap_band(n, loss, samples=30, seed=5, grid=grid)
    assert np.array_equal(a.n, grid) and np.array_equal(a.low, b.low)
    # Extrapolating past the largest size, the band widens.
    assert a.high[-1] - a.low[-1] > a.high[1] - a.low[1]


def test_one_point_per_size_gives_a_band_of_no_width():
    # Resampling within each size can only redraw that size's single point.
    fit, band, fits = bootstrap_band(SIZES, TRUE(SIZES) * [1.01, 0.99, 1.0, 1.01, 0.99],
                                     samples=5)
    assert np.allclose(band.low, band.mid) and np.allclose(band.high, band.mid)


def test_groups_resample_within_each_group_of_each_size():
    n, loss = seeded(TRUE, noise=0.01)
    _, band, _ = bootstrap_band(n, loss, groups=["run"] * len(n), samples=20)
    assert np.all(band.high - band.low > 0)  # one group: as if none
    # A group per point: every stratum holds one point, so every resample is the data.
    _, band, _ = bootstrap_band(n, loss, groups=list(range(len(n))), samples=5)
    assert np.allclose(band.low, band.mid) and np.allclose(band.high, band.mid)


def test_a_treatment_built_to_need_25_percent_fewer_parameters():
    assert parameter_saving(TRUE, TREATMENT, 16e6) == pytest.approx(0.25, abs=1e-12)
    assert parameter_saving(TRUE, TREATMENT, 1e6) == pytest.approx(0.25, abs=1e-12)
    n_b, loss_b = seeded(TRUE, noise=0.003, draw=1)
    n_t, loss_t = seeded(TREATMENT, noise=0.003, draw=2)
    h = headline("Llama", fit_family(n_b, loss_b), "CEM", fit_family(n_t, loss_t, seed=1))
    assert h.at_n == 16e6
    assert h.fewer == pytest.approx(0.25, abs=0.02)
    assert h.ci[0] <= 0.25 <= h.ci[1] and h.ci[1] - h.ci[0] < 0.1
    assert h.text.startswith("CEM reaches Llama's perplexity with 25% fewer non-embedding "
                             "parameters (95% CI ")
    assert h.text.endswith(") at 16M")


def test_a_treatment_needing_more_parameters_says_more():
    worse = PowerLaw(E=TRUE.E, A=TRUE.A * 1.1**TRUE.alpha, alpha=TRUE.alpha)
    h = headline("Llama", fit_family(SIZES, TRUE(SIZES), samples=10), "CEM",
                 fit_family(SIZES, worse(SIZES), samples=10), what="parameters", metric="loss")
    assert h.fewer == pytest.approx(-0.1, abs=1e-6)
    # one run per size: every bootstrap resample is the data, so no interval is claimed
    assert h.text == ("CEM reaches Llama's loss with 10% more parameters (no interval: one run "
                      "per size) at 16M")


def test_a_treatment_whose_floor_is_above_the_baseline_never_reaches_it():
    floor = PowerLaw(E=TRUE(16e6) + 1.0, A=TRUE.A, alpha=TRUE.alpha)
    assert math.isnan(parameter_saving(TRUE, floor, 16e6))
    h = headline("Llama", fit_family(SIZES, TRUE(SIZES), samples=5), "CEM",
                 fit_family(SIZES, floor(SIZES), samples=5))
    assert h.fewer is None and h.ci is None and "never reaches" in h.text


def test_two_sizes_are_not_enough_to_fit():
    n = [1e6, 1e6, 2e6, 2e6]  # four points, two sizes
    h = headline("Llama", fit_family(n, [40.0, 41.0, 35.0, 35.5]), "CEM",
                 fit_family(n, [39.0, 39.5, 34.0, 34.2]))
    assert (h.text, h.fewer, h.ci, h.at_n) == (
        "not enough sizes to fit: CEM has 2 sizes, Llama has 2; a power law needs 3",
        None, None, None)
    h = headline("Llama", fit_family(SIZES, TRUE(SIZES), samples=5), "CEM",
                 fit_family([1e6], [40.0]))
    assert h.text == "not enough sizes to fit: CEM has 1 size, Llama has 5; a power law needs 3"
    assert MIN_SIZES == 3
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit_power_law(n, [40.0, 41.0, 35.0, 35.5])


def test_inverse_is_infinite_below_the_floor_and_round_trips():
    assert TRUE.inverse(TRUE.E - 1) == math.inf
    assert TRUE.inverse(TRUE.E) == math.inf
    for n in (1e5, 3e6, 7e9):
        assert TRUE.inverse(TRUE(n)) == pytest.approx(n, rel=1e-9)
    assert TRUE(TRUE.inverse(25.0)) == pytest.approx(25.0, rel=1e-12)
    assert isinstance(TRUE(2e6), float)
    assert TRUE(SIZES).shape == (5,)


@pytest.mark.parametrize("n, loss, why", [
    ([1e6, 2e6, 4e6], [30.0, 25.0], "one metric value per size"),
    ([1e6, 0.0, 4e6], [30.0, 25.0, 22.0], "finite and positive"),
    ([1e6, -2e6, 4e6], [30.0, 25.0, 22.0], "finite and positive"),
    ([1e6, 2e6, 4e6], [30.0, math.nan, 22.0], "finite and positive"),
    ([1e6, 2e6, math.inf], [30.0, 25.0, 22.0], "finite and positive"),
    ([1e6, 2e6, 4e6], [30.0, 0.0, 22.0], "finite and positive"),
    ([1e6, 1e6, 4e6], [30.0, 29.0, 22.0], "2 distinct sizes"),
])
def test_bad_input_raises(n, loss, why):
    with pytest.raises(ValueError, match=why):
        fit_power_law(n, loss)
    with pytest.raises(ValueError, match=why):
        bootstrap_band(n, loss, samples=2)


def test_bad_bootstrap_arguments_raise():
    with pytest.raises(ValueError, match="one group per point"):
        bootstrap_band(SIZES, TRUE(SIZES), groups=["a"], samples=2)
    with pytest.raises(ValueError, match="level in"):
        bootstrap_band(SIZES, TRUE(SIZES), level=1.0)
    with pytest.raises(ValueError, match="samples >= 1"):
        bootstrap_band(SIZES, TRUE(SIZES), samples=0)


def test_fit_parameters_have_significant_digits_and_no_bound_when_inside():
    assert fit_parameters(PowerLaw(E=20.123456, A=3012.7, alpha=0.351234), scale=25.0) == {
        "E": "20.12", "A": "3013", "alpha": "0.3512"}
    assert fit_parameters(PowerLaw(E=1.5e-3, A=123456.0, alpha=1.0), 25.0, digits=2) == {
        "E": "0.0015", "A": "1.2e+05", "alpha": "1"}


def test_a_floor_the_data_push_below_zero_is_reported_at_its_bound():
    """Points of 10·N^-0.05 - 1 fall faster than any law with E >= 0 allows: the fit pins E
    at 0 (a hair above it), and the table says so instead of printing 0.0000000000000000001."""
    n = np.array([1e6, 3e6, 1e7, 3e7, 1e8])
    law = fit_power_law(n, 10 * n**-0.05 - 1)
    assert 0 <= law.E < 1e-9
    assert at_bounds(law, law(n.max())) == {"E": "lower"}
    shown = fit_parameters(law, law(n.max()))
    assert shown["E"] == f"{law.E:.4g} (at its lower bound, 0)"
    assert "e-" in shown["E"] and len(shown["E"].split()[0]) <= 10  # 5.067e-22, not 0.000…
    assert "bound" not in shown["A"] + shown["alpha"]


def test_a_decay_steeper_than_alpha_3_is_reported_at_the_upper_bound():
    n = np.arange(1.0, 7.0)
    law = fit_power_law(n, 1 + 100 * n**-5.0)
    assert at_bounds(law, law(n.max()))["alpha"] == "upper"
    assert fit_parameters(law, law(n.max()))["alpha"] == "3 (at its upper bound, 3)"


def test_the_bound_tolerance_is_relative_to_the_metric_for_E_and_absolute_for_alpha():
    near = AT_BOUND_TOL / 2
    assert at_bounds(PowerLaw(E=near * 100, A=1.0, alpha=0.5), scale=100.0) == {"E": "lower"}
    assert at_bounds(PowerLaw(E=near * 100, A=1.0, alpha=0.5), scale=1.0) == {}
    assert at_bounds(PowerLaw(E=5.0, A=1.0, alpha=near), scale=100.0) == {"alpha": "lower"}
    assert at_bounds(PowerLaw(E=5.0, A=1.0, alpha=3 - near), scale=100.0) == {"alpha": "upper"}
    assert at_bounds(PowerLaw(E=5.0, A=1.0, alpha=2.99), scale=100.0) == {}
    with pytest.raises(ValueError, match="scale must be finite and positive"):
        at_bounds(PowerLaw(E=5.0, A=1.0, alpha=0.5), scale=0.0)
    with pytest.raises(ValueError, match="digits must be at least 1"):
        fit_parameters(PowerLaw(E=5.0, A=1.0, alpha=0.5), 1.0, digits=0)
