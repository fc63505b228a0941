"""Learning-rate brackets that adapt (``learning_rates: {grid, extend, max_points}``): an
optimum at the edge of a grid is not an optimum. After each round of trials, an arm (dataset,
variant, size) whose validation optimum (``analysis.seed_choices``, per seed) sits at the
smallest or largest learning rate it has trained gets the next point beyond that edge, at the
log spacing of the two outermost points there, for every seed; rounds repeat until every arm's
optimum is interior or it has ``max_points`` learning rates. Other arms keep the grid."""

from __future__ import annotations

from collections import defaultdict

from orchestrator.analysis import Point, seed_choices
from orchestrator.ledger import TrialRow

Arm = tuple[str, str, str]  # (dataset, variant, size)


def beyond(lrs: list[float], low: bool, high: bool, room: int) -> list[float]:
    """The next learning rates past the ends of ``lrs`` (ascending, at least two) that an optimum
    at the ``low`` and/or ``high`` end asks for, at most ``room`` of them (the low end first):
    ``lrs[0]^2 / lrs[1]`` and ``lrs[-1]^2 / lrs[-2]``, i.e. the spacing at that end continued
    in log space, rounded to 6 significant digits."""
    ends = ([lrs[0] ** 2 / lrs[1]] if low else []) + ([lrs[-1] ** 2 / lrs[-2]] if high else [])
    return [float(f"{lr:.6g}") for lr in ends[:max(room, 0)]]


def next_round(rows: list[TrialRow], points: list[Point], max_points: int,
               ) -> dict[Arm, list[float]]:
    """Per arm, the learning rates to add this round (arms needing none left out).

    ``rows``: every ledger row of the arms planned so far, whatever their status (a learning
    rate whose trial failed still counts as trained, so a diverged edge is not planned again);
    ``points``: the finished ones. An arm extends at an end when any seed's validation optimum
    lies at that end of the arm's learning rates."""
    planned: dict[Arm, set[float]] = defaultdict(set)
    for r in rows:
        planned[(r.dataset, r.variant, r.size)].add(r.lr)
    out = {}
    for arm, by_seed in seed_choices(points).items():
        lrs = sorted(planned[arm])
        if len(lrs) < 2:
            continue
        low = any(c.at_edge and c.lr <= lrs[0] for c in by_seed.values())
        high = any(c.at_edge and c.lr >= lrs[-1] for c in by_seed.values())
        more = beyond(lrs, low, high, max_points - len(lrs))
        if more:
            out[arm] = more
    return out
