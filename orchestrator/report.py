"""The claims report: each claim of a ``ClaimSet`` (``orchestrator.claims``: the paper's, or the
recursion study's) measured on the ledger's finished trials, with seeds, the mean effect, an
interval paired by seed and Holm-adjusted across the claim's comparisons, the minimum detectable
effect, and a verdict
(``orchestrator.verdicts``: supports, contradicts, equivalent, mixed, underpowered); written as
``REPORT.md`` plus one PNG figure per claim (and ``ladder.png``, the test metric against
training tokens, for a set's ladder). docs/statistics.md gives the formulas.

Protocol: per (variant, size, seed) the learning rate is chosen on validation (the Akima optimum
over log2 LR, ``analysis.seed_choices``) and the test metric is read there (and, beside it, the
test metric of the trained LR nearest the choice); a comparison pairs its arms by seed (only
seeds every arm finished). Optima at a grid's edge are flagged.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import textwrap
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import verdicts
from orchestrator.analysis import Point, seed_choices
from orchestrator.brackets import same_lr
from orchestrator.claims import CLAIM_SETS, Claim, ClaimSet, Comparison
from orchestrator.ledger import Ledger, Status, TrialRow
from orchestrator.results import experiment_rows, finished_points, short_metric
from orchestrator.spec import ExperimentSpec
from orchestrator.table import format_table
from workloads.core.atomic import atomic_path
from workloads.core.provenance import code_fingerprint, git_commit
from workloads.core.trial import Trial


@dataclass(frozen=True)
class Effect:
    """One comparison at one (dataset, size): per-seed effects (relative; at the chosen LRs,
    and with the nearest trained LRs' test metrics, ``nearest``), the 1 - ``alpha`` interval at
    the comparison's Holm level (``ci``; None with fewer than 2 seeds), its verdict, the
    interval that verdict rests on (``shown``, of coverage ``coverage``: ``ci``, or the
    1 - 2 alpha TOST interval of an equivalence), the equivalence ``margin`` (relative, ±), the
    minimum detectable effect at 80 % power (``mde``, relative) and the seeds that would bring
    it down to the margin (``seeds_needed``; ``verdicts.mde``, ``verdicts.seeds_for``)."""

    comparison: Comparison
    dataset: str
    size: str
    seeds: tuple[int, ...]
    per_seed: tuple[float, ...]
    nearest: tuple[float, ...]
    ci: tuple[float, float] | None
    alpha: float
    verdict: str
    margin: float = 0.01
    shown: tuple[float, float] | None = None
    coverage: float = 0.95
    mde: float | None = None
    seeds_needed: int | None = None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_seed)

    @property
    def std(self) -> float:
        """The seeds' sample standard deviation of the effect (relative; 0 for one seed)."""
        return statistics.stdev(self.per_seed) if len(self.per_seed) > 1 else 0.0

    @property
    def margin_unreachable(self) -> bool:
        """Whether the margin is below what these seeds detect (``mde`` > ``margin``)."""
        return self.mde is not None and self.mde > self.margin


def measure(comparison: Comparison, margin: float, dataset: str, size: str,
            seeds: tuple[int, ...], per_seed: tuple[float, ...], nearest: tuple[float, ...],
            alpha: float) -> Effect:
    """The ``Effect`` of one comparison's per-seed effects (relative) at Holm level ``alpha``
    with equivalence ``margin`` (relative, ±)."""
    sample = verdicts.Sample(per_seed, comparison.threshold, margin, comparison.tost)
    shown, coverage = verdicts.verdict_interval(sample, alpha)
    return Effect(comparison, dataset, size, seeds, per_seed, nearest, sample.interval(alpha),
                  alpha, verdicts.verdict(sample, alpha), margin, shown, coverage,
                  verdicts.mde(sample.sd, sample.n, alpha),
                  verdicts.seeds_for(sample.sd, margin, alpha) if sample.n > 1 else None)


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    spec: ExperimentSpec
    metric: str  # perplexity, rmse
    effects: tuple[Effect, ...]
    arms: list[dict]  # per (dataset, size, variant): test and chosen LR, mean ± std over seeds
    incomplete: tuple[str, ...] = ()  # arms and seeds left out: their LR grid is unfinished
    diverged: tuple[str, ...] = ()  # seeds kept with learning rates that diverged
    tests: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    # ^ (dataset, size, variant) -> the test metric of each seed at its chosen LR
    at_edge: tuple[str, ...] = ()  # arms with seeds whose chosen LR sits at the grid's edge
    trial_ids: frozenset[str] = frozenset()  # the spec's finished trials
    span: tuple[dt.datetime, dt.datetime] | None = None  # their first start, their last finish

    @property
    def verdict(self) -> str:
        return verdicts.combine([e.verdict for e in self.effects])

    @property
    def decided(self) -> str:
        """e.g. ``3 of 4 comparisons decided``."""
        n = sum(e.verdict in verdicts.DEFINITE for e in self.effects)
        return f"{n} of {len(self.effects)} comparisons decided"


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


def outcome(row: TrialRow) -> str:
    """``finished`` (FINISHED with finite validation and test metrics), ``diverged`` (FAILED;
    or FINISHED with a non-finite metric, or with no test metric at all: SQLite stores NaN as
    NULL) or ``missing`` (not yet run, or finished with a test metric but no validation metric
    recorded)."""
    if row.status == Status.FAILED or (row.status == Status.FINISHED and row.metric is None):
        return "diverged"
    if row.status != Status.FINISHED or row.val_metric is None:
        return "missing"
    finite = math.isfinite(row.metric) and math.isfinite(row.val_metric)
    return "finished" if finite else "diverged"


def required_lrs(spec: ExperimentSpec, rows: list[TrialRow]) -> dict[tuple, list[float]]:
    """Per (dataset, variant, size): the learning rates every seed must have, ascending: the
    spec's grid and every learning rate any seed of the arm has a row at (what its bracket's
    rounds added, ``lr_round``), whatever the row's status."""
    out: dict[tuple, list[float]] = defaultdict(lambda: list(spec.lr_grid))
    for r in rows:
        lrs = out[(r.dataset, r.variant, r.size)]
        if not any(same_lr(r.lr, lr) for lr in lrs):
            lrs.append(r.lr)
    return {arm: sorted(lrs) for arm, lrs in out.items()}


def complete_grids(spec: ExperimentSpec, rows: list[TrialRow],
                   ) -> tuple[list[Point], tuple[str, ...], tuple[str, ...]]:
    """The finished points of the (dataset, variant, size, seed) groups that have an outcome
    (``outcome``: finished or diverged) at every learning rate of their arm (``required_lrs``),
    one line per group left out, and one line per kept group with diverged learning rates. An
    LR chosen on part of the grid is not the one the full grid would choose, so a comparison
    never uses it; a diverged LR counts as present with infinite validation loss: the seed
    stays and that LR is never chosen (a seed whose every LR diverged is left out)."""
    required = required_lrs(spec, rows)
    groups: dict[tuple, list[TrialRow]] = defaultdict(list)
    for r in rows:
        groups[(r.dataset, r.variant, r.size, r.seed)].append(r)
    kept, left_out, diverged = [], [], []
    for (d, v, s, seed), rs in sorted(groups.items()):
        lrs = required[(d, v, s)]
        done = [r for r in rs if outcome(r) != "missing"]
        missing = [lr for lr in lrs if not any(same_lr(r.lr, lr) for r in done)]
        finite = finished_points([r for r in done if outcome(r) == "finished"])
        bad = sorted(r.lr for r in done if outcome(r) == "diverged")
        name = f"{v}@{s} ({d}) seed {seed}"
        if missing:
            left_out.append(f"{name}: {len(lrs) - len(missing)} of {len(lrs)} learning rates "
                            f"finished (not {', '.join(f'{lr:g}' for lr in missing)}), left out")
        elif not finite:
            left_out.append(f"{name}: every learning rate diverged, left out")
        else:
            kept += finite
            if bad:
                diverged.append(f"{name}: learning rate {', '.join(f'{lr:g}' for lr in bad)} "
                                "diverged, counted as infinite validation loss (never chosen)")
    return kept, tuple(left_out), tuple(diverged)


def evaluate(claim: Claim, spec: ExperimentSpec, ledger: Ledger,
             run_metrics: Callable[[str], dict[str, float]] | None = None) -> ClaimResult:
    """``claim`` measured on the finished trials of ``spec`` in ``ledger``, using only the
    seeds whose learning-rate grid is complete (``complete_grids``); the intervals and verdicts
    Holm-adjusted across all its comparisons at every (dataset, size). Test-time arms
    (``variant@setting``) read ``test_time/<setting>/perplexity`` from ``run_metrics`` (an MLflow
    run id to its metrics) of the trial nearest each seed's chosen learning rate; without it,
    or where the run lacks the setting, they have no seeds."""
    rows = experiment_rows(spec, ledger)
    points, incomplete, diverged = complete_grids(spec, rows)
    choices = seed_choices(points)
    run_of = {(r.dataset, r.variant, r.size, r.seed, r.lr): r.mlflow_run_id for r in rows}
    found, arms, all_tests = [], [], {}
    for dataset, size in sorted({(d, s) for d, _, s in choices}):
        here = {v: by_seed for (d, v, s), by_seed in choices.items() if (d, s) == (dataset, size)}
        tests = {v: {seed: c.test for seed, c in by_seed.items()} for v, by_seed in here.items()}
        nearest = {v: {seed: c.nearest for seed, c in by_seed.items()}
                   for v, by_seed in here.items()}
        for arm in sorted({a for c in claim.comparisons for a in c.arms if "@" in a}):
            variant, setting = arm.split("@")
            values = {}
            for seed, choice in here.get(variant, {}).items():
                run_id = run_of.get((dataset, variant, size, seed, choice.nearest_lr))
                value = (run_metrics(run_id).get(f"test_time/{setting}/perplexity")
                         if run_metrics and run_id else None)
                if value is not None:
                    values[seed] = value
            if values:
                tests[arm] = nearest[arm] = values
                all_tests[(dataset, size, arm)] = list(values.values())
                test = _pm(list(values.values()), "{:.3f}")  # the trained model's: one value
                chosen = [here[variant][seed] for seed in values]
                arms.append({"dataset": dataset, "size": size, "variant": arm,
                             "seeds": len(values), "test": test, "test (nearest LR)": test,
                             "LR (val)": _pm([c.nearest_lr for c in chosen], "{:.2e}"),
                             "at grid edge": f"{sum(c.at_edge for c in chosen)} of "
                                             f"{len(values)}"})
        for variant, by_seed in sorted(here.items()):
            values = [c.test for c in by_seed.values()]
            all_tests[(dataset, size, variant)] = values
            edge = [seed for seed, c in by_seed.items() if c.at_edge]
            arms.append({"dataset": dataset, "size": size, "variant": variant,
                         "seeds": len(by_seed), "test": _pm(values, "{:.3f}"),
                         "test (nearest LR)": _pm([c.nearest for c in by_seed.values()],
                                                  "{:.3f}"),
                         "LR (val)": _pm([c.lr for c in by_seed.values()], "{:.2e}"),
                         "at grid edge": f"{len(edge)} of {len(by_seed)}"})
        for comparison in claim.comparisons:
            seeds, per_seed = paired_effects(comparison, tests)
            if seeds:
                found.append((comparison, dataset, size, seeds, per_seed,
                              paired_effects(comparison, nearest)[1]))
    family = [verdicts.Sample(per_seed, c.threshold, claim.margin_of(c), c.tost).p_value()
              for c, _, _, _, per_seed, _ in found]  # each comparison's own test
    levels = verdicts.holm_levels(family)
    effects = tuple(measure(c, claim.margin_of(c), d, s, seeds, per_seed, near, alpha)
                    for (c, d, s, seeds, per_seed, near), alpha in zip(found, levels,
                                                                       strict=True))
    edges = tuple(f"{a['variant']}@{a['size']} ({a['dataset']}): {a['at grid edge']} seeds "
                  "chose a learning rate at the grid's edge" for a in arms
                  if "@" not in a["variant"] and not a["at grid edge"].startswith("0 "))
    finished = [r for r in rows if r.status == Status.FINISHED]
    timed = [(r.started_at, r.finished_at) for r in finished if r.started_at and r.finished_at]
    span = (min(s for s, _ in timed), max(f for _, f in timed)) if timed else None
    return ClaimResult(claim, spec, short_metric(spec), effects, arms, incomplete, diverged,
                       all_tests, edges, frozenset(r.trial_hash for r in finished), span)


def setup(results: list[ClaimResult]) -> str:
    """The report's setup line: the claims' data, seeds and budget fraction per size (of the
    Chinchilla budget, for specs that set their budget so), said to be unequal where sizes
    differ in it (size then stands in for budget); the distinct finished trials, and the wall
    clock from the first one's start to the last one's finish. Where some claims have finished
    trials and others none, the line describes the former and names the latter."""
    ran = [r for r in results if r.trial_ids]
    idle = [f"({r.claim.key})" for r in results if not r.trial_ids] if ran else []
    results = ran or results
    data = sorted({d for r in results for d in r.spec.workload_impl.datasets(
        r.spec.workload_config)})
    seeds = sorted({len(r.spec.seeds) for r in results})
    fractions: dict[str, set[float]] = defaultdict(set)
    per_param = set()
    for r in results:
        if r.spec.workload_impl.unit == "tokens" and r.spec.budget.tokens is None:
            per_param.add(r.spec.budget.tokens_per_param)
            for size in r.spec.sizes:
                fractions[size].add(r.spec.budget.scale_for(size))
    values = set().union(*fractions.values()) if fractions else set()
    if len(values) == 1:
        budget = (f"every size ({', '.join(fractions)}) on {values.pop():g} of its Chinchilla "
                  f"budget ({'/'.join(f'{p:g}' for p in sorted(per_param))} tokens per "
                  "parameter)")
    elif values:
        budget = ("budget fractions differ by size, so size stands in for budget: " + ", ".join(
            f"{size} {'/'.join(f'{f:g}' for f in sorted(fs))}" for size, fs in fractions.items()))
    else:
        budget = "fixed budgets"
    spans = [r.span for r in results if r.span]
    wall = (f", {_hours(max(f for _, f in spans) - min(s for s, _ in spans))} from the first "
            "start to the last finish" if spans else "")
    trials = len(frozenset().union(*(r.trial_ids for r in results)))
    not_run = f" Claims not run yet: {', '.join(idle)}." if idle else ""
    return (f"Setup: data {', '.join(data)}; {budget}; {'/'.join(map(str, seeds))} seeds per "
            f"arm; {trials} distinct trials finished{wall}.{not_run}")


def _hours(span: dt.timedelta) -> str:
    """``span`` as ``42 min`` or ``5.3 h``."""
    minutes = span.total_seconds() / 60
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def claim_spec_path(directory: Path, claim: Claim, scale: str = "cpu") -> Path:
    """``<directory>/<figure>-cpu.yaml`` (``scale`` cpu) or ``<figure>.yaml`` (paper)."""
    return directory / f"{claim.figure}{'-cpu' if scale == 'cpu' else ''}.yaml"


def missing_trials(spec: ExperimentSpec, ledger: Ledger) -> list[Trial]:
    """Planned trials of ``spec`` whose grid point has no finished row in ``ledger``."""
    from orchestrator.plan import plan

    done = {(r.dataset, r.variant, r.size, r.lr, r.seed)
            for r in experiment_rows(spec, ledger) if r.status == Status.FINISHED}
    return [t for t in plan(spec) if (t.dataset, t.variant, t.size, t.lr, t.seed) not in done]


def lr_protocol(spec: ExperimentSpec) -> str:
    """How a claim's spec sets each arm's learning rate: ``fixed at 0.002 (not chosen)`` for a
    grid of one, ``own optimum on 0.0005..0.008 (5)`` for a fixed grid, and ``own optimum on
    0.001..0.004 (3), adapting to 8`` for a bracket that adapts."""
    lrs = spec.lr_grid
    if len(lrs) == 1:
        return f"fixed at {lrs[0]:g} (not chosen)"
    bracket = f", adapting to {spec.lr_max_points}" if spec.lr_max_points else ""
    return f"own optimum on {lrs[0]:g}..{lrs[-1]:g} ({len(lrs)}){bracket}"


def _pm(xs: list[float], fmt: str) -> str:
    std = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(xs))} ± {fmt.format(std)}"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _level(coverage: float) -> str:
    """An interval's coverage (a fraction) as ``98.3 %``."""
    return f"{100 * coverage:.3g} %"


def _interval(e: Effect) -> str:
    """The effect's mean and the interval its verdict rests on, in %: ``+2.0% [-1.9, +4.4]``."""
    if e.shown is None:
        return f"{_pct(e.mean)} [-]"
    return f"{_pct(e.mean)} [{100 * e.shown[0]:+.1f}, {100 * e.shown[1]:+.1f}]"


def _effect_row(result: ClaimResult, e: Effect) -> dict:
    return {"claim": f"({result.claim.key})", "comparison": e.comparison.describe(),
            "data": e.dataset, "size": e.size, "seeds": len(e.seeds),
            "effect [interval]": _interval(e),
            "interval": f"{_level(e.coverage)}" + (" TOST" if e.shown != e.ci else "")
            if e.shown else "-",
            "sd (seeds)": f"{100 * e.std:.1f}%",
            "effect (nearest LR)": _pct(statistics.fmean(e.nearest)),
            "margin": f"±{100 * e.margin:g}%",
            "MDE (80 %)": f"{100 * e.mde:.1f}%" if e.mde is not None else "-",
            "seeds for margin": e.seeds_needed if e.seeds_needed is not None else "-",
            "verdict": e.verdict}


def margin_lines(result: ClaimResult) -> list[str]:
    """The claim's equivalence margin with its reason, then one line per comparison whose
    margin lies below its minimum detectable effect: there an equivalence cannot be shown and
    an effect as small as the margin not found with these seeds."""
    why = f" ({result.claim.equivalence_why})" if result.claim.equivalence_why else ""
    lines = [f"Equivalence margin: ±{100 * result.claim.equivalence:g} %{why}"]
    for e in result.effects:
        if e.margin_unreachable:
            more = (f"{e.seeds_needed} seeds would reach it" if e.seeds_needed
                    else "no feasible number of seeds reaches it")
            lines.append(
                f"Margin unreachable: {e.comparison.describe()} ({e.dataset}, {e.size}): "
                f"±{100 * e.margin:g} % lies below the minimum detectable effect "
                f"{100 * e.mde:.1f} % of {len(e.seeds)} seeds (sd {100 * e.std:.1f} %); {more}")
    return lines


TITLE_POINTS = 9  # font size of a figure's title
TITLE_CHAR_EM = 0.62  # DejaVu Sans' characters are narrower on average (about 0.5 em)
TITLE_SHARE = 0.95  # of the figure's width a title may fill


def title_chars(width_in: float, fontsize: float = TITLE_POINTS) -> int:
    """How many characters of a ``fontsize``-point title (points) fit on one line across
    ``TITLE_SHARE`` of a figure ``width_in`` inches wide, at ``TITLE_CHAR_EM`` ems a character.

    Raises:
        ValueError: ``width_in`` or ``fontsize`` not positive.
    """
    if not (width_in > 0 and fontsize > 0):
        raise ValueError(f"width_in and fontsize must be positive: {width_in}, {fontsize}")
    return max(1, math.floor(width_in * 72 * TITLE_SHARE / (fontsize * TITLE_CHAR_EM)))


def wrap_title(text: str, width_in: float, fontsize: float = TITLE_POINTS) -> str:
    """``text`` broken at spaces (``textwrap.fill``) into lines of at most ``title_chars``
    characters, so that a long claim's title stays inside a figure ``width_in`` inches wide (a
    single word longer than a line is broken too).

    Raises:
        ValueError: as ``title_chars``.
    """
    return textwrap.fill(text, title_chars(width_in, fontsize), break_on_hyphens=False)


def _title(fig, text: str) -> None:
    """``text`` wrapped to ``fig``'s width as its title, centred on the figure (an axes title is
    centred on the axes, which long tick labels push right, and overflows the right edge)."""
    fig.suptitle(wrap_title(text, fig.get_figwidth()), fontsize=TITLE_POINTS)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_png(plt, fig, path: Path) -> None:
    """``fig`` as a PNG at ``path``, written whole or not at all; the figure is closed."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def interval_label(effects: tuple[Effect, ...]) -> str:
    """What a claim figure's bars are: ``Holm-adjusted 98.3 % interval`` when every bar has
    that coverage, else ``Holm-adjusted interval (level per row)``."""
    levels = {_level(e.coverage) for e in effects if e.shown}
    if len(levels) == 1:
        return f"Holm-adjusted {levels.pop()} interval"
    return "Holm-adjusted interval (level per row)"


def figure(result: ClaimResult, path: Path) -> None:
    """Per-seed effects (dots), their mean and the interval each verdict rests on (bar, at its
    Holm-adjusted level, stated on the axis and per row) for every comparison of the claim,
    against 0 and the claim's margin, under the claim's title wrapped to the figure
    (``wrap_title``); written as a PNG (matplotlib, no display)."""
    plt = _pyplot()
    effects = result.effects
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * max(len(effects), 1)))
    for y, e in enumerate(effects):
        ax.scatter([100 * x for x in e.per_seed], [y] * len(e.per_seed), color="0.5", s=14,
                   zorder=3)
        low, high = e.shown if e.shown else (e.mean, e.mean)
        color = {verdicts.SUPPORTS: "tab:green", verdicts.CONTRADICTS: "tab:red",
                 verdicts.EQUIVALENT: "tab:blue"}.get(e.verdict, "tab:gray")
        ax.errorbar(100 * e.mean, y, xerr=[[100 * (e.mean - low)], [100 * (high - e.mean)]],
                    fmt="o", color=color, capsize=4, zorder=4)
        if e.comparison.kind == "not_worse":
            ax.plot([100 * e.comparison.margin] * 2, [y - 0.4, y + 0.4], color="tab:orange",
                    linestyle="--")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(effects)),
                  [f"{e.comparison.describe()}\n{e.dataset}, {e.size}"
                   + (f", {_level(e.coverage)}" if e.shown else "") for e in effects],
                  fontsize=7)
    ax.set_xlabel(f"effect on test {result.metric} (%, negative: treatment better)\n"
                  f"bars: {interval_label(effects)}s, paired by seed")
    _title(fig, f"({result.claim.key}) {result.claim.title}: {result.verdict}")
    _save_png(plt, fig, path)


def ladder_figure(results: list[ClaimResult], path: Path) -> bool:
    """Each arm's test metric (mean ± std over seeds, at its chosen LR) against the tokens per
    trial of its spec (log x), one line per (variant, dataset, size) over ``results``, the
    claims of a token ladder; written as a PNG. False (nothing written) without two budgets."""
    from orchestrator.plan import plan

    series: dict[tuple[str, str, str], list[tuple[int, list[float]]]] = defaultdict(list)
    for r in results:
        tokens = {(t.dataset, t.size, t.variant): t.tokens for t in plan(r.spec)}
        arms = {a for c in r.claim.comparisons for a in c.arms}
        for key, values in r.tests.items():
            if key[2] in arms:
                series[key[2], key[0], key[1]].append((tokens[key], values))
    if max((len({n for n, _ in pts}) for pts in series.values()), default=0) < 2:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (variant, dataset, size), pts in sorted(series.items()):
        pts.sort()
        ax.errorbar([n for n, _ in pts], [statistics.fmean(v) for _, v in pts],
                    yerr=[statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in pts],
                    marker="o", capsize=3, label=f"{variant} ({dataset}, {size})")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens per trial")
    ax.set_ylabel(f"test {results[0].metric} (mean ± std over seeds)")
    _title(fig, "More tokens: " + ", ".join(f"({r.claim.key})" for r in results))
    ax.legend(fontsize=8)
    _save_png(plt, fig, path)
    return True


def markdown(results: list[ClaimResult], scale: str, directory: str,
             title: str = "The paper's claims", ladder: bool = False,
             commit: str | None = None) -> str:
    """REPORT.md: provenance (``commit``, else the checkout's), the verdict table, then one
    section per claim (and the ladder figure's link when ``ladder``)."""
    commit = commit or git_commit() or "unknown"
    lines = [
        f"# {title} at {scale.upper()} scale",
        "",
        f"Written by `cemlab report {directory}` on "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, commit `{commit}`, model code "
        f"`{code_fingerprint()}`.",
        "",
        setup(results),
        "",
        "Protocol: for every variant, size and seed the learning rate is chosen on validation "
        "(Akima optimum over log2 LR) and the test metric is read there (the trained LR nearest "
        "the choice beside it); each comparison pairs its arms by seed; effect = treatment / "
        "control - 1 (or the difference of two relative gains); a Student-t interval over "
        f"seeds at the comparison's Holm level (family-wise {verdicts.ALPHA:.0%} over the "
        "claim's comparisons). Verdicts: supports / contradicts when the interval clears the "
        "claim's threshold (0, or its not-worse margin) on one side; equivalent when the TOST "
        "interval lies inside the claim's equivalence margin; underpowered otherwise. A claim "
        "takes the verdict its decided comparisons share, mixed when they differ, underpowered "
        "when none is decided. The effect column gives the interval the verdict rests on, sd "
        "the seeds' spread, MDE the effect detected with 80 % power at the comparison's level "
        "(the formulas: `docs/statistics.md`).",
        "",
        "| claim | verdict | learning rate | paper |",
        "|---|---|---|---|",
        *[f"| ({r.claim.key}) {r.claim.title} | **{r.verdict}** | {lr_protocol(r.spec)} | "
          f"{r.claim.source} |" for r in results],
        "",
        *(["Test metric against training tokens (the ladder's claims):", "",
           "![tokens](ladder.png)", ""] if ladder else []),
    ]
    for r in results:
        lines += [f"## ({r.claim.key}) {r.claim.title}", "",
                  f"> {r.claim.quote} ({r.claim.source})", "",
                  f"Spec `{r.spec.name}`; verdict **{r.verdict}** ({r.decided}); learning "
                  f"rate: {lr_protocol(r.spec)}.", "",
                  *[f"- {line}." for line in margin_lines(r)],
                  *[f"- Incomplete: {line}." for line in r.incomplete],
                  *[f"- Diverged: {line}." for line in r.diverged],
                  *[f"- At a grid edge: {line}." for line in r.at_edge], ""]
        if not r.effects:
            lines += [f"No finished trials yet: `cemlab run "
                      f"{directory.rstrip('/')}/{r.spec.name}.yaml`.", ""]
            continue
        lines += ["```", format_table([_effect_row(r, e) for e in r.effects]), "",
                  format_table(r.arms), "```", "",
                  f"![({r.claim.key})](claim-{r.claim.key}.png)", ""]
    return "\n".join(lines)


def write_report(results: list[ClaimResult], out: Path, scale: str, directory: str,
                 claim_set: ClaimSet = CLAIM_SETS["paper"]) -> Path:
    """``out/REPORT.md``, ``out/claim-<key>.png`` (claims with effects) and ``out/ladder.png``
    (``claim_set.ladder``, two budgets or more), each written whole or not at all. Returns the
    report's path. A claim without effects loses the figure an earlier report drew for it, so
    that no figure in ``out`` outlives the data the report now has.

    The commit the text names is read first: the figures of a report committed in the checkout
    are tracked files, and once rewritten they would mark the commit ``-dirty``.
    """
    commit = git_commit() or "unknown"
    in_ladder = [r for r in results if r.claim.key in claim_set.ladder]
    ladder = ladder_figure(in_ladder, out / "ladder.png") if in_ladder else False
    text = markdown(results, scale, directory, claim_set.title, ladder, commit)
    for r in results:
        drawn = out / f"claim-{r.claim.key}.png"
        if r.effects:
            figure(r, drawn)
        else:
            drawn.unlink(missing_ok=True)
    path = out / "REPORT.md"
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def verdict_table(results: list[ClaimResult]) -> str:
    """The terminal summary: one row per comparison (or per claim without any)."""
    rows = [_effect_row(r, e) for r in results for e in r.effects]
    rows += [{"claim": f"({r.claim.key})", "comparison": "-", "verdict": verdicts.NOT_RUN}
             for r in results if not r.effects]
    return format_table(rows)


def claims_of(directory: Path, scale: str, claim_set: ClaimSet = CLAIM_SETS["paper"]
              ) -> list[tuple[Claim, Path]]:
    """Every claim of ``claim_set`` with its spec file under ``directory``.

    Raises:
        FileNotFoundError: a claim's spec is missing (one line naming it).
    """
    pairs = [(c, claim_spec_path(directory, c, scale)) for c in claim_set.claims]
    for claim, path in pairs:
        if not path.exists():
            raise FileNotFoundError(f"claim ({claim.key}) needs {path}, which does not exist")
    return pairs
