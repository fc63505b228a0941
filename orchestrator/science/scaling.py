"""Scaling laws across model sizes for the Compare page: one power law L(N) = E + A·N^(−α) per
family (``scipy.optimize.curve_fit``), a bootstrap band over seeds, and the headline read from
two fits: how many fewer parameters the treatment needs to reach the baseline's metric.

N is whatever parameter count the caller measures (non-embedding parameters, say), L the metric
(loss or perplexity); E and the band are in L's units, A in L's units times N^α."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

MIN_SIZES = 3  # distinct N needed for a 3-parameter fit

_E_MIN = 0.0  # E is bounded to [_E_MIN, inf) (the metric's units)
_ALPHA_MIN, _ALPHA_MAX = 0.0, 3.0  # alpha is bounded to (_ALPHA_MIN, _ALPHA_MAX)
AT_BOUND_TOL = 1e-6  # within this of a bound (relative to the metric for E) is at the bound
_ALPHA_GUESSES = np.linspace(0.02, 2.98, 149)  # the grid the initial guess is chosen on
_GRID_POINTS = 100  # default band grid: log-spaced points over [min N, max N]


@dataclass(frozen=True)
class PowerLaw:
    """L(N) = E + A·N^(−alpha): ``E`` the irreducible metric (L's units), ``A`` in L's units
    times N^alpha, ``alpha`` > 0 dimensionless."""

    E: float
    A: float
    alpha: float

    def __call__(self, n: np.ndarray | float) -> np.ndarray | float:
        """The metric at ``n`` parameters (an array gives an array)."""
        if np.ndim(n) == 0:
            return float(self.E + self.A * float(n) ** -self.alpha)
        return self.E + self.A * np.asarray(n, dtype=float) ** -self.alpha

    def inverse(self, loss: float) -> float:
        """The N at which the law reaches ``loss``: ``math.inf`` when ``loss <= E`` (the law
        never gets there) or when ``A <= 0`` and ``loss`` is not E (a flat law)."""
        gap = loss - self.E
        if gap <= 0 or self.A <= 0:
            return math.inf
        return float((self.A / gap) ** (1.0 / self.alpha))


def _points(n: Sequence[float], loss: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(n, loss)`` as float arrays.

    Raises:
        ValueError: mismatched lengths, or a non-finite or non-positive value.
    """
    x, y = np.asarray(n, dtype=float).ravel(), np.asarray(loss, dtype=float).ravel()
    if len(x) != len(y):
        raise ValueError(f"need one metric value per size: {len(x)} sizes, {len(y)} values")
    for name, v in (("sizes", x), ("metric values", y)):
        if not np.all(np.isfinite(v) & (v > 0)):
            raise ValueError(f"{name} must be finite and positive: {v.tolist()}")
    return x, y


def _initial_guess(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """``(E, log A, alpha)`` for y = E + A·x^(−alpha): for each alpha on ``_ALPHA_GUESSES`` the
    linear least squares in (E, A) (E clipped at 0, A at a small positive value), the alpha with
    the smallest residual."""
    z = x[None, :] ** -_ALPHA_GUESSES[:, None]  # (alphas, points)
    zc = z - z.mean(axis=1, keepdims=True)
    yc = y - y.mean()
    a = np.maximum((zc * yc).sum(axis=1) / np.maximum((zc * zc).sum(axis=1), 1e-300), 1e-12)
    e = np.maximum(y.mean() - a * z.mean(axis=1), 0.0)
    best = int(np.argmin(((e[:, None] + a[:, None] * z - y) ** 2).sum(axis=1)))
    return float(e[best]), float(math.log(a[best])), float(_ALPHA_GUESSES[best])


def _fit(x: np.ndarray, y: np.ndarray, p0: PowerLaw | None = None) -> PowerLaw:
    """The fit of ``fit_power_law`` on checked arrays, from ``p0`` if given (else the grid
    guess of ``_initial_guess``).

    Raises:
        ValueError: fewer than ``MIN_SIZES`` distinct sizes, or a fit that does not converge.
    """
    sizes = len(np.unique(x))
    if sizes < MIN_SIZES:
        raise ValueError(f"{sizes} distinct sizes; a power law needs {MIN_SIZES}")
    # Well conditioned: x = N / N_ref around 1, y in units of its mean, A as log A.
    n_ref = float(np.exp(np.log(x).mean()))
    y_ref = float(y.mean())
    xs, ys = x / n_ref, y / y_ref
    if p0 is None:
        guess = _initial_guess(xs, ys)
    else:
        guess = (min(max(p0.E / y_ref, _E_MIN / y_ref), ys.min()),
                 math.log(max(p0.A, 1e-300) * n_ref ** -p0.alpha / y_ref),
                 min(max(p0.alpha, _ALPHA_MIN + 1e-3), _ALPHA_MAX - 1e-3))

    def law(v, e, log_a, alpha):
        return e + np.exp(log_a - alpha * np.log(v))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)  # no covariance needed
            (e, log_a, alpha), _ = curve_fit(
                law, xs, ys, p0=guess, bounds=([_E_MIN / y_ref, -np.inf, _ALPHA_MIN],
                                               [np.inf, np.inf, _ALPHA_MAX]),
                method="trf", ftol=1e-12, xtol=1e-12, gtol=1e-12, max_nfev=2000)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"power-law fit did not converge: {str(err).splitlines()[0]}") from None
    a = math.exp(log_a) * y_ref * n_ref**alpha
    if not all(math.isfinite(v) for v in (e, a, alpha)):
        raise ValueError(f"power-law fit did not converge: E={e}, A={a}, alpha={alpha}")
    return PowerLaw(float(e * y_ref), float(a), float(alpha))


def fit_power_law(n: Sequence[float], loss: Sequence[float]) -> PowerLaw:
    """Least-squares fit of L(N) = E + A·N^(−alpha) to ``(n, loss)`` pairs (several points per
    N allowed, e.g. seeds), with E ≥ 0 and alpha in (0, 3).

    The fit (``scipy.optimize.curve_fit``, trust-region reflective) works on N / N_ref with
    N_ref the geometric mean of ``n``, the metric over its mean, and log A; it starts from the
    best linear fit in (E, A) over a grid of alphas. A comes back in ``n``'s own units.

    Raises:
        ValueError: mismatched lengths, a non-finite or non-positive value, fewer than
            ``MIN_SIZES`` distinct sizes, or a fit that does not converge.
    """
    return _fit(*_points(n, loss))


def at_bounds(law: PowerLaw, scale: float) -> dict[str, str]:
    """The parameters of ``law`` that sit at a bound of the fit (``fit_power_law``: E ≥ 0,
    0 < alpha < 3; A is free): ``{"E": "lower"}``, ``{"alpha": "upper"}``, or ``{}``. A bound
    is reached within ``AT_BOUND_TOL``, relative to ``scale`` for E (the metric's size where
    it was fitted, e.g. the law at the largest N: the fitter stops a hair inside a bound, at
    E = 1e-19 say) and absolute for alpha. A parameter at its bound is not determined by the
    points: the least squares would go past it.

    Raises:
        ValueError: ``scale`` not finite and positive.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and positive: {scale}")
    hit = {}
    if law.E - _E_MIN <= AT_BOUND_TOL * scale:
        hit["E"] = "lower"
    if law.alpha - _ALPHA_MIN <= AT_BOUND_TOL:
        hit["alpha"] = "lower"
    elif _ALPHA_MAX - law.alpha <= AT_BOUND_TOL:
        hit["alpha"] = "upper"
    return hit


def fit_parameters(law: PowerLaw, scale: float, digits: int = 4) -> dict[str, str]:
    """``law``'s E, A and alpha as text for a table, each with ``digits`` significant digits
    (``f"{x:.4g}"``: 0.3412, 1.235e+05, 1e-19), and one at a bound (``at_bounds``, ``scale``
    as there) says so: ``{"E": "1e-19 (at its lower bound, 0)", "A": "812.3",
    "alpha": "0.3412"}``.

    Raises:
        ValueError: ``scale`` not finite and positive, or ``digits`` < 1.
    """
    if digits < 1:
        raise ValueError(f"digits must be at least 1: {digits}")
    bound_values = {("E", "lower"): _E_MIN, ("alpha", "lower"): _ALPHA_MIN,
                    ("alpha", "upper"): _ALPHA_MAX}
    hit = at_bounds(law, scale)
    out = {}
    for name, value in (("E", law.E), ("A", law.A), ("alpha", law.alpha)):
        text = f"{value:.{digits}g}"
        if name in hit:
            text += f" (at its {hit[name]} bound, {bound_values[name, hit[name]]:g})"
        out[name] = text
    return out


@dataclass(frozen=True)
class Band:
    """A fitted curve and its band on a grid of sizes ``n``: ``mid`` the fit on all points,
    ``low`` and ``high`` the band's percentiles of the bootstrap curves (metric units)."""

    n: np.ndarray
    mid: np.ndarray
    low: np.ndarray
    high: np.ndarray


def bootstrap_band(n: Sequence[float], loss: Sequence[float],
                   groups: Sequence[Hashable] | None = None, *, samples: int = 200,
                   level: float = 0.95, seed: int = 0,
                   grid: np.ndarray | None = None) -> tuple[PowerLaw, Band, list[PowerLaw]]:
    """The fit on all points, a ``level`` band around it, and the bootstrap fits.

    Each of ``samples`` resamples draws points with replacement within each distinct N (and
    within each label of ``groups``, one per point, when given), so every resample keeps every
    size and as many points per size; it is refitted from the full fit, and resamples whose fit
    fails are skipped. The band is the (1 ∓ level)/2 percentiles of the refitted curves on
    ``grid`` (default: ``_GRID_POINTS`` log-spaced sizes over [min N, max N]). With one point
    per size every resample is the data itself and the band has no width: the band measures
    the spread over seeds, nothing else.

    Raises:
        ValueError: as ``fit_power_law``; ``groups`` not one per point; ``samples`` < 1 or
            ``level`` outside (0, 1); or no resample could be fitted.
    """
    x, y = _points(n, loss)
    if groups is not None and len(groups) != len(x):
        raise ValueError(f"need one group per point: {len(x)} points, {len(groups)} groups")
    if samples < 1 or not 0 < level < 1:
        raise ValueError(f"need samples >= 1 and level in (0, 1): {samples}, {level}")
    fit = _fit(x, y)
    strata: dict[tuple, list[int]] = defaultdict(list)
    for i, xi in enumerate(x):
        strata[(xi, None if groups is None else groups[i])].append(i)
    members = [np.asarray(idx) for idx in strata.values()]
    rng = np.random.default_rng(seed)
    fits: list[PowerLaw] = []
    for _ in range(samples):
        pick = np.concatenate([rng.choice(idx, size=len(idx), replace=True) for idx in members])
        try:
            fits.append(_fit(x[pick], y[pick], p0=fit))
        except ValueError:
            continue
    if not fits:
        raise ValueError(f"none of {samples} bootstrap resamples could be fitted")
    g = (np.geomspace(x.min(), x.max(), _GRID_POINTS) if grid is None
         else np.asarray(grid, dtype=float))
    curves = np.stack([f(g) for f in fits])
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(curves, [tail, 100 - tail], axis=0)
    return fit, Band(g, np.asarray(fit(g)), low, high), fits


@dataclass(frozen=True)
class Headline:
    """The Compare page's sentence and the numbers behind it: ``fewer`` the fraction of
    parameters saved (0.23 = 23% fewer; negative = more), its ``ci``, both read at ``at_n``
    (baseline parameters). ``fewer`` is None when the sizes do not allow a fit or the
    treatment's law never reaches the baseline's metric there."""

    text: str
    fewer: float | None
    ci: tuple[float, float] | None
    at_n: float | None


def parameter_saving(baseline: PowerLaw, treatment: PowerLaw, at_n: float) -> float:
    """1 − N_t / ``at_n``, N_t the treatment's parameters reaching the baseline's metric at
    ``at_n`` parameters: 0.25 = 25% fewer, −0.1 = 10% more; ``math.nan`` when the treatment's
    law never reaches it (its E at or above the baseline's metric there)."""
    n_t = treatment.inverse(baseline(at_n))
    return math.nan if math.isinf(n_t) else 1.0 - n_t / at_n


def _size(n: float) -> str:
    """``n`` parameters (or FLOPs), short: 134M, 1.3B, 12k; 3.1e+18 past the trillions."""
    if n >= 1e15:
        return f"{n:.2g}"
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _saving(s: float) -> str:
    """A saving as words: '23% fewer', '12% more', 'unreachable' (−inf)."""
    if s == -math.inf:
        return "never (no size reaches it)"
    return f"{abs(s) * 100:.0f}% {'fewer' if s >= 0 else 'more'}"


@dataclass(frozen=True)
class Family:
    """One family's points fitted: ``sizes`` distinct N up to ``max_n``; with at least
    ``MIN_SIZES`` sizes, its ``fit``, ``band`` and bootstrap ``fits`` (``bootstrap_band``),
    else None and none."""

    sizes: int
    max_n: float
    fit: PowerLaw | None = None
    band: Band | None = None
    fits: tuple[PowerLaw, ...] = ()


def fit_family(n: Sequence[float], loss: Sequence[float], *, samples: int = 200,
               level: float = 0.95, seed: int = 0) -> Family:
    """``bootstrap_band`` of a family's points, or only its size count when it has fewer than
    ``MIN_SIZES`` distinct sizes (no fit: that is the truth, not an error). Give each family
    its own ``seed``: families resampled alike would have correlated bootstrap fits.

    Raises:
        ValueError: as ``bootstrap_band``, once there are enough sizes.
    """
    x, y = _points(n, loss)
    sizes = len(np.unique(x))
    if sizes < MIN_SIZES:
        return Family(sizes, float(x.max()))
    fit, band, fits = bootstrap_band(x, y, samples=samples, level=level, seed=seed)
    return Family(sizes, float(x.max()), fit, band, tuple(fits))


def headline(baseline_name: str, baseline: Family, treatment_name: str, treatment: Family, *,
             what: str = "non-embedding parameters", metric: str = "perplexity",
             level: float = 0.95) -> Headline:
    """How many fewer ``what`` the treatment needs to reach the baseline's ``metric``, read at
    the largest baseline size measured, with a ``level`` interval.

    The saving is ``parameter_saving`` of the two full fits, its interval the percentiles of
    the savings of the i-th bootstrap fits of both families paired (a resample whose treatment
    never reaches the baseline counts as the lowest saving of all). E.g. "CEM reaches Llama's
    perplexity with 23% fewer non-embedding parameters (95% CI 15–31%) at 134M"; with one run
    per size there is no spread to resample, and the text says "no interval". With fewer
    than ``MIN_SIZES`` distinct sizes in either family, ``fewer`` is None and the text says so.
    """
    k_t, k_b = treatment.sizes, baseline.sizes
    if treatment.fit is None or baseline.fit is None:
        return Headline(f"not enough sizes to fit: {treatment_name} has {k_t} "
                        f"size{'s' * (k_t != 1)}, {baseline_name} has {k_b}; a power law needs "
                        f"{MIN_SIZES}", None, None, None)
    fit_b, fit_t, at_n = baseline.fit, treatment.fit, baseline.max_n
    where = f"at {_size(at_n)}"
    fewer = parameter_saving(fit_b, fit_t, at_n)
    if math.isnan(fewer):
        return Headline(f"{treatment_name}'s fitted law never reaches {baseline_name}'s "
                        f"{metric} {where} (its floor E = {fit_t.E:.4g} is at or above "
                        f"{fit_b(at_n):.4g})", None, None, at_n)
    paired = np.array([parameter_saving(b, t, at_n)
                       for b, t in zip(baseline.fits, treatment.fits)])
    paired = np.where(np.isnan(paired), -np.inf, paired)
    tail = (1 - level) / 2
    # No interpolation: an unreachable resample (-inf) must not turn a percentile into NaN.
    lo, hi = (float(v) for v in np.quantile(paired, [tail, 1 - tail], method="inverted_cdf"))
    pct = f"{level * 100:.0f}% CI"
    if lo == hi:  # every resample is the data: one run per size, no spread to resample
        ci_text = "no interval: one run per size"
    elif lo >= 0 or hi < 0 and lo > -math.inf:  # one side of zero: 15–31% (fewer or more)
        a, b = sorted((abs(lo) * 100, abs(hi) * 100))
        ci_text = f"{pct} {a:.0f}–{b:.0f}%" + ("" if (lo >= 0) == (fewer >= 0) else
                                               f" {'fewer' if lo >= 0 else 'more'}")
    else:
        ci_text = f"{pct} {_saving(lo)} to {_saving(hi)}"
    return Headline(f"{treatment_name} reaches {baseline_name}'s {metric} with {_saving(fewer)} "
                    f"{what} ({ci_text}) {where}", fewer, (lo, hi), at_n)
