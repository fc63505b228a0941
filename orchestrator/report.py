"""The claims report: each claim of ``orchestrator.claims`` measured on the ledger's finished
trials, with seeds, mean ± std, a 95 % confidence interval paired by seed, and a verdict;
written as ``REPORT.md`` plus one PNG figure per claim.

Protocol: per (variant, size, seed) the learning rate is chosen on validation (the Akima optimum
over log2 LR, ``analysis.seed_choices``) and the test metric is read there; a comparison pairs
its arms by seed (only seeds every arm finished) and takes the Student-t interval of the
per-seed effects (``scipy.stats.ttest_1samp``). Verdicts:

- ``better``: supports when the whole interval is below 0, contradicts when it is above 0;
- ``not_worse`` (margin m): supports when the interval lies below m, contradicts above m;
- otherwise (or with fewer than 2 seeds) inconclusive at this scale.

A claim supports when all its comparisons (at every size and dataset) do, contradicts when any
does, and is inconclusive otherwise.
"""

from __future__ import annotations

import datetime as dt
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from orchestrator.analysis import Point, seed_choices
from orchestrator.claims import CLAIMS, Claim, Comparison
from orchestrator.ledger import Ledger, Status
from orchestrator.results import experiment_rows, finished_points, short_metric
from orchestrator.spec import ExperimentSpec
from orchestrator.table import format_table
from workloads.atomic import atomic_path
from workloads.base import Trial
from workloads.provenance import code_fingerprint, git_commit

LEVEL = 0.95
SUPPORTS, CONTRADICTS, INCONCLUSIVE, NOT_RUN = ("supports", "contradicts", "inconclusive",
                                                "not run")


@dataclass(frozen=True)
class Effect:
    """One comparison at one (dataset, size): per-seed effects and their summary."""

    comparison: Comparison
    dataset: str
    size: str
    seeds: tuple[int, ...]
    per_seed: tuple[float, ...]
    ci: tuple[float, float] | None  # None with fewer than 2 seeds
    verdict: str

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_seed)

    @property
    def std(self) -> float:
        return statistics.stdev(self.per_seed) if len(self.per_seed) > 1 else 0.0


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    spec: ExperimentSpec
    metric: str  # perplexity, rmse
    effects: tuple[Effect, ...]
    arms: list[dict]  # per (dataset, size, variant): test and chosen LR, mean ± std over seeds
    incomplete: tuple[str, ...] = ()  # arms and seeds left out: their LR grid is unfinished

    @property
    def verdict(self) -> str:
        return combine([e.verdict for e in self.effects])


def confidence_interval(xs: list[float], level: float = LEVEL) -> tuple[float, float] | None:
    """The Student-t interval of the mean of ``xs`` (None for fewer than 2 values; the point
    itself when they are all equal)."""
    if len(xs) < 2:
        return None
    if statistics.pstdev(xs) == 0:
        return xs[0], xs[0]
    from scipy.stats import ttest_1samp

    ci = ttest_1samp(xs, 0.0).confidence_interval(level)
    return float(ci.low), float(ci.high)


def verdict(comparison: Comparison, ci: tuple[float, float] | None) -> str:
    """The verdict of one interval of effects (module docstring)."""
    if ci is None:
        return INCONCLUSIVE
    threshold = comparison.margin if comparison.kind == "not_worse" else 0.0
    if ci[1] < threshold:
        return SUPPORTS
    if ci[0] > threshold:
        return CONTRADICTS
    return INCONCLUSIVE


def combine(verdicts: list[str]) -> str:
    """A claim's verdict from its comparisons' (module docstring); ``not run`` without any."""
    if not verdicts:
        return NOT_RUN
    if CONTRADICTS in verdicts:
        return CONTRADICTS
    return SUPPORTS if all(v == SUPPORTS for v in verdicts) else INCONCLUSIVE


def paired_effects(comparison: Comparison, tests: dict[str, dict[int, float]]
                   ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Seeds that every arm of ``comparison`` has in ``tests`` (variant -> seed -> test
    metric), and the effect at each (``orchestrator.claims``)."""
    arms = comparison.arms
    if not all(a in tests for a in arms):
        return (), ()
    seeds = tuple(sorted(set.intersection(*(set(tests[a]) for a in arms))))

    def effect(seed: int) -> float:
        t, c = tests[comparison.treatment][seed], tests[comparison.control][seed]
        if comparison.treatment_base is None:
            return t / c - 1
        return (t / tests[comparison.treatment_base][seed]
                - c / tests[comparison.control_base][seed])

    return seeds, tuple(effect(s) for s in seeds)


def complete_grids(spec: ExperimentSpec, points: list[Point],
                   ) -> tuple[list[Point], tuple[str, ...]]:
    """The points of the (dataset, variant, size, seed) groups that have every learning rate
    of ``spec`` finished, and one line per group left out: an LR chosen on part of the grid
    is not the one the full grid would choose, so a comparison never uses it."""
    groups: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        groups[(p.dataset, p.variant, p.size, p.seed)].append(p)
    grid = set(spec.learning_rates)
    complete = {key: {p.lr for p in ps} >= grid for key, ps in groups.items()}
    kept = [p for key, ps in groups.items() if complete[key] for p in ps]
    left_out = tuple(f"{v}@{s} ({d}) seed {seed}: {len(ps)} of {len(grid)} learning rates "
                     "finished, left out" for (d, v, s, seed), ps in sorted(groups.items())
                     if not complete[(d, v, s, seed)])
    return kept, left_out


def evaluate(claim: Claim, spec: ExperimentSpec, ledger: Ledger) -> ClaimResult:
    """``claim`` measured on the finished trials of ``spec`` in ``ledger``, using only the
    seeds whose learning-rate grid is complete (``complete_grids``)."""
    points, incomplete = complete_grids(spec, finished_points(experiment_rows(spec, ledger)))
    choices = seed_choices(points)
    effects, arms = [], []
    for dataset, size in sorted({(d, s) for d, _, s in choices}):
        tests = {v: {seed: c.test for seed, c in by_seed.items()}
                 for (d, v, s), by_seed in choices.items() if (d, s) == (dataset, size)}
        for variant, by_seed in sorted(tests.items()):
            chosen = choices[(dataset, variant, size)]
            arms.append({"dataset": dataset, "size": size, "variant": variant,
                         "seeds": len(by_seed), "test": _pm(list(by_seed.values()), "{:.3f}"),
                         "LR (val)": _pm([c.lr for c in chosen.values()], "{:.2e}")})
        for comparison in claim.comparisons:
            seeds, per_seed = paired_effects(comparison, tests)
            if seeds:
                ci = confidence_interval(list(per_seed))
                effects.append(Effect(comparison, dataset, size, seeds, per_seed, ci,
                                      verdict(comparison, ci)))
    return ClaimResult(claim, spec, short_metric(spec), tuple(effects), arms, incomplete)


def claim_spec_path(directory: Path, claim: Claim, scale: str = "cpu") -> Path:
    """``<directory>/<figure>-cpu.yaml`` (``scale`` cpu) or ``<figure>.yaml`` (paper)."""
    return directory / f"{claim.figure}{'-cpu' if scale == 'cpu' else ''}.yaml"


def missing_trials(spec: ExperimentSpec, ledger: Ledger) -> list[Trial]:
    """Planned trials of ``spec`` whose grid point has no finished row in ``ledger``."""
    from orchestrator.plan import plan

    done = {(r.dataset, r.variant, r.size, r.lr, r.seed)
            for r in experiment_rows(spec, ledger) if r.status == Status.FINISHED}
    return [t for t in plan(spec) if (t.dataset, t.variant, t.size, t.lr, t.seed) not in done]


def _pm(xs: list[float], fmt: str) -> str:
    std = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(xs))} ± {fmt.format(std)}"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _effect_row(result: ClaimResult, e: Effect) -> dict:
    return {"claim": f"({result.claim.key})", "comparison": e.comparison.describe(),
            "data": e.dataset, "size": e.size, "seeds": len(e.seeds),
            "effect": f"{_pct(e.mean)} ± {100 * e.std:.1f}%",
            f"{LEVEL:.0%} CI": (f"[{_pct(e.ci[0])}, {_pct(e.ci[1])}]" if e.ci else "-"),
            "verdict": e.verdict}


def figure(result: ClaimResult, path: Path) -> None:
    """Per-seed effects (dots), their mean and 95 % interval (bar) for every comparison of the
    claim, against 0 and the claim's margin; written as a PNG (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    effects = result.effects
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * max(len(effects), 1)))
    for y, e in enumerate(effects):
        ax.scatter([100 * x for x in e.per_seed], [y] * len(e.per_seed), color="0.5", s=14,
                   zorder=3)
        low, high = e.ci if e.ci else (e.mean, e.mean)
        color = {SUPPORTS: "tab:green", CONTRADICTS: "tab:red"}.get(e.verdict, "tab:gray")
        ax.errorbar(100 * e.mean, y, xerr=[[100 * (e.mean - low)], [100 * (high - e.mean)]],
                    fmt="o", color=color, capsize=4, zorder=4)
        if e.comparison.kind == "not_worse":
            ax.plot([100 * e.comparison.margin] * 2, [y - 0.4, y + 0.4], color="tab:orange",
                    linestyle="--")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(effects)),
                  [f"{e.comparison.describe()}\n{e.dataset}, {e.size}" for e in effects],
                  fontsize=7)
    ax.set_xlabel(f"effect on test {result.metric} (%, negative: treatment better); "
                  f"bars: {LEVEL:.0%} CI paired by seed")
    ax.set_title(f"({result.claim.key}) {result.claim.title}: {result.verdict}", fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def markdown(results: list[ClaimResult], scale: str, directory: str) -> str:
    """REPORT.md: provenance, the verdict table, then one section per claim."""
    commit = git_commit() or "unknown"
    lines = [
        f"# The paper's claims at {scale.upper()} scale",
        "",
        f"Written by `python -m orchestrator report {directory}` on "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, commit `{commit}`, model code "
        f"`{code_fingerprint()}`.",
        "",
        "Protocol: for every variant, size and seed the learning rate is chosen on validation "
        "(Akima optimum over log2 LR) and the test metric is read there; each comparison pairs "
        "its arms by seed; effect = treatment / control - 1 (or the difference of two relative "
        f"gains); {LEVEL:.0%} Student-t interval over seeds. Verdict: supports / contradicts "
        "when the interval clears the claim's threshold (0, or its margin), else inconclusive "
        "at this scale.",
        "",
        "| claim | verdict | paper |",
        "|---|---|---|",
        *[f"| ({r.claim.key}) {r.claim.title} | **{r.verdict}** | {r.claim.source} |"
          for r in results],
        "",
    ]
    for r in results:
        lines += [f"## ({r.claim.key}) {r.claim.title}", "",
                  f"> {r.claim.quote} ({r.claim.source})", "",
                  f"Spec `{r.spec.name}`; verdict **{r.verdict}**.", "",
                  *[f"- Incomplete: {line}." for line in r.incomplete],
                  *([""] if r.incomplete else [])]
        if not r.effects:
            lines += [f"No finished trials yet: `python -m orchestrator run "
                      f"{directory.rstrip('/')}/{r.spec.name}.yaml`.", ""]
            continue
        lines += ["```", format_table([_effect_row(r, e) for e in r.effects]), "",
                  format_table(r.arms), "```", "",
                  f"![({r.claim.key})](claim-{r.claim.key}.png)", ""]
    return "\n".join(lines)


def write_report(results: list[ClaimResult], out: Path, scale: str, directory: str) -> Path:
    """``out/REPORT.md`` and ``out/claim-<key>.png`` (claims with effects), each written whole
    or not at all. Returns the report's path.

    The text (and the commit it names) comes first: the figures of a report committed in the
    checkout are tracked files, and once rewritten they would mark the commit ``-dirty``.
    """
    text = markdown(results, scale, directory)
    for r in results:
        if r.effects:
            figure(r, out / f"claim-{r.claim.key}.png")
    path = out / "REPORT.md"
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def verdict_table(results: list[ClaimResult]) -> str:
    """The terminal summary: one row per comparison (or per claim without any)."""
    rows = [_effect_row(r, e) for r in results for e in r.effects]
    rows += [{"claim": f"({r.claim.key})", "comparison": "-", "verdict": NOT_RUN}
             for r in results if not r.effects]
    return format_table(rows)


def claims_of(directory: Path, scale: str) -> list[tuple[Claim, Path]]:
    """Every claim with its spec file under ``directory``.

    Raises:
        FileNotFoundError: a claim's spec is missing (one line naming it).
    """
    pairs = [(c, claim_spec_path(directory, c, scale)) for c in CLAIMS]
    for claim, path in pairs:
        if not path.exists():
            raise FileNotFoundError(f"claim ({claim.key}) needs {path}, which does not exist")
    return pairs
