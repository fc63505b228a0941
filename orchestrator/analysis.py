"""Optimal learning rates by Akima interpolation over log2(LR) (paper Sec. 4.2, Fig. 3a)."""

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


def akima_optimum(lrs: list[float], values: list[float]) -> Optimum:
    """Minimum of the Akima interpolant of ``values`` over log2(``lrs``).

    The interpolant (``scipy.interpolate.Akima1DInterpolator``) is evaluated on
    ``_GRID_POINTS`` evenly spaced log2 learning rates between the extremes, and at the grid
    points themselves; with one learning rate the optimum is that point.

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
        return Optimum(float(lrs[0]), float(values[0]), False, 1)
    grid = np.union1d(np.linspace(x[0], x[-1], _GRID_POINTS), x)
    fitted = Akima1DInterpolator(x, y)(grid) if len(x) > 2 else np.interp(grid, x, y)
    best = int(np.argmin(fitted))
    return Optimum(float(2 ** grid[best]), float(fitted[best]),
                   bool(best == 0 or best == len(grid) - 1 or np.argmin(y) in (0, len(y) - 1)),
                   len(x))


@dataclass(frozen=True)
class Point:
    """One finished trial: its grid coordinates and its test metric."""

    dataset: str
    variant: str
    size: str
    seed: int
    lr: float
    value: float


def optima_table(points: list[Point], metric: str) -> list[dict]:
    """Per (dataset, variant, size): the Akima optimum of every seed, then mean ± std over seeds
    (sample std; 0 for one seed) of the optimal LR and the optimal ``metric``.

    Rows carry ``dataset, variant, size, seeds, lrs`` (points per seed), ``opt_lr``,
    ``opt_lr_std``, ``opt_<metric>``, ``opt_<metric>_std``, ``best_tried_<metric>`` (the best
    trial actually run) and ``warning`` (seeds whose optimum sits at a grid edge).
    """
    groups: dict[tuple, dict[int, list[Point]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        groups[(p.dataset, p.variant, p.size)][p.seed].append(p)
    rows = []
    for (dataset, variant, size), by_seed in groups.items():
        optima = {seed: akima_optimum([p.lr for p in ps], [p.value for p in ps])
                  for seed, ps in sorted(by_seed.items())}
        lr_opts = [o.lr for o in optima.values()]
        v_opts = [o.value for o in optima.values()]
        edge = [str(s) for s, o in optima.items() if o.at_edge]
        rows.append({
            "dataset": dataset, "variant": variant, "size": size, "seeds": len(optima),
            "lrs": max(o.n_points for o in optima.values()),
            "opt_lr": statistics.fmean(lr_opts), "opt_lr_std": _std(lr_opts),
            f"opt_{metric}": statistics.fmean(v_opts), f"opt_{metric}_std": _std(v_opts),
            f"best_tried_{metric}": min(p.value for ps in by_seed.values() for p in ps),
            "warning": f"optimum at a grid edge (seed {', '.join(edge)})" if edge else ""})
    return rows


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0
