"""The statistics of a claim's verdict (docs/statistics.md has the formulas): Student-t intervals
of per-seed paired effects, Holm's step-down correction across a claim's comparisons, the
two one-sided tests (TOST) of equivalence, and the five verdicts.

A comparison at one (dataset, size) is ``supports`` when its Holm-adjusted interval lies on the
claimed side of its threshold, ``contradicts`` when it lies on the other side, ``equivalent``
when its TOST interval lies inside the claim's equivalence margin, and ``underpowered``
otherwise (with fewer than 2 seeds, always): the interval is too wide for any of them. A claim
is the one verdict its comparisons share; ``mixed`` when they reach different ones (sizes
disagree); ``underpowered`` when the others agree and some are underpowered.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

SUPPORTS, CONTRADICTS, EQUIVALENT, MIXED, UNDERPOWERED, NOT_RUN = (
    "supports", "contradicts", "equivalent", "mixed", "underpowered", "not run")
DEFINITE = (SUPPORTS, CONTRADICTS, EQUIVALENT)
ALPHA = 0.05  # the family-wise error rate of a claim's comparisons


@dataclass(frozen=True)
class Sample:
    """One comparison's per-seed effects against its ``threshold`` (0, or the not-worse
    margin), with its equivalence ``margin`` (relative, e.g. 0.01 for ±1 %)."""

    effects: tuple[float, ...]
    threshold: float
    margin: float

    @property
    def n(self) -> int:
        return len(self.effects)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.effects)

    @property
    def se(self) -> float:
        """Standard error of the mean (0 with fewer than 2 effects)."""
        return statistics.stdev(self.effects) / math.sqrt(self.n) if self.n > 1 else 0.0

    def p_value(self) -> float:
        """Two-sided p of H0: mean effect = ``threshold`` (Student t, n - 1 degrees of
        freedom); 1 with fewer than 2 effects, 0 or 1 when every effect is equal."""
        if self.n < 2:
            return 1.0
        if self.se == 0:
            return 0.0 if self.mean != self.threshold else 1.0
        from scipy.stats import t

        return float(2 * t.sf(abs(self.mean - self.threshold) / self.se, self.n - 1))

    def interval(self, alpha: float) -> tuple[float, float] | None:
        """The two-sided 1 - ``alpha`` Student-t interval of the mean; None for n < 2."""
        if self.n < 2:
            return None
        if self.se == 0:
            return self.mean, self.mean
        from scipy.stats import t

        half = float(t.ppf(1 - alpha / 2, self.n - 1)) * self.se
        return self.mean - half, self.mean + half


def holm_levels(p_values: list[float], alpha: float = ALPHA) -> list[float]:
    """Each test's error rate under Holm's step-down procedure over the family ``p_values``:
    sorted ascending, the r-th (from 0) of m is tested at alpha / (m - r) while every earlier
    one was rejected; from the first that is not, every remaining one keeps that level. An
    interval at 1 - level is then compatible with the procedure's decisions."""
    m = len(p_values)
    levels = [alpha] * m
    stopped: float | None = None
    for rank, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        level = stopped if stopped is not None else alpha / (m - rank)
        if stopped is None and p_values[i] > level:
            stopped = level
        levels[i] = level
    return levels


def verdict(sample: Sample, alpha: float) -> str:
    """The verdict of one comparison at Holm level ``alpha``: supports (the 1 - alpha interval
    below the threshold: the treatment lower, or worse by less than the not-worse margin),
    contradicts (above it), equivalent (the 1 - 2 alpha interval inside ±margin: TOST), else
    underpowered."""
    ci = sample.interval(alpha)
    if ci is None:
        return UNDERPOWERED
    if ci[1] < sample.threshold:
        return SUPPORTS
    if ci[0] > sample.threshold:
        return CONTRADICTS
    tost = sample.interval(2 * alpha)
    if -sample.margin < tost[0] and tost[1] < sample.margin:
        return EQUIVALENT
    return UNDERPOWERED


def combine(verdicts: list[str]) -> str:
    """A claim's verdict from its comparisons' (module docstring); ``not run`` without any."""
    if not verdicts:
        return NOT_RUN
    definite = {v for v in verdicts if v in DEFINITE}
    if len(definite) > 1:
        return MIXED
    if UNDERPOWERED in verdicts:
        return UNDERPOWERED
    return definite.pop()
