"""Akima optima over log2(LR): known minima, edge warnings, mean ± std over seeds."""

import math
import statistics

import numpy as np
import pytest

from orchestrator.analysis import Point, akima_optimum, optima_table

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


def test_table_averages_the_per_seed_optima():
    bests = {0: 0.0015, 1: 0.0025, 2: 0.003}
    points = [Point("d", "cem", "micro", seed, lr, bowl(lr, best, 20.0 + seed))
              for seed, best in bests.items() for lr in LRS]
    points += [Point("d", "llama", "micro", 0, lr, 50.0 - 3 * i) for i, lr in enumerate(LRS)]
    rows = {r["variant"]: r for r in optima_table(points, "perplexity")}
    cem = rows["cem"]
    per_seed = [akima_optimum(LRS, [bowl(lr, b, 20.0 + s) for lr in LRS])
                for s, b in bests.items()]
    assert cem["seeds"] == 3 and cem["lrs"] == 5
    assert cem["opt_lr"] == pytest.approx(statistics.fmean(o.lr for o in per_seed))
    assert cem["opt_lr_std"] == pytest.approx(statistics.stdev(o.lr for o in per_seed))
    assert cem["opt_perplexity"] == pytest.approx(21.0, abs=0.1)
    assert cem["opt_perplexity_std"] == pytest.approx(1.0, abs=0.1)
    assert cem["warning"] == ""
    assert rows["llama"]["warning"] == "optimum at a grid edge (seed 0)"
    assert rows["llama"]["opt_perplexity_std"] == 0.0
    assert rows["llama"]["best_tried_perplexity"] == 38.0
