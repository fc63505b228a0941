"""The statistics of a claim's verdict (docs/statistics.md has the formulas): one pooled
regression per comparison (log test metric on arm and size, with an arm x log N trend),
Student-t intervals of its contrast, Holm's step-down correction across a claim's comparisons,
the two one-sided tests (TOST) of equivalence, the minimum detectable effect, and the verdicts.

A comparison is ``supports`` when its Holm-adjusted interval lies on the claimed side of its
threshold, ``contradicts`` when it lies on the other side, ``equivalent`` when its TOST interval
lies inside the claim's equivalence margin and that margin is at least the design's minimum
detectable effect, and ``underpowered`` otherwise (without residual degrees of freedom, always).
A comparison whose own test is TOST (``tost``) is ``supports`` when TOST rejects a difference
of the margin or more (the margin at least the MDE), ``contradicts`` when its interval lies
outside the margin. A claim is the one verdict its decided comparisons share; ``mixed`` when
they reach different ones; ``underpowered`` only when none is decided (``combine``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

SUPPORTS, CONTRADICTS, EQUIVALENT, MIXED, UNDERPOWERED, NOT_RUN = (
    "supports", "contradicts", "equivalent", "mixed", "underpowered", "not run")
DEFINITE = (SUPPORTS, CONTRADICTS, EQUIVALENT)
ALPHA = 0.05  # the family-wise error rate of a claim's comparisons
POWER = 0.80  # the power at which the minimum detectable effect is stated
MAX_SEEDS = 100_000  # ``seeds_for`` says None beyond this many seeds


class _Tested:
    """The tests of an estimate ``value`` with standard error ``se`` and ``df`` degrees of
    freedom (Student t) against ``threshold``, and of equivalence within ±``margin`` (TOST), in
    the estimate's units. ``tost``: the comparison's own test is TOST."""

    value: float
    se: float
    df: float
    threshold: float
    margin: float
    tost: bool

    def p_value(self) -> float:
        """The p-value of the comparison's own test: TOST's (``p_tost``) when ``tost``, else
        the test against ``threshold`` (``p_threshold``). Holm's family takes this one."""
        return self.p_tost() if self.tost else self.p_threshold()

    def p_threshold(self) -> float:
        """Two-sided p of H0: true value = ``threshold`` (Student t, ``df`` degrees of
        freedom); 1 without degrees of freedom, 0 or 1 when ``se`` is 0."""
        if self.df < 1:
            return 1.0
        if self.se == 0:
            return 0.0 if self.value != self.threshold else 1.0
        from scipy.stats import t

        return float(2 * t.sf(abs(self.value - self.threshold) / self.se, self.df))

    def p_tost(self) -> float:
        """TOST's p of H0: |true value| >= ``margin`` (Schuirmann 1987): the larger of the
        one-sided Student-t p-values of H0: value <= -margin and H0: value >= margin; 1 without
        degrees of freedom, 0 or 1 when ``se`` is 0."""
        if self.df < 1:
            return 1.0
        if self.se == 0:
            return 0.0 if abs(self.value) < self.margin else 1.0
        from scipy.stats import t

        lower = t.sf((self.value + self.margin) / self.se, self.df)
        upper = t.cdf((self.value - self.margin) / self.se, self.df)
        return float(max(lower, upper))

    def interval(self, alpha: float) -> tuple[float, float] | None:
        """The two-sided 1 - ``alpha`` Student-t interval ``value ± t_{1-alpha/2, df} se``;
        None without degrees of freedom."""
        if self.df < 1:
            return None
        if self.se == 0:
            return self.value, self.value
        from scipy.stats import t

        half = float(t.ppf(1 - alpha / 2, self.df)) * self.se
        return self.value - half, self.value + half

    def mde(self, alpha: float, power: float = POWER) -> float | None:
        """The minimum detectable effect of this estimate's design at level ``alpha``
        (``mde_se`` of its ``se`` and ``df``); None without degrees of freedom."""
        return mde_se(self.se, int(self.df), alpha, power) if self.df >= 1 else None


@dataclass(frozen=True)
class Sample(_Tested):
    """One comparison's per-seed effects (e.g. 0.02 for +2 %) against its ``threshold`` (0, or
    the not-worse margin), with its equivalence ``margin`` (±, in the effects' units): the mean,
    its standard error ``sd / sqrt(n)`` and ``n - 1`` degrees of freedom (the one-sample t).
    ``tost``: the comparison's own test is equivalence (TOST); ``p_value`` is then TOST's."""

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
    def value(self) -> float:
        """The mean effect."""
        return self.mean

    @property
    def df(self) -> int:
        """``n - 1``."""
        return self.n - 1

    @property
    def sd(self) -> float:
        """Sample standard deviation of the effects (0 with fewer than 2)."""
        return statistics.stdev(self.effects) if self.n > 1 else 0.0

    @property
    def se(self) -> float:
        """Standard error of the mean (0 with fewer than 2 effects)."""
        return self.sd / math.sqrt(self.n) if self.n > 1 else 0.0


@dataclass(frozen=True)
class Estimate(_Tested):
    """One comparison's estimate (a log ratio from ``pooled_fit``) with its standard error and
    residual degrees of freedom, against ``threshold`` and with equivalence ``margin`` (both
    log ratios: ``log(1 + m)`` of a relative margin m)."""

    value: float
    se: float
    df: int
    threshold: float
    margin: float
    tost: bool = False


def holm_levels(p_values: list[float], alpha: float = ALPHA) -> list[float]:
    """Each test's error rate under Holm's step-down procedure (Holm 1979) over the family
    ``p_values``: sorted ascending, the r-th (from 0) of m is tested at alpha / (m - r) while
    every earlier one was rejected; from the first that is not, every remaining one keeps that
    level. An interval at 1 - level is then compatible with the procedure's decisions."""
    m = len(p_values)
    levels = [alpha] * m
    stopped: float | None = None
    for rank, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        level = stopped if stopped is not None else alpha / (m - rank)
        if stopped is None and p_values[i] > level:
            stopped = level
        levels[i] = level
    return levels


def verdict(sample: _Tested, alpha: float) -> str:
    """The verdict of one comparison (a ``Sample`` or an ``Estimate``) at Holm level ``alpha``
    (``tost_verdict`` when its own test is TOST): supports (the 1 - alpha interval below the
    threshold: the treatment lower, or worse by less than the not-worse margin), contradicts
    (above it), equivalent (the 1 - 2 alpha interval inside ±margin, TOST, with the margin at
    least the minimum detectable effect at ``alpha``), else underpowered."""
    if sample.tost:
        return tost_verdict(sample, alpha)
    ci = sample.interval(alpha)
    if ci is None:
        return UNDERPOWERED
    if ci[1] < sample.threshold:
        return SUPPORTS
    if ci[0] > sample.threshold:
        return CONTRADICTS
    if _inside(sample.interval(2 * alpha), sample.margin) and _reachable(sample, alpha):
        return EQUIVALENT
    return UNDERPOWERED


def tost_verdict(sample: _Tested, alpha: float) -> str:
    """The verdict of a comparison whose claim is equality within ±``margin``: supports (the
    1 - 2 alpha interval inside it, TOST rejects at ``alpha``, and the margin at least the
    minimum detectable effect), contradicts (the 1 - alpha interval wholly outside it), else
    underpowered."""
    ci = sample.interval(alpha)
    if ci is None:
        return UNDERPOWERED
    if _inside(sample.interval(2 * alpha), sample.margin) and _reachable(sample, alpha):
        return SUPPORTS
    if ci[0] >= sample.margin or ci[1] <= -sample.margin:
        return CONTRADICTS
    return UNDERPOWERED


def _inside(interval: tuple[float, float], margin: float) -> bool:
    return -margin < interval[0] and interval[1] < margin


def _reachable(sample: _Tested, alpha: float) -> bool:
    """Whether the equivalence margin is at least the design's minimum detectable effect."""
    floor = sample.mde(alpha)
    return floor is not None and floor <= sample.margin


def verdict_interval(sample: _Tested, alpha: float) -> tuple[tuple[float, float] | None, float]:
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


@dataclass(frozen=True)
class Design:
    """How an estimate's standard error and degrees of freedom grow with n, the seeds in each
    (arm, size) cell of a balanced design: ``se(n) = sd * sqrt(variance / n)`` and
    ``df(n) = df_per_seed * n - df_fixed``. The mean of n per-seed effects is
    ``Design(1, 1, 1)``; two arms at one size, n seeds each, ``Design(2, 2, 2)`` (the
    pooled-variance two-sample t)."""

    variance: float = 1.0
    df_per_seed: int = 1
    df_fixed: int = 1

    def se(self, sd: float, n: int) -> float:
        """The standard error with ``n`` seeds per cell at residual standard deviation
        ``sd``."""
        return sd * math.sqrt(self.variance / n)

    def df(self, n: int) -> int:
        """The residual degrees of freedom with ``n`` seeds per cell."""
        return self.df_per_seed * n - self.df_fixed

    @property
    def fewest(self) -> int:
        """The fewest seeds per cell that leave a residual degree of freedom."""
        return max(1, -(-(self.df_fixed + 1) // self.df_per_seed))


ONE_SAMPLE = Design()


def mde_se(se: float, df: int, alpha: float, power: float = POWER) -> float:
    """The minimum detectable effect of an estimate with standard error ``se`` and ``df``
    degrees of freedom (its units: a log ratio for ``Estimate``): the distance of the true value
    from the threshold that the verdict's one-sided decision (one side of the two-sided
    1 - ``alpha`` interval, i.e. level ``alpha`` / 2) detects with probability ``power``:
    ``lambda * se``, where the noncentral t of ``df`` degrees of freedom and noncentrality
    lambda exceeds t_{1 - alpha/2, df} with probability ``power`` (Chow, Shao and Wang 2008,
    Sec. 3.1; docs/statistics.md). Lambda is solved by Brent's method.

    Raises:
        ValueError: ``df`` < 1.
    """
    if df < 1:
        raise ValueError(f"no degrees of freedom ({df}): no minimum detectable effect")
    if se == 0:
        return 0.0
    from scipy.optimize import brentq
    from scipy.stats import nct, t

    crit = float(t.ppf(1 - alpha / 2, df))
    guess = crit + float(t.ppf(power, df))  # the central-t approximation, a bracket's centre
    lam = brentq(lambda x: nct.sf(crit, df, x) - power, 0.0, 2 * guess + 10, xtol=1e-12)
    return lam * se


def mde(sd: float, n: int, alpha: float, power: float = POWER,
        design: Design = ONE_SAMPLE) -> float | None:
    """The minimum detectable effect (``mde_se``) of ``design`` with ``n`` seeds per cell at
    residual standard deviation ``sd`` (units as ``sd``): ``lambda * sd * sqrt(variance / n)``
    at ``df(n)`` degrees of freedom. The default design is the mean of ``n`` per-seed effects
    (``lambda * sd / sqrt(n)``, n - 1 degrees of freedom). None without degrees of freedom."""
    if n < 1 or design.df(n) < 1:
        return None
    return mde_se(design.se(sd, n), design.df(n), alpha, power)


def seeds_for(sd: float, target: float, alpha: float, power: float = POWER,
              design: Design = ONE_SAMPLE) -> int | None:
    """The fewest seeds per cell (at least ``design.fewest``; 2 for the default design) whose
    ``mde`` at ``sd``, ``alpha`` and ``design`` is at most ``target`` (units as ``sd``): a
    binary search over n, the MDE falling as n grows. None when ``target`` is not positive or
    more than ``MAX_SEEDS`` would be needed."""
    if target <= 0:
        return None
    first = design.fewest
    if mde(sd, first, alpha, power, design) <= target:
        return first
    low, high = first, 2 * first  # mde(low) > target; grow high until mde(high) <= target
    while mde(sd, high, alpha, power, design) > target:
        if high >= MAX_SEEDS:
            return None
        low, high = high, min(2 * high, MAX_SEEDS)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if mde(sd, mid, alpha, power, design) > target else (low, mid)
    return high


@dataclass(frozen=True)
class Observation:
    """One trained model's test metric in a comparison: its ``arm``, its ``block`` (a
    dataset and size, e.g. ``debian_english/nano``), its ``seed`` and ``y``, the natural log of
    its test metric (perplexity, RMSE)."""

    arm: str
    block: str
    seed: int
    y: float


@dataclass(frozen=True)
class BlockEffect:
    """A comparison's contrast at one block from its cells' means (``sum_a w_a mean_a``), its
    standard error from the pooled residual standard deviation
    (``sd * sqrt(sum_a w_a^2 / n_a)``) and each arm's seeds and their standard deviation of y:
    detail, not a verdict."""

    block: str
    value: float
    se: float
    counts: tuple[int, ...]  # per arm, in the order of the weights: its seeds
    sds: tuple[float, ...]  # per arm: the seeds' sample standard deviation of y (0 for one)


@dataclass(frozen=True)
class PooledFit:
    """The least-squares fit of ``pooled_fit``: the contrast ``estimate`` (a log ratio at the
    centre of log N) with its standard error ``se``, its trend ``slope`` per unit of log N
    (None with one N) with ``slope_se``, the residual standard deviation ``sd`` and degrees of
    freedom ``df``, the observations ``n``, the blocks used, the ``design`` (``Design``) that
    gives the standard error at other seed counts, and each block's contrast (``blocks``)."""

    estimate: float
    se: float
    slope: float | None
    slope_se: float | None
    sd: float
    df: int
    n: int
    design: Design
    paired: bool
    blocks: tuple[BlockEffect, ...]
    left_out: tuple[str, ...]  # blocks without every arm


def pooled_fit(observations: Sequence[Observation], weights: Mapping[str, float],
               log_n: Mapping[str, float], paired: bool = False) -> PooledFit | None:
    """One ordinary-least-squares regression per comparison (numpy ``lstsq``):

        y = mu_block + sum_{a != ref} (alpha_a + gamma_a x_block) [arm = a] + error,

    ``x_block`` the block's ``log_n`` (natural log of a parameter count) less its mean over
    the blocks used (so the contrast is estimated at their geometric-mean N); the trend terms
    only where the blocks have two or more N. ``weights`` gives each arm's contrast weight
    (they sum to 0: +1 treatment, -1 control; with base arms +1, -1, -1, +1), its second key the
    reference arm; the contrast is ``sum_a w_a alpha_a`` and its trend ``sum_a w_a gamma_a``.
    With ``paired`` (every arm the same trained models, e.g. one model at several test-time
    settings), mu is per (block, seed) and only seeds every arm has count. Standard errors:
    ``sd * sqrt(c' (X'X)^-1 c)``, ``sd^2`` the residual sum of squares over ``df = n - rank``
    (Searle, *Linear Models*, 1971, Ch. 3). A block without every arm is left out. None when
    no block has every arm or no residual degree of freedom is left.

    Raises:
        ValueError: ``weights`` has fewer than two arms or does not sum to 0, or an
            observation's arm is not among them or its block has no ``log_n``.
    """
    arms = list(weights)
    if len(arms) < 2 or abs(sum(weights.values())) > 1e-9:
        raise ValueError(f"contrast weights must name two arms or more and sum to 0: {weights}")
    cells: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for o in observations:
        if o.arm not in weights:
            raise ValueError(f"observation of arm {o.arm!r}, not among {arms}")
        if o.block not in log_n:
            raise ValueError(f"block {o.block!r} has no log N")
        cells[(o.arm, o.block)][o.seed] = o.y
    blocks = sorted({b for _, b in cells})
    used = [b for b in blocks if all(cells.get((a, b)) for a in arms)]
    units: dict[str, list[int]] = {}
    for b in used:
        seeds = [set(cells[(a, b)]) for a in arms]
        units[b] = sorted(set.intersection(*seeds)) if paired else sorted(set.union(*seeds))
    used = [b for b in used if units[b]]
    if not used:
        return None
    centre = statistics.fmean(log_n[b] for b in used)
    x = {b: log_n[b] - centre for b in used}
    slope = len({round(v, 12) for v in x.values()}) > 1
    others = arms[:1] + arms[2:]  # every arm but the reference (the second)

    def columns(b: str, seed_or_unit: str | int, arm: str) -> list[float]:
        row = [0.0] * n_intercepts
        row[intercept[(b, seed_or_unit) if paired else b]] = 1.0
        for a in others:
            on = 1.0 if a == arm else 0.0
            row.append(on)
            if slope:
                row.append(on * x[b])
        return row

    intercept = ({(b, s): i for i, (b, s) in enumerate((b, s) for b in used for s in units[b])}
                 if paired else {b: i for i, b in enumerate(used)})
    n_intercepts = len(intercept)
    rows, ys = [], []
    for b in used:
        for a in arms:
            for seed, y in sorted(cells[(a, b)].items()):
                if paired and seed not in units[b]:
                    continue
                rows.append(columns(b, seed, a))
                ys.append(y)
    X, Y = np.asarray(rows), np.asarray(ys)
    coef, _, rank, _ = np.linalg.lstsq(X, Y, rcond=None)
    df = len(Y) - int(rank)
    if df < 1:
        return None
    resid = Y - X @ coef
    sd = math.sqrt(float(resid @ resid) / df)
    inverse = np.linalg.pinv(X.T @ X)
    per_arm = 2 if slope else 1
    contrast, trend = np.zeros(X.shape[1]), np.zeros(X.shape[1])
    for i, a in enumerate(others):
        contrast[n_intercepts + per_arm * i] = weights[a]
        if slope:
            trend[n_intercepts + per_arm * i + 1] = weights[a]
    # the same design, balanced, with one seed per cell: the variance factor of se(n)
    one = np.asarray([columns(b, units[b][0], a) if paired else columns(b, 0, a)
                      for b in used for a in arms])
    if paired:  # one unit per block: its intercept column is the block's first unit's
        keep = [intercept[(b, units[b][0])] for b in used] + list(range(n_intercepts,
                                                                        X.shape[1]))
        one, c1 = one[:, keep], contrast[keep]
    else:
        c1 = contrast
    variance = float(c1 @ np.linalg.pinv(one.T @ one) @ c1)
    k = len(others) * per_arm
    design = (Design(variance, len(arms) * len(used) - len(used), k) if paired
              else Design(variance, len(arms) * len(used), len(used) + k))
    details = []
    for b in used:
        if paired:
            by_arm = [[cells[(a, b)][s] for s in units[b]] for a in arms]
        else:
            by_arm = [list(cells[(a, b)].values()) for a in arms]
        value = sum(weights[a] * statistics.fmean(ys_) for a, ys_ in zip(arms, by_arm))
        se = sd * math.sqrt(sum(weights[a] ** 2 / len(ys_) for a, ys_ in zip(arms, by_arm)))
        details.append(BlockEffect(b, value, se, tuple(len(v) for v in by_arm),
                                   tuple(statistics.stdev(v) if len(v) > 1 else 0.0
                                         for v in by_arm)))
    return PooledFit(
        float(contrast @ coef), sd * math.sqrt(max(float(contrast @ inverse @ contrast), 0.0)),
        float(trend @ coef) if slope else None,
        sd * math.sqrt(max(float(trend @ inverse @ trend), 0.0)) if slope else None,
        sd, df, len(Y), design, paired, tuple(details),
        tuple(b for b in blocks if b not in used))
