"""Learning-rate brackets that adapt (``learning_rates: {grid, extend, max_points}``): an
optimum at the edge of a grid is not an optimum. After each round of trials, an arm (dataset,
variant, size) in which any seed's best finished validation value sits at the smallest or
largest learning rate the arm has planned gets the next point beyond that edge, at the log
spacing of the two outermost points there, for every seed; rounds repeat until every arm's
optimum is interior or it has ``max_points`` learning rates. Other arms keep the grid."""

from __future__ import annotations

from collections import defaultdict

from orchestrator.records.ledger import TrialRow
from orchestrator.science.analysis import Point

Arm = tuple[str, str, str]  # (dataset, variant, size)


def same_lr(a: float, b: float) -> bool:
    """Whether two learning rates are one grid point (relative difference below 1e-9)."""
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def beyond(lrs: list[float], low: bool, high: bool, room: int) -> list[float]:
    """The next learning rates past the ends of ``lrs`` (ascending, at least two) that an optimum
    at the ``low`` and/or ``high`` end asks for, at most ``room`` of them (the low end first):
    ``lrs[0]^2 / lrs[1]`` and ``lrs[-1]^2 / lrs[-2]``, i.e. the spacing at that end continued
    in log space, rounded to 6 significant digits."""
    ends = ([lrs[0] ** 2 / lrs[1]] if low else []) + ([lrs[-1] ** 2 / lrs[-2]] if high else [])
    return [float(f"{lr:.6g}") for lr in ends[:max(room, 0)]]


def reachable(grid: list[float], max_points: int) -> list[float]:
    """Every learning rate that rounds of ``beyond`` can add to ``grid`` (ascending, at least
    two) within ``max_points``: each end's spacing continued, up to ``max_points - len(grid)``
    points a side. A ledger row of an added point whose learning rate is not among them belongs
    to another grid."""
    out, room = [], max_points - len(grid)
    for low in (True, False):
        lrs = list(grid)
        for _ in range(room):
            (lr,) = beyond(lrs, low, not low, 1)
            lrs = [lr, *lrs] if low else [*lrs, lr]
            out.append(lr)
    return out


def next_round(rows: list[TrialRow], points: list[Point], max_points: int,
               ) -> dict[Arm, list[float]]:
    """Per arm, the learning rates to add this round (arms needing none left out).

    ``rows``: every ledger row of the arms planned so far, whatever their status (a learning
    rate whose trial failed still counts as planned, so a diverged edge is not planned again);
    ``points``: the finished ones with finite metrics. An arm extends at an end when any seed's
    best validation value among its finished points lies at that end of the arm's planned
    learning rates; a point already planned is never added again."""
    planned: dict[Arm, set[float]] = defaultdict(set)
    for r in rows:
        planned[(r.dataset, r.variant, r.size)].add(r.lr)
    best: dict[Arm, dict[int, Point]] = defaultdict(dict)
    for p in points:
        seeds = best[(p.dataset, p.variant, p.size)]
        if p.seed not in seeds or p.val < seeds[p.seed].val:
            seeds[p.seed] = p
    out = {}
    for arm, by_seed in best.items():
        lrs = sorted(planned[arm])
        if len(lrs) < 2:
            continue
        low = any(same_lr(p.lr, lrs[0]) for p in by_seed.values())
        high = any(same_lr(p.lr, lrs[-1]) for p in by_seed.values())
        more = [lr for lr in beyond(lrs, low, high, max_points - len(lrs))
                if not any(same_lr(lr, had) for had in lrs)]
        if more:
            out[arm] = more
    return out
