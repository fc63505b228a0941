"""Akima optima over log2(LR): known minima, edge warnings, the choice on validation with
test reported there, mean ± std over seeds; the arm's learning rate chosen once on its seeds'
mean log validation among trained learning rates, and the validation set's noise bound."""

import math
import statistics

import numpy as np
import pytest

from orchestrator.science.analysis import (
    Point,
    akima_optimum,
    akima_value,
    choose_lr,
    optima_table,
    set_noise,
)

LRS = [0.0005, 0.001, 0.002, 0.004, 0.008]


def bowl(lr: float, best: float, floor: float) -> float:
    return floor + (math.log2(lr) - math.log2(best)) ** 2


@pytest.mark.parametrize("best", [0.0012, 0.0028, 0.005])
def test_optimum_of_a_bowl_in_log2_lr_is_found_between_grid_points(best):
    opt = akima_optimum(LRS, [bowl(lr, best, 20.0) for lr in LRS])
    # Akima of a parabola sampled at 5 points is close to the parabola between them.
    assert math.log2(opt.lr) == pytest.approx(math.log2(best), abs=0.1)
    assert opt.value == pytest.approx(20.0, abs=0.05)
    assert not opt.at_edge and opt.n_points == 5


def test_order_of_points_does_not_matter_and_interpolant_passes_through_them():
    values = [31.0, 25.0, 24.0, 26.5, 33.0]
    a = akima_optimum(LRS, values)
    b = akima_optimum(LRS[::-1], values[::-1])
    assert (a.lr, a.value) == (b.lr, b.value)
    assert a.value <= min(values)


def test_an_optimum_at_the_grid_edge_is_flagged():
    falling = [40.0, 35.0, 31.0, 28.0, 26.0]
    opt = akima_optimum(LRS, falling)
    assert opt.at_edge and opt.lr == pytest.approx(0.008) and opt.value == 26.0
    assert not akima_optimum([0.002], [30.0]).at_edge  # one LR: nothing to interpolate


@pytest.mark.parametrize(("lrs", "values"), [([], []), ([0.1, 0.1], [1.0, 2.0]),
                                            ([0.1, 0.2], [1.0]), ([0.1, 0.2], [1.0, np.nan])])
def test_bad_inputs_raise(lrs, values):
    with pytest.raises(ValueError):
        akima_optimum(lrs, values)


def test_a_value_is_interpolated_only_inside_the_grid():
    values = [31.0, 25.0, 24.0, 26.5, 33.0]
    for lr, v in zip(LRS, values):  # through its points
        assert akima_value(LRS, values, lr) == pytest.approx(v)
    with pytest.raises(ValueError, match="outside the grid"):
        akima_value(LRS, values, 0.02)


def test_the_lr_is_chosen_on_validation_and_test_is_reported_there():
    # Validation's bowl is centred elsewhere than test's: choosing on test would give ~30.
    val_best = {0: 0.0015, 1: 0.0025, 2: 0.003}
    test_best = 0.006
    points = [Point("d", "cem", "micro", seed, lr, bowl(lr, best, 20.0 + seed),
                    bowl(lr, test_best, 30.0 + seed))
              for seed, best in val_best.items() for lr in LRS]
    points += [Point("d", "llama", "micro", 0, lr, 50.0 - 3 * i, 60.0 - i)
               for i, lr in enumerate(LRS)]
    rows = {r["variant"]: r for r in optima_table(points, "perplexity")}
    cem = rows["cem"]
    per_seed = [akima_optimum(LRS, [bowl(lr, b, 20.0 + s) for lr in LRS])
                for s, b in val_best.items()]
    assert cem["seeds"] == 3 and cem["lrs"] == 5
    assert cem["opt_lr"] == pytest.approx(statistics.fmean(o.lr for o in per_seed))
    assert cem["opt_lr_std"] == pytest.approx(statistics.stdev(o.lr for o in per_seed))
    assert cem["opt_val_perplexity"] == pytest.approx(21.0, abs=0.1)
    assert cem["opt_val_perplexity_std"] == pytest.approx(1.0, abs=0.1)
    # Test at each seed's validation choice: the test parabola there (Akima follows it).
    at_choice = [30.0 + s + (math.log2(o.lr) - math.log2(test_best)) ** 2
                 for s, o in zip(val_best, per_seed)]
    assert cem["opt_perplexity"] == pytest.approx(statistics.fmean(at_choice), abs=0.1)
    assert cem["opt_perplexity"] > 31.0 + 1.0  # worse than test's own minimum: not chosen on it
    nearest = [min(LRS, key=lambda lr: abs(math.log2(lr / o.lr))) for o in per_seed]
    assert cem["nearest_perplexity"] == pytest.approx(statistics.fmean(
        bowl(lr, test_best, 30.0 + s) for s, lr in zip(val_best, nearest)))
    assert cem["warning"] == ""
    llama = rows["llama"]
    assert llama["warning"] == "optimum at a grid edge (seed 0)"
    assert llama["opt_lr"] == pytest.approx(0.008) and llama["opt_perplexity"] == 56.0
    assert llama["opt_perplexity_std"] == 0.0 and llama["nearest_perplexity"] == 56.0


def test_the_lr_is_chosen_once_per_arm_on_the_seeds_mean_log_validation():
    """Seeds disagree on their own best learning rate; the arm takes the trained learning rate
    of lowest mean log validation (the geometric mean), never an interpolated one."""
    val = {0: {lr: bowl(lr, 0.0011, 20.0) for lr in LRS},
           1: {lr: bowl(lr, 0.0035, 20.0) for lr in LRS},
           2: {lr: bowl(lr, 0.0030, 20.0) for lr in LRS}}
    choice = choose_lr(LRS, val)
    means = {lr: statistics.fmean(math.log(val[s][lr]) for s in val) for lr in LRS}
    best = min(means, key=means.get)
    assert choice.lr == best == 0.002 and choice.lr in LRS
    assert choice.seeds == (0, 1, 2) and choice.lrs == tuple(LRS) and not choice.at_edge
    assert choice.mean_log_val == pytest.approx([means[lr] for lr in LRS])
    runner_up = sorted(means, key=means.get)[1]
    assert choice.runner_up == runner_up
    assert choice.gap == pytest.approx(means[runner_up] - means[best])
    assert choice.val_sd == pytest.approx(statistics.stdev(math.log(val[s][best]) for s in val))
    # a learning rate where one seed diverged is never chosen, whatever the others say
    val[1][0.002] = math.inf
    assert choose_lr(LRS, val).lr != 0.002
    # at the grid's end: chosen, and flagged as no optimum
    falling = {s: {lr: 40.0 - 2 * i for i, lr in enumerate(LRS)} for s in range(2)}
    edge = choose_lr(LRS, falling)
    assert edge.lr == 0.008 and edge.at_edge
    assert not choose_lr([0.002], {0: {0.002: 30.0}}).at_edge  # one LR: fixed, not chosen
    assert choose_lr(LRS, {0: {lr: math.inf for lr in LRS}}) is None
    with pytest.raises(ValueError, match="seed 0 has learning rates"):
        choose_lr(LRS, {0: {0.001: 3.0}})


def test_the_set_noise_is_the_spread_of_log_val_less_log_test():
    rng = np.random.default_rng(1)
    noise = rng.normal(0, 0.01, 12)
    points = [Point("d", "llama", "nano", i % 3, LRS[i % 4], 30.0 * math.exp(e), 31.0)
              for i, e in enumerate(noise)]
    assert set_noise(points) == pytest.approx(float(np.std(noise, ddof=1)), rel=1e-9)
    assert set_noise(points[:2]) is None
