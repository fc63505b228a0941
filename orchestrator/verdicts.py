"""The statistics of a claim's verdict (docs/statistics.md has the formulas): Student-t intervals
of per-seed paired effects, Holm's step-down correction across a claim's comparisons, the
two one-sided tests (TOST) of equivalence, the minimum detectable effect, and the verdicts.

A comparison at one (dataset, size) is ``supports`` when its Holm-adjusted interval lies on the
claimed side of its threshold, ``contradicts`` when it lies on the other side, ``equivalent``
when its TOST interval lies inside the claim's equivalence margin, and ``underpowered``
otherwise (with fewer than 2 seeds, always): the interval is too wide for any of them. A
comparison whose own test is TOST (``Sample.tost``) is ``supports`` when TOST rejects a
difference of the margin or more, ``contradicts`` when its interval lies outside the margin.
A claim is the one verdict its decided comparisons share; ``mixed`` when they reach different
ones; ``underpowered`` only when none is decided (``combine``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

SUPPORTS, CONTRADICTS, EQUIVALENT, MIXED, UNDERPOWERED, NOT_RUN = (
    "supports", "contradicts", "equivalent", "mixed", "underpowered", "not run")
DEFINITE = (SUPPORTS, CONTRADICTS, EQUIVALENT)
ALPHA = 0.05  # the family-wise error rate of a claim's comparisons
POWER = 0.80  # the power at which the minimum detectable effect is stated
MAX_SEEDS = 100_000  # ``seeds_for`` says None beyond this many seeds


@dataclass(frozen=True)
class Sample:
    """One comparison's per-seed effects (relative, e.g. 0.02 for +2 %) against its
    ``threshold`` (0, or the not-worse margin), with its equivalence ``margin`` (relative,
    e.g. 0.01 for ±1 %). ``tost``: the comparison's own test is equivalence (TOST) rather than
    the test against ``threshold``; ``p_value`` is then TOST's."""

    effects: tuple[float, ...]
    threshold: float
    margin: float
    tost: bool = False

    @property
    def n(self) -> int:
        return len(self.effects)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.effects)

    @property
    def sd(self) -> float:
        """Sample standard deviation of the effects (relative; 0 with fewer than 2)."""
        return statistics.stdev(self.effects) if self.n > 1 else 0.0

    @property
    def se(self) -> float:
        """Standard error of the mean (0 with fewer than 2 effects)."""
        return self.sd / math.sqrt(self.n) if self.n > 1 else 0.0

    def p_value(self) -> float:
        """The p-value of the comparison's own test: TOST's (``p_tost``) when ``tost``, else
        the test against ``threshold`` (``p_threshold``). Holm's family takes this one."""
        return self.p_tost() if self.tost else self.p_threshold()

    def p_threshold(self) -> float:
        """Two-sided p of H0: mean effect = ``threshold`` (Student t, n - 1 degrees of
        freedom); 1 with fewer than 2 effects, 0 or 1 when every effect is equal."""
        if self.n < 2:
            return 1.0
        if self.se == 0:
            return 0.0 if self.mean != self.threshold else 1.0
        from scipy.stats import t

        return float(2 * t.sf(abs(self.mean - self.threshold) / self.se, self.n - 1))

    def p_tost(self) -> float:
        """TOST's p of H0: |mean effect| >= ``margin``: the larger of the one-sided Student-t
        p-values of H0: mean <= -margin and H0: mean >= margin; 1 with fewer than 2 effects,
        0 or 1 when every effect is equal."""
        if self.n < 2:
            return 1.0
        if self.se == 0:
            return 0.0 if abs(self.mean) < self.margin else 1.0
        from scipy.stats import t

        lower = t.sf((self.mean + self.margin) / self.se, self.n - 1)
        upper = t.cdf((self.mean - self.margin) / self.se, self.n - 1)
        return float(max(lower, upper))

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
    """The verdict of one comparison at Holm level ``alpha`` (``tost_verdict`` when its own
    test is TOST): supports (the 1 - alpha interval below the threshold: the treatment lower,
    or worse by less than the not-worse margin), contradicts (above it), equivalent (the
    1 - 2 alpha interval inside ±margin: TOST), else underpowered."""
    if sample.tost:
        return tost_verdict(sample, alpha)
    ci = sample.interval(alpha)
    if ci is None:
        return UNDERPOWERED
    if ci[1] < sample.threshold:
        return SUPPORTS
    if ci[0] > sample.threshold:
        return CONTRADICTS
    if _inside(sample.interval(2 * alpha), sample.margin):
        return EQUIVALENT
    return UNDERPOWERED


def tost_verdict(sample: Sample, alpha: float) -> str:
    """The verdict of a comparison whose claim is equality within ±``margin``: supports (the
    1 - 2 alpha interval inside it: TOST rejects at ``alpha``), contradicts (the 1 - alpha
    interval wholly outside it), else underpowered."""
    ci = sample.interval(alpha)
    if ci is None:
        return UNDERPOWERED
    if _inside(sample.interval(2 * alpha), sample.margin):
        return SUPPORTS
    if ci[0] >= sample.margin or ci[1] <= -sample.margin:
        return CONTRADICTS
    return UNDERPOWERED


def _inside(interval: tuple[float, float], margin: float) -> bool:
    return -margin < interval[0] and interval[1] < margin


def verdict_interval(sample: Sample, alpha: float) -> tuple[tuple[float, float] | None, float]:
    """The interval the verdict of ``sample`` at Holm level ``alpha`` rests on, and its
    coverage (a fraction): the 1 - 2 alpha TOST interval for an equivalence (TOST supports or
    ``equivalent``), else the 1 - alpha interval."""
    v = verdict(sample, alpha)
    if v == EQUIVALENT or (sample.tost and v == SUPPORTS):
        return sample.interval(2 * alpha), 1 - 2 * alpha
    return sample.interval(alpha), 1 - alpha


def combine(verdicts: list[str]) -> str:
    """A claim's verdict from its comparisons': the one verdict its decided comparisons
    (supports, contradicts, equivalent) share; ``mixed`` when they differ; ``underpowered``
    when none is decided; ``not run`` without any comparison."""
    if not verdicts:
        return NOT_RUN
    definite = {v for v in verdicts if v in DEFINITE}
    if len(definite) > 1:
        return MIXED
    return definite.pop() if definite else UNDERPOWERED


def mde(sd: float, n: int, alpha: float, power: float = POWER) -> float | None:
    """The minimum detectable effect (relative, as ``sd``): the distance of the true mean
    effect from the threshold that the verdict's one-sided decision (one side of the two-sided
    1 - ``alpha`` interval, i.e. level ``alpha`` / 2) detects with probability ``power``, over
    ``n`` seeds of standard deviation ``sd``: ``lambda * sd / sqrt(n)``, where the noncentral
    t of n - 1 degrees of freedom and noncentrality lambda exceeds t_{1 - alpha/2, n - 1} with
    probability ``power`` (docs/statistics.md). None for n < 2."""
    if n < 2:
        return None
    if sd == 0:
        return 0.0
    from scipy.optimize import brentq
    from scipy.stats import nct, t

    df = n - 1
    crit = float(t.ppf(1 - alpha / 2, df))
    guess = crit + float(t.ppf(power, df))  # the central-t approximation, a bracket's centre
    lam = brentq(lambda x: nct.sf(crit, df, x) - power, 0.0, 2 * guess + 10, xtol=1e-12)
    return lam * sd / math.sqrt(n)


def seeds_for(sd: float, target: float, alpha: float, power: float = POWER) -> int | None:
    """The fewest seeds (at least 2) whose ``mde`` at ``sd`` and ``alpha`` is at most ``target``
    (both relative): a binary search over n, the MDE falling as n grows. None when ``target``
    is not positive or more than ``MAX_SEEDS`` would be needed."""
    if target <= 0:
        return None
    if mde(sd, 2, alpha, power) <= target:
        return 2
    low, high = 2, 4  # mde(low) > target; grow high until mde(high) <= target
    while mde(sd, high, alpha, power) > target:
        if high >= MAX_SEEDS:
            return None
        low, high = high, min(2 * high, MAX_SEEDS)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if mde(sd, mid, alpha, power) > target else (low, mid)
    return high
