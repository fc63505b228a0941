"""Learning-rate brackets that adapt: the next point beyond an edge optimum, per arm."""

import math

import pytest

from orchestrator.records.ledger import Status, TrialRow
from orchestrator.science.analysis import Point
from orchestrator.science.brackets import beyond, next_round, reachable


def _arm(variant: str, vals: dict[float, list[float]], failed: tuple[float, ...] = ()):
    """Rows and finished points of one arm: ``vals`` maps a learning rate to each seed's
    validation value; ``failed`` learning rates are planned rows without a result."""
    rows, points = [], []
    for lr, per_seed in vals.items():
        for seed, val in enumerate(per_seed):
            rows.append(TrialRow(dataset="d", variant=variant, size="nano", lr=lr, seed=seed,
                                 status=Status.FINISHED))
            points.append(Point("d", variant, "nano", seed, lr, val, val + 0.5))
    rows += [TrialRow(dataset="d", variant=variant, size="nano", lr=lr, seed=0,
                      status=Status.FAILED) for lr in failed]
    return rows, points


def test_the_next_point_continues_the_spacing_at_that_end_in_log_space():
    lrs = [0.001, 0.003, 0.004]
    low, high = beyond(lrs, low=True, high=True, room=2)
    step = pytest.approx  # at 6 significant digits
    assert math.log(lrs[0]) - math.log(low) == step(math.log(lrs[1] / lrs[0]), rel=1e-5)
    assert math.log(high) - math.log(lrs[-1]) == step(math.log(lrs[-1] / lrs[-2]), rel=1e-5)
    assert beyond(lrs, low=True, high=True, room=1) == [low]  # the low end first
    assert beyond(lrs, low=False, high=True, room=0) == []
    assert beyond([0.001, 0.002], low=False, high=True, room=3) == [0.004]  # 6 digits, no 1e-19


def test_only_an_arm_at_an_edge_extends_and_only_at_that_edge():
    grid = [0.001, 0.002, 0.004]
    rising, r_points = _arm("llama", {lr: [3.0 - lr * 100] * 2 for lr in grid})  # best: top
    bowl, b_points = _arm("cem", {0.001: [3.0, 3.1], 0.002: [2.5, 2.6], 0.004: [2.9, 3.0]})
    out = next_round(rising + bowl, r_points + b_points, max_points=8)
    assert out == {("d", "llama", "nano"): [0.008]}


def test_seeds_at_opposite_edges_extend_both_ends_within_the_cap():
    rows, points = _arm("llama", {0.001: [2.0, 3.0], 0.002: [2.5, 2.5], 0.004: [3.0, 2.0]})
    assert next_round(rows, points, max_points=5) == {("d", "llama", "nano"): [0.0005, 0.008]}
    assert next_round(rows, points, max_points=4) == {("d", "llama", "nano"): [0.0005]}
    assert next_round(rows, points, max_points=3) == {}


def test_a_failed_learning_rate_beyond_the_edge_counts_as_planned():
    """The optimum sits at the best finished LR, but the next one up was planned and failed
    (diverged): it is not planned again, and nothing lies beyond it."""
    rows, points = _arm("llama", {0.001: [3.0], 0.002: [2.0]}, failed=(0.004,))
    assert next_round(rows, points, max_points=8) == {}


@pytest.mark.parametrize("grid", [[0.01, 0.02, 0.04], [0.0003, 0.0006, 0.0012],
                                  [0.001, 0.00316228, 0.01]])
def test_an_edge_optimum_extends_whatever_the_grid_s_numbers(grid):
    """The edge is the best finished point's own learning rate, compared with a relative
    tolerance: no round trip through log2 can move it off the grid's end."""
    low_best = {grid[0]: [1.0], grid[1]: [1.001], grid[2]: [1.2]}  # Akima: just inside
    rows, points = _arm("llama", low_best)
    assert next_round(rows, points, max_points=8) == {
        ("d", "llama", "nano"): beyond(grid, low=True, high=False, room=1)}
    rows, points = _arm("llama", {grid[0]: [1.2], grid[1]: [1.001], grid[2]: [1.0]})
    assert next_round(rows, points, max_points=8) == {
        ("d", "llama", "nano"): beyond(grid, low=False, high=True, room=1)}


def test_a_point_already_planned_is_not_added_again():
    """A grid too fine for 6 significant digits would give back its own end point: nothing is
    added, so the rounds end."""
    rows, points = _arm("llama", {0.001: [1.0], 0.0010000001: [2.0]})
    assert next_round(rows, points, max_points=8) == {}


def test_the_points_a_bracket_can_reach_continue_each_end_within_the_cap():
    assert reachable([0.001, 0.002, 0.004], 6) == [0.0005, 0.00025, 0.000125,
                                                    0.008, 0.016, 0.032]
    assert reachable([0.001, 0.002, 0.004], 3) == []
    # each added point continues the spacing of the two outermost, itself included
    low = reachable([0.001, 0.003], 4)[:2]
    assert low[1] == pytest.approx(low[0] ** 2 / 0.001, rel=1e-5)
