"""Learning rates chosen on validation. For the claims (``choose_lr``): once per arm, the
trained learning rate of lowest mean log validation over its tuning seeds, and the validation
set's noise bound (``set_noise``). For display (``cemlab results``, the dashboard): each seed's
optimum by Akima interpolation over log2(LR) (paper Sec. 4.2, Fig. 3a), with test read there;
no verdict reads an interpolated value."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from scipy.interpolate import Akima1DInterpolator

_GRID_POINTS = 1001  # evaluation points of the interpolant between the extreme learning rates


@dataclass(frozen=True)
class Optimum:
    """The interpolated minimum of a metric over learning rates for one seed.

    ``at_edge``: the minimum lies at the smallest or largest learning rate of a grid of two or
    more, so the true optimum may lie outside the grid.
    """

    lr: float
    value: float
    at_edge: bool
    n_points: int


def _interpolant(lrs: list[float], values: list[float]):
    """``(x, y, f)``: the sorted log2 learning rates, their values, and ``f(log2_lr)`` the Akima
    interpolant through them (linear for two points, constant for one).

    Raises:
        ValueError: no points, mismatched lengths, repeated learning rates or non-finite values.
    """
    if not lrs or len(lrs) != len(values):
        raise ValueError("need as many values as learning rates, at least one")
    if len(set(lrs)) != len(lrs):
        raise ValueError("learning rates must be distinct")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"non-finite metric values: {values}")
    order = np.argsort(lrs)
    x = np.log2(np.asarray(lrs, dtype=float)[order])
    y = np.asarray(values, dtype=float)[order]
    if len(x) == 1:
        return x, y, lambda g: np.full_like(np.asarray(g, dtype=float), y[0])
    if len(x) == 2:
        return x, y, lambda g: np.interp(g, x, y)
    return x, y, Akima1DInterpolator(x, y)


def akima_optimum(lrs: list[float], values: list[float]) -> Optimum:
    """Minimum of the Akima interpolant of ``values`` over log2(``lrs``).

    The interpolant (``scipy.interpolate.Akima1DInterpolator``) is evaluated on
    ``_GRID_POINTS`` evenly spaced log2 learning rates between the extremes, and at the grid
    points themselves; with one learning rate the optimum is that point.

    Raises:
        ValueError: as ``_interpolant``.
    """
    x, y, f = _interpolant(lrs, values)
    if len(x) == 1:
        return Optimum(float(lrs[0]), float(values[0]), False, 1)
    grid = np.union1d(np.linspace(x[0], x[-1], _GRID_POINTS), x)
    fitted = f(grid)
    best = int(np.argmin(fitted))
    return Optimum(float(2 ** grid[best]), float(fitted[best]),
                   bool(best == 0 or best == len(grid) - 1 or np.argmin(y) in (0, len(y) - 1)),
                   len(x))


def akima_curve(lrs: list[float], values: list[float], at: np.ndarray) -> np.ndarray:
    """The Akima interpolant of ``values`` over log2(``lrs``) at the learning rates ``at``
    (clipped to the grid's range): the curve a sweep plot draws.

    Raises:
        ValueError: as ``_interpolant``.
    """
    x, _, f = _interpolant(lrs, values)
    return np.asarray(f(np.clip(np.log2(np.asarray(at, dtype=float)), x[0], x[-1])), dtype=float)


def akima_value(lrs: list[float], values: list[float], lr: float) -> float:
    """The Akima interpolant of ``values`` over log2(``lrs``) at ``lr`` (within the grid).

    Raises:
        ValueError: as ``_interpolant``, or ``lr`` outside the grid's range.
    """
    x, _, f = _interpolant(lrs, values)
    at = math.log2(lr)
    if not x[0] - 1e-9 <= at <= x[-1] + 1e-9:
        raise ValueError(f"learning rate {lr:g} outside the grid {min(lrs):g}..{max(lrs):g}")
    return float(f(np.clip(at, x[0], x[-1])))


@dataclass(frozen=True)
class Point:
    """One finished trial: its grid coordinates, validation and test metrics."""

    dataset: str
    variant: str
    size: str
    seed: int
    lr: float
    val: float
    test: float


@dataclass(frozen=True)
class Choice:
    """One seed's learning rate chosen on validation and the test metric there."""

    lr: float  # the Akima optimum of validation over log2(LR)
    val: float  # validation at that LR (the interpolant's minimum)
    test: float  # test: its own Akima interpolant at that LR
    nearest: float  # test of the trained LR nearest the chosen one (in log2)
    at_edge: bool
    n_points: int
    nearest_lr: float  # that trained LR


def seed_choices(points: list[Point]) -> dict[tuple[str, str, str], dict[int, Choice]]:
    """Per (dataset, variant, size) and seed: the learning rate chosen on validation (the Akima
    optimum of ``val`` over that seed's learning rates) and the test metric at the choice.
    Test never chooses anything."""
    groups: dict[tuple, dict[int, list[Point]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        groups[(p.dataset, p.variant, p.size)][p.seed].append(p)
    out: dict[tuple[str, str, str], dict[int, Choice]] = {}
    for key, by_seed in groups.items():
        out[key] = {}
        for seed, ps in sorted(by_seed.items()):
            lrs = [p.lr for p in ps]
            opt = akima_optimum(lrs, [p.val for p in ps])
            near = min(ps, key=lambda p: abs(math.log2(p.lr / opt.lr)))
            out[key][seed] = Choice(
                opt.lr, opt.value, akima_value(lrs, [p.test for p in ps], opt.lr), near.test,
                opt.at_edge, opt.n_points, near.lr)
    return out


def optima_table(points: list[Point], metric: str) -> list[dict]:
    """Per (dataset, variant, size): each seed's ``Choice`` (``seed_choices``), then mean ± std
    over seeds (sample std; 0 for one seed).

    Rows carry ``dataset, variant, size, seeds, lrs`` (points per seed), ``opt_lr`` and
    ``opt_lr_std`` (the chosen LR), ``opt_val_<metric>`` and ``_std`` (validation at the
    optimum), ``opt_<metric>`` and ``_std`` (test: its Akima interpolant at the chosen LR),
    ``nearest_<metric>`` (test of the trained LR nearest the chosen one, in log2) and
    ``warning`` (seeds whose optimum sits at a grid edge). Test never chooses anything.
    """
    rows = []
    for (dataset, variant, size), chosen in seed_choices(points).items():
        lr_opts = [c.lr for c in chosen.values()]
        val_opts = [c.val for c in chosen.values()]
        tests = [c.test for c in chosen.values()]
        edge = [str(s) for s, c in chosen.items() if c.at_edge]
        rows.append({
            "dataset": dataset, "variant": variant, "size": size, "seeds": len(chosen),
            "lrs": max(c.n_points for c in chosen.values()),
            "opt_lr": statistics.fmean(lr_opts), "opt_lr_std": _std(lr_opts),
            f"opt_val_{metric}": statistics.fmean(val_opts),
            f"opt_val_{metric}_std": _std(val_opts),
            f"opt_{metric}": statistics.fmean(tests), f"opt_{metric}_std": _std(tests),
            f"nearest_{metric}": statistics.fmean(c.nearest for c in chosen.values()),
            "warning": f"optimum at a grid edge (seed {', '.join(edge)})" if edge else ""})
    return rows


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


@dataclass(frozen=True)
class ArmChoice:
    """The learning rate of one arm (dataset, variant, size), chosen once on the seed-averaged
    validation metric of its tuning seeds among the learning rates it trained.

    ``lrs``: the arm's trained learning rates (ascending; its grid and what its bracket added);
    ``seeds``: the tuning seeds averaged; ``mean_log_val``: per learning rate, the seeds' mean
    of log validation (infinite where any of them diverged); ``at_edge``: the choice is the
    smallest or largest of two or more learning rates, so it is no optimum; ``val_sd``: the
    seeds' standard deviation of log validation at the choice (0 for one seed);
    ``runner_up`` and ``gap``: the learning rate with the next lowest mean and its distance
    from the choice's (log units; None with one finite learning rate).
    """

    lr: float
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    mean_log_val: tuple[float, ...]  # in the order of ``lrs``
    at_edge: bool
    val_sd: float
    runner_up: float | None
    gap: float | None


def choose_lr(lrs: list[float], val: dict[int, dict[float, float]]) -> ArmChoice | None:
    """The learning rate among ``lrs`` (an arm's trained learning rates) with the lowest mean
    over seeds of log validation metric, ``val`` mapping each tuning seed to its validation
    metric per learning rate (every seed every learning rate: ``math.inf`` where it diverged).
    The mean of logs is the log of the geometric mean; a learning rate at which any seed
    diverged has an infinite mean and is never chosen. No interpolation: only a trained
    learning rate is chosen. None without seeds or without a finite mean.

    Raises:
        ValueError: a seed lacks one of ``lrs``, or a value is not positive.
    """
    lrs = sorted(lrs)
    seeds = tuple(sorted(val))
    if not seeds or not lrs:
        return None
    for seed in seeds:
        if len(val[seed]) != len(lrs) or not all(
                any(_same(lr, had) for had in val[seed]) for lr in lrs):
            raise ValueError(f"seed {seed} has learning rates {sorted(val[seed])}, not {lrs}")
        if any(not v > 0 for v in val[seed].values()):
            raise ValueError(f"seed {seed}: a validation metric is not positive")

    def at(seed: int, lr: float) -> float:
        return next(v for had, v in val[seed].items() if _same(lr, had))

    means = [statistics.fmean(math.log(at(s, lr)) for s in seeds) for lr in lrs]
    order = sorted(range(len(lrs)), key=lambda i: means[i])
    best = order[0]
    if not math.isfinite(means[best]):
        return None
    logs = [math.log(at(s, lrs[best])) for s in seeds]
    second = order[1] if len(order) > 1 and math.isfinite(means[order[1]]) else None
    return ArmChoice(lrs[best], tuple(lrs), seeds, tuple(means),
                     len(lrs) > 1 and best in (0, len(lrs) - 1), _std(logs),
                     lrs[second] if second is not None else None,
                     means[second] - means[best] if second is not None else None)


def set_noise(points: list[Point]) -> float | None:
    """The standard deviation over ``points`` (one arm's finished tuning trials) of
    ``log val - log test`` about its mean: the disagreement of the validation and test splits
    on one trained model, in log units. It bounds from above the validation set's own noise on
    one trial's log validation metric (the whole test split adds its smaller noise). None with
    fewer than 3 points."""
    if len(points) < 3:
        return None
    return statistics.stdev(math.log(p.val) - math.log(p.test) for p in points)


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
