"""The claims report: each claim of a ``ClaimSet`` (``orchestrator.science.claims``: the paper's,
or the recursion study's) measured on the ledger's finished trials, one pooled regression per
comparison (log test metric on arm and size, with an arm x log N trend) with its interval at the
comparison's Holm level across the claim, the minimum detectable effect and the seeds that
would reach the claim's margin, and a verdict (``orchestrator.science.verdicts``: supports,
contradicts, equivalent, mixed, underpowered); written as ``REPORT.md`` plus one PNG figure per
claim (and ``ladder.png``, the test metric against training tokens, for a set's ladder).
docs/statistics.md gives the formulas.

Protocol: per (dataset, variant, size) the learning rate is chosen once, on the tuning seeds'
mean log validation metric over the learning rates they trained (``results.tuning``); the test
metric is read from trained models at that learning rate, the evaluation seeds'
(``learning_rates.eval_seeds``) where the spec has them and they finished, else the tuning
seeds' (said so); nothing is interpolated. Per-size contrasts stay in the report as detail.
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

from orchestrator.planning.spec import ExperimentSpec
from orchestrator.records.ledger import Ledger, Status
from orchestrator.science import verdicts
from orchestrator.science.brackets import same_lr
from orchestrator.science.claims import CLAIM_SETS, Claim, ClaimSet, Comparison
from orchestrator.science.results import (
    Arm,
    Models,
    Tuning,
    arm_rows,
    evaluations,
    experiment_rows,
    required_lrs,
    short_metric,
    tuned_models,
    tuning,
)
from orchestrator.table import format_table
from workloads.core.atomic import atomic_path
from workloads.core.provenance import code_fingerprint, git_commit
from workloads.core.trial import Trial

EVALUATION, TUNING = "evaluation", "tuning"  # where a comparison's test metrics come from


@dataclass(frozen=True)
class Effect:
    """One comparison pooled over the claim's sizes (``verdicts.pooled_fit``; None without a
    residual degree of freedom): its models' ``source`` (``evaluation`` or ``tuning`` seeds),
    its Holm level ``alpha`` and verdict, the 1 - alpha interval of the log ratio (``ci``), the
    interval the verdict rests on (``shown``, of coverage ``coverage``: ``ci``, or the 1 - 2
    alpha TOST interval of an equivalence), the equivalence ``margin`` (relative, ±, as the
    claim states it), the minimum detectable effect at 80 % power (``mde``, a log ratio) and the
    seeds per (arm, size) that would bring it down to the margin (``seeds_needed``;
    ``verdicts.mde``, ``verdicts.seeds_for`` on the fit's residual sd and design)."""

    comparison: Comparison
    source: str
    fit: verdicts.PooledFit | None
    alpha: float
    verdict: str
    margin: float = 0.01
    ci: tuple[float, float] | None = None
    shown: tuple[float, float] | None = None
    coverage: float = 0.95
    mde: float | None = None
    seeds_needed: int | None = None

    @property
    def estimate(self) -> float | None:
        """The pooled log ratio (treatment over control), None without a fit."""
        return self.fit.estimate if self.fit else None

    @property
    def margin_log(self) -> float:
        """The equivalence margin as a log ratio: ``log(1 + margin)``."""
        return math.log1p(self.margin)

    @property
    def margin_unreachable(self) -> bool:
        """Whether the margin lies below what this design detects (``mde`` > ``margin_log``):
        there it cannot show equivalence."""
        return self.mde is not None and self.mde > self.margin_log

    @property
    def seeds(self) -> tuple[int, int]:
        """The fewest and the most seeds of any (arm, size) cell of the fit."""
        counts = [n for b in self.fit.blocks for n in b.counts] if self.fit else [0]
        return min(counts), max(counts)


def estimate_of(comparison: Comparison, margin: float, fit: verdicts.PooledFit,
                ) -> verdicts.Estimate:
    """The ``verdicts.Estimate`` of ``fit``: its log ratio, standard error and residual degrees
    of freedom against the comparison's threshold ``log(1 + threshold)`` and equivalence margin
    ``log(1 + margin)`` (``margin`` relative, ±)."""
    return verdicts.Estimate(fit.estimate, fit.se, fit.df, math.log1p(comparison.threshold),
                             math.log1p(margin), comparison.tost)


def measure(comparison: Comparison, margin: float, source: str,
            fit: verdicts.PooledFit | None, alpha: float) -> Effect:
    """The ``Effect`` of one comparison's pooled ``fit`` at Holm level ``alpha`` with
    equivalence ``margin`` (relative, ±)."""
    if fit is None:
        return Effect(comparison, source, None, alpha, verdicts.UNDERPOWERED, margin)
    est = estimate_of(comparison, margin, fit)
    shown, coverage = verdicts.verdict_interval(est, alpha)
    return Effect(comparison, source, fit, alpha, verdicts.verdict(est, alpha), margin,
                  est.interval(alpha), shown, coverage, est.mde(alpha),
                  verdicts.seeds_for(fit.sd, math.log1p(margin), alpha,
                                     design=fit.design))


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    spec: ExperimentSpec
    metric: str  # perplexity, rmse
    effects: tuple[Effect, ...]
    arms: list[dict]  # per (dataset, size, variant): chosen LR, seeds, spreads (results.arm_rows)
    incomplete: tuple[str, ...] = ()  # tuning seeds left out: their LR grid is unfinished
    diverged: tuple[str, ...] = ()  # tuning seeds kept with learning rates that diverged
    tests: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    # ^ (dataset, size, variant) -> the test metric of each trained model read at its chosen LR
    at_edge: tuple[str, ...] = ()  # arms whose chosen LR is the edge of their learning rates
    trial_ids: frozenset[str] = frozenset()  # the spec's finished trials
    span: tuple[dt.datetime, dt.datetime] | None = None  # their first start, their last finish
    notes: tuple[str, ...] = ()  # evaluation rows not used, arms without a choice

    @property
    def verdict(self) -> str:
        return verdicts.combine([e.verdict for e in self.effects])

    @property
    def decided(self) -> str:
        """e.g. ``1 of 2 comparisons decided``."""
        n = sum(e.verdict in verdicts.DEFINITE for e in self.effects)
        return f"{n} of {len(self.effects)} comparisons decided"


def weights(comparison: Comparison) -> dict[str, float]:
    """The comparison's contrast weights per arm, the control second (the regression's
    reference): ``treatment - control`` in log test metric, or with base arms the log ratio of
    the two gains ``(treatment - treatment_base) - (control - control_base)``; an arm named
    twice sums its weights, and arms whose weight is 0 are dropped."""
    out: dict[str, float] = defaultdict(float)
    for arm, w in ((comparison.treatment, 1.0), (comparison.control, -1.0),
                   (comparison.treatment_base, -1.0), (comparison.control_base, 1.0)):
        if arm:
            out[arm] += w
    return {a: w for a, w in out.items() if w != 0}


def observations(comparison: Comparison, values: dict[tuple[str, str, str], dict[int, float]],
                 ) -> list[verdicts.Observation]:
    """``comparison``'s observations: for every (dataset, size) block and arm of ``values``
    ((dataset, size, arm) -> seed -> test metric), one per seed, ``y`` the log of its test
    metric; blocks are named ``dataset/size``."""
    arms = set(weights(comparison))
    return [verdicts.Observation(arm, f"{d}/{s}", seed, math.log(y))
            for (d, s, arm), by_seed in sorted(values.items()) if arm in arms
            for seed, y in sorted(by_seed.items())]


def arm_values(spec: ExperimentSpec, arms: set[str], models: dict[Arm, Models],
               run_metrics: Callable[[str], dict[str, float]] | None,
               ) -> dict[tuple[str, str, str], dict[int, float]]:
    """(dataset, size, arm) -> seed -> test metric of the trained models in ``models`` (their
    chosen learning rate). A test-time arm ``variant@setting`` reads
    ``test_time/<setting>/perplexity`` from ``run_metrics`` (an MLflow run id to its metrics)
    of the same models; without it, or where a run lacks the setting, it has none."""
    out: dict[tuple[str, str, str], dict[int, float]] = {}
    for (dataset, variant, size), m in models.items():
        if variant in arms and m.tests:
            out[(dataset, size, variant)] = dict(m.tests)
        for arm in arms:
            if "@" not in arm or arm.split("@")[0] != variant:
                continue
            setting = arm.split("@")[1]
            values = {}
            for seed, run_id in m.runs.items():
                value = (run_metrics(run_id).get(f"test_time/{setting}/perplexity")
                         if run_metrics and run_id else None)
                if value is not None:
                    values[seed] = value
            if values:
                out[(dataset, size, arm)] = values
    return out


def log_params(spec: ExperimentSpec) -> dict[tuple[str, str, str], float]:
    """(dataset, variant, size) -> the natural log of its total parameter count, as planned
    (``plan.arm_cells``, without the prepared data: the spec's vocabulary)."""
    from orchestrator.planning.plan import arm_cells

    return {arm: math.log(cell(spec.lr_grid[0], spec.seeds[0]).params["total"])
            for arm, cell in arm_cells(spec).items()}


def _complete(comparison: Comparison, values: dict) -> bool:
    """Whether some (dataset, size) block of ``values`` has every arm of ``comparison``."""
    arms = set(weights(comparison))
    blocks = {(d, s) for d, s, _ in values}
    return any(all((d, s, a) in values for a in arms) for d, s in blocks)


def evaluate(claim: Claim, spec: ExperimentSpec, ledger: Ledger,
             run_metrics: Callable[[str], dict[str, float]] | None = None) -> ClaimResult:
    """``claim`` measured on the finished trials of ``spec`` in ``ledger``: each arm's learning
    rate chosen on its complete tuning seeds' mean log validation (``results.tuning``), the
    test metric of the trained models there (``results.evaluations``: the evaluation seeds;
    a comparison none of whose blocks has every arm evaluated reads the tuning seeds' models,
    ``results.tuned_models``), one pooled regression per comparison over every (dataset, size)
    with every arm (``verdicts.pooled_fit``; the blocks' log N the control's parameter count;
    paired by seed when every arm is one trained variant), Holm-adjusted across the claim's
    comparisons. Test-time arms (``variant@setting``) read ``test_time/<setting>/perplexity``
    from ``run_metrics`` (an MLflow run id to its metrics) of the same trained models."""
    rows = experiment_rows(spec, ledger)
    tuned: Tuning = tuning(spec, rows)
    evaluated, notes = evaluations(spec, rows, tuned)
    tuned_at = tuned_models(rows, tuned)
    arms_named = {a for c in claim.comparisons for a in c.arms}
    by_source = {EVALUATION: arm_values(spec, arms_named, evaluated, run_metrics),
                 TUNING: arm_values(spec, arms_named, tuned_at, run_metrics)}
    logn = log_params(spec) if tuned.choices else {}
    found = []
    for comparison in claim.comparisons:
        w = weights(comparison)
        if len(w) < 2:
            continue
        source = EVALUATION if spec.eval_seeds and _complete(comparison,
                                                             by_source[EVALUATION]) else TUNING
        values = by_source[source]
        if not _complete(comparison, values):
            continue
        control = comparison.control.split("@")[0]
        blocks = {f"{d}/{s}": logn[(d, control, s)] for d, s, _ in values
                  if (d, control, s) in logn}
        fit = verdicts.pooled_fit(observations(comparison, values), w, blocks,
                                  paired=len(comparison.variants) == 1)
        found.append((comparison, source, fit))
    family = [estimate_of(c, claim.margin_of(c), fit).p_value() if fit else 1.0
              for c, _, fit in found]  # each comparison's own test
    levels = verdicts.holm_levels(family)
    effects = tuple(measure(c, claim.margin_of(c), source, fit, alpha)
                    for (c, source, fit), alpha in zip(found, levels, strict=True))
    used = {**tuned_at, **evaluated}  # per arm, the evaluation seeds where any finished
    tests = {key: list(values.values())
             for key, values in {**by_source[TUNING], **by_source[EVALUATION]}.items()}
    edges = tuple(f"{v}@{s} ({d}): learning rate {c.lr:g} is the "
                  f"{'smallest' if same_lr(c.lr, c.lrs[0]) else 'largest'} of the "
                  f"{len(c.lrs)} it trained: no optimum" for (d, v, s), c in
                  sorted(tuned.choices.items()) if c.at_edge)
    finished = [r for r in rows if r.status == Status.FINISHED]
    timed = [(r.started_at, r.finished_at) for r in finished if r.started_at and r.finished_at]
    span = (min(s for s, _ in timed), max(f for _, f in timed)) if timed else None
    return ClaimResult(claim, spec, short_metric(spec), effects, arm_rows(tuned, used),
                       tuned.incomplete, tuned.diverged, tests, edges,
                       frozenset(r.trial_hash for r in finished), span,
                       (*tuned.unchosen, *notes))


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
    seeds = sorted({(len(r.spec.seeds), len(r.spec.eval_seeds)) for r in results})
    fractions: dict[str, set[float]] = defaultdict(set)
    per_param = set()
    for r in results:
        if r.spec.workload_impl.unit == "tokens" and r.spec.budget.tokens is None:
            per_param.add(r.spec.budget.tokens_per_param)
            for size in r.spec.sizes:
                fractions[size].add(r.spec.budget.scale_for(size))
    values = set().union(*fractions.values()) if fractions else set()
    if len(values) == 1:
        budget = (f"every size ({', '.join(fractions)}) on {values.pop():g}x its Chinchilla "
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
    if all(e == 0 for _, e in seeds):
        per_arm = f"{'/'.join(str(t) for t, _ in seeds)} seeds per arm"
    else:
        per_arm = (f"{'/'.join(str(t) for t, _ in seeds)} tuning and "
                   f"{'/'.join(str(e) for _, e in seeds)} evaluation seeds per arm")
    return (f"Setup: data {', '.join(data)}; {budget}; {per_arm}; {trials} distinct trials "
            f"finished{wall}.{not_run}")


_IN_WORDS = {verdicts.SUPPORTS: "holds here", verdicts.CONTRADICTS: "does not hold here",
             verdicts.EQUIVALENT: "its arms are equal within its margin",
             verdicts.MIXED: "mixed, its comparisons disagree",
             verdicts.UNDERPOWERED: "undecided (its section says what would decide it)"}


def _side(name: str, base: str | None) -> str:
    return f"{name} over {base}" if base else name


def effect_in_words(e: Effect, metric: str) -> str | None:
    """One comparison in plain words, e.g. ``cem-attn's test perplexity is 12.3 % higher than
    llama's, +10.1 to +14.6 %``; with base arms, the two gains' ratio (``cem-attn-t2 over
    cem-attn-t1 is 2.0 % lower than llama-reuse-t2 over llama-t1``). None without a fit."""
    if e.estimate is None:
        return None
    c = e.comparison
    if c.treatment_base:
        head = (f"{_side(c.treatment, c.treatment_base)} is {{}} than "
                f"{_side(c.control, c.control_base)}")
    else:
        head = f"{c.treatment}'s test {metric} is {{}} than {c.control}'s"
    change = as_percent(e.estimate)
    words = f"{abs(change):.1f} % {'lower' if change < 0 else 'higher'}"
    span = (f", {as_percent(e.shown[0]):+.1f} to {as_percent(e.shown[1]):+.1f} %"
            if e.shown else "")
    return head.format(words) + span


def summary(results: list[ClaimResult]) -> str:
    """The report's paragraph in plain words: each claim that ran, whether it holds at this
    scale, and its comparisons' pooled effects with the interval the verdict rests on."""
    ran = [r for r in results if r.effects]
    if not ran:
        return "In plain words: no claim has run yet."
    sentences = []
    for r in ran:
        effects = [w for e in r.effects if (w := effect_in_words(e, r.metric))]
        said = _IN_WORDS.get(r.verdict, r.verdict)
        sentences.append(f"({r.claim.key}) \"{r.claim.title}\": {said}"
                         + (f" ({'; '.join(effects)})" if effects else "") + ".")
    idle = [f"({r.claim.key})" for r in results if not r.effects]
    rest = f" Not run yet: {', '.join(idle)}." if idle else ""
    return (f"In plain words ({len(ran)} of {len(results)} claims run; effects pooled over "
            "sizes, lower is better): " + " ".join(sentences) + rest)


def _hours(span: dt.timedelta) -> str:
    """``span`` as ``42 min`` or ``5.3 h``."""
    minutes = span.total_seconds() / 60
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def claim_spec_path(directory: Path, claim: Claim, scale: str = "cpu") -> Path:
    """``<directory>/<figure>-cpu.yaml`` (``scale`` cpu) or ``<figure>.yaml`` (paper)."""
    return directory / f"{claim.figure}{'-cpu' if scale == 'cpu' else ''}.yaml"


def missing_trials(spec: ExperimentSpec, ledger: Ledger) -> list[Trial]:
    """Planned trials of ``spec`` whose grid point has no finished row in ``ledger``: the
    tuning seeds' at every learning rate of their arm (the grid and what its bracket's rounds
    added, ``results.required_lrs``), and the evaluation seeds' at the learning rate each arm
    chose so far (``results.tuning``; an arm without a choice plans none yet)."""
    from orchestrator.planning.plan import arm_cells

    rows = experiment_rows(spec, ledger)
    done = [(r.dataset, r.variant, r.size, r.lr, r.seed) for r in rows
            if r.status == Status.FINISHED]

    def finished(t: Trial) -> bool:
        return any((d, v, s, seed) == (t.dataset, t.variant, t.size, t.seed) and same_lr(lr, t.lr)
                   for d, v, s, lr, seed in done)

    cells = arm_cells(spec)
    required = required_lrs(spec, rows)
    trials = [cell(lr, seed) for arm, cell in cells.items()
              for lr in required.get(arm, spec.lr_grid) for seed in spec.seeds]
    if spec.eval_seeds:
        trials += [cells[arm](choice.lr, seed)
                   for arm, choice in sorted(tuning(spec, rows).choices.items())
                   for seed in spec.eval_seeds]
    return [t for t in trials if not finished(t)]


def lr_protocol(spec: ExperimentSpec) -> str:
    """How a claim's spec sets each arm's learning rate: ``fixed at 0.002 (not chosen)`` for a
    grid of one, ``own optimum on 0.0005..0.008 (5)`` for a fixed grid (the trained learning
    rate of lowest mean validation over the tuning seeds), and ``own optimum on 0.001..0.004
    (3), adapting to 8`` for a bracket that adapts; with evaluation seeds, ``; tested on 5
    fresh seeds there``."""
    lrs = spec.lr_grid
    tested = (f"; tested on {len(spec.eval_seeds)} fresh seeds there" if spec.eval_seeds
              else "")
    if len(lrs) == 1:
        return f"fixed at {lrs[0]:g} (not chosen){tested}"
    bracket = f", adapting to {spec.lr_max_points}" if spec.lr_max_points else ""
    return f"own optimum on {lrs[0]:g}..{lrs[-1]:g} ({len(lrs)}){bracket}{tested}"


def _pm(xs: list[float], fmt: str) -> str:
    std = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(xs))} ± {fmt.format(std)}"


def as_percent(log_ratio: float) -> float:
    """A log ratio as a relative change in %: ``100 (exp(x) - 1)``."""
    return 100 * math.expm1(log_ratio)


def _pct(log_ratio: float) -> str:
    return f"{as_percent(log_ratio):+.1f}%"


def _level(coverage: float) -> str:
    """An interval's coverage (a fraction) as ``98.3 %``."""
    return f"{100 * coverage:.3g} %"


def _interval(e: Effect) -> str:
    """The pooled effect and the interval its verdict rests on, as relative changes in %
    (``exp`` of the log ratio and its bounds, less 1): ``+2.0% [-1.9, +4.4]``."""
    if e.estimate is None:
        return "-"
    if e.shown is None:
        return f"{_pct(e.estimate)} [-]"
    return (f"{_pct(e.estimate)} [{as_percent(e.shown[0]):+.1f}, "
            f"{as_percent(e.shown[1]):+.1f}]")


def _trend(e: Effect) -> str:
    """The effect's change per doubling of N (``slope * ln 2`` as %) ± its standard error."""
    if e.fit is None or e.fit.slope is None:
        return "-"
    return (f"{_pct(e.fit.slope * math.log(2))} ± "
            f"{100 * e.fit.slope_se * math.log(2):.1f}")


def _effect_row(result: ClaimResult, e: Effect) -> dict:
    low, high = e.seeds
    return {"claim": f"({result.claim.key})", "comparison": e.comparison.describe(),
            "sizes": len(e.fit.blocks) if e.fit else "-",
            "seeds": (f"{low}{f'-{high}' if high != low else ''} {e.source}" if e.fit
                      else f"- {e.source}"),
            "effect [interval]": _interval(e),
            "interval": f"{_level(e.coverage)}" + (" TOST" if e.shown != e.ci else "")
            if e.shown else "-",
            "per 2x N": _trend(e),
            "sd (resid.)": f"{100 * e.fit.sd:.1f}%" if e.fit else "-",
            "margin": f"±{100 * e.margin:g}%",
            "MDE (80 %)": f"{as_percent(e.mde):.1f}%" if e.mde is not None else "-",
            "seeds for margin": e.seeds_needed if e.seeds_needed is not None else "-",
            "verdict": e.verdict}


DETAIL_COVERAGE = 0.95  # the per-size rows' intervals: detail, not Holm-adjusted


def detail_rows(result: ClaimResult) -> list[dict]:
    """One row per comparison and (dataset, size) of its fit: the contrast of the cells' mean
    log test metrics there with its unadjusted 95 % interval on the pooled residual sd
    (``verdicts.BlockEffect``), each arm's seeds and seed sd of log test: detail beside the
    pooled verdict, never a verdict."""
    from scipy.stats import t

    rows = []
    for e in result.effects:
        if e.fit is None:
            continue
        half = float(t.ppf(1 - (1 - DETAIL_COVERAGE) / 2, e.fit.df))
        for b in e.fit.blocks:
            dataset, size = b.block.split("/", 1)
            low, high = (as_percent(b.value + sign * half * b.se) for sign in (-1, 1))
            rows.append({"claim": f"({result.claim.key})",
                         "comparison": e.comparison.describe(), "data": dataset,
                         "size": size, "seeds per arm": "/".join(map(str, b.counts)),
                         "effect [95 %]": f"{_pct(b.value)} [{low:+.1f}, {high:+.1f}]",
                         "seed sd per arm": "/".join(f"{100 * sd:.1f}%" for sd in b.sds)})
    return rows


def source_lines(result: ClaimResult) -> list[str]:
    """One line per comparison whose test metrics are the tuning seeds' although the spec
    names evaluation seeds (none of its sizes has every arm evaluated yet), and one per
    comparison with sizes left out of its fit (an arm without models there)."""
    lines = []
    for e in result.effects:
        if e.source == TUNING and result.spec.eval_seeds:
            lines.append(f"Tuning seeds: {e.comparison.describe()} reads the models its "
                         "learning rates were chosen on: its evaluation seeds have not run")
        if e.fit and e.fit.left_out:
            lines.append(f"Left out: {e.comparison.describe()} at {', '.join(e.fit.left_out)}"
                         ": an arm has no models there")
    return lines


def margin_lines(result: ClaimResult) -> list[str]:
    """The claim's equivalence margin with its reason, then one line per comparison whose
    margin lies below its minimum detectable effect: that design cannot show equivalence
    within the margin (nor find an effect as small), and the seeds per (arm, size) that would
    (``verdicts.seeds_for``)."""
    why = f" ({result.claim.equivalence_why})" if result.claim.equivalence_why else ""
    lines = [f"Equivalence margin: ±{100 * result.claim.equivalence:g} %{why}"]
    for e in result.effects:
        if e.margin_unreachable:
            more = (f"{e.seeds_needed} seeds per arm and size would reach it" if e.seeds_needed
                    else "no feasible number of seeds reaches it")
            low, high = e.seeds
            lines.append(
                f"Cannot show equivalence: {e.comparison.describe()}: its margin "
                f"±{100 * e.margin:g} % lies below the minimum detectable effect "
                f"{as_percent(e.mde):.1f} % of this design ({low}"
                f"{f'-{high}' if high != low else ''} {e.source} seeds per arm and size over "
                f"{len(e.fit.blocks)} size(s), residual sd {100 * e.fit.sd:.1f} %); {more}")
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
    """Every comparison of the claim pooled over its sizes: the effect (relative change in %,
    the exp of the log ratio less 1) and the interval its verdict rests on (bar, at its
    Holm-adjusted level, stated on the axis and per row), each size's contrast beside it (grey
    dots: detail), against 0 and the claim's not-worse margin, under the claim's title wrapped
    to the figure (``wrap_title``); written as a PNG (matplotlib, no display)."""
    plt = _pyplot()
    effects = result.effects
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * max(len(effects), 1)))
    for y, e in enumerate(effects):
        if e.fit is None:
            continue
        sizes = [as_percent(b.value) for b in e.fit.blocks]
        ax.scatter(sizes, [y] * len(sizes), color="0.5", s=14, zorder=3)
        mid = as_percent(e.fit.estimate)
        low, high = (as_percent(x) for x in e.shown) if e.shown else (mid, mid)
        color = {verdicts.SUPPORTS: "tab:green", verdicts.CONTRADICTS: "tab:red",
                 verdicts.EQUIVALENT: "tab:blue"}.get(e.verdict, "tab:gray")
        ax.errorbar(mid, y, xerr=[[mid - low], [high - mid]], fmt="o", color=color, capsize=4,
                    zorder=4)
        if e.comparison.kind == "not_worse":
            ax.plot([100 * e.comparison.margin] * 2, [y - 0.4, y + 0.4], color="tab:orange",
                    linestyle="--")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(effects)),
                  [f"{e.comparison.describe()}\n"
                   f"{len(e.fit.blocks) if e.fit else 0} size(s), {e.source} seeds"
                   + (f", {_level(e.coverage)}" if e.shown else "") for e in effects],
                  fontsize=7)
    ax.set_xlabel(f"effect on test {result.metric} (%, negative: treatment better), pooled "
                  f"over sizes\nbars: {interval_label(effects)}s; dots: each size")
    _title(fig, f"({result.claim.key}) {result.claim.title}: {result.verdict}")
    _save_png(plt, fig, path)


def ladder_figure(results: list[ClaimResult], path: Path) -> bool:
    """Each arm's test metric (mean ± std over seeds, at its chosen LR) against the tokens per
    trial of its spec (log x), one line per (variant, dataset, size) over ``results``, the
    claims of a token ladder; written as a PNG. False (nothing written) without two budgets."""
    from orchestrator.planning.plan import plan

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
        summary(results),
        "",
        "Protocol: per variant and size the learning rate is chosen once, among the learning "
        "rates its bracket trained, on the tuning seeds' mean log validation metric; the test "
        "metric is that of models trained at that learning rate on fresh evaluation seeds "
        "(the tuning seeds' own models where a spec names none or they have not run: said "
        "per claim); nothing is interpolated. Each comparison is one regression of log test "
        "metric on arm and size with an arm x log N trend, pooled over sizes (per-size rows "
        "are detail); its effect is the log ratio at the sizes' geometric-mean N, shown as a "
        "relative change, with a Student-t interval on the residual degrees of freedom at the "
        f"comparison's Holm level (family-wise {verdicts.ALPHA:.0%} over the claim's "
        "comparisons, an equality's TOST among them). Verdicts: supports / contradicts when "
        "the interval clears the claim's threshold (0, or its not-worse margin) on one side; "
        "equivalent when the TOST interval lies inside the claim's equivalence margin and "
        "that margin is at least the design's minimum detectable effect (MDE, 80 % power at "
        "the comparison's level); underpowered otherwise. A claim takes the verdict its "
        "decided comparisons share, mixed when they differ, underpowered when none is "
        "decided. Columns: `per 2x N` the effect's change per doubling of parameters, "
        "`sd (resid.)` the regression's residual sd of log test, `seeds for margin` the seeds "
        "per arm and size whose MDE reaches the margin (the formulas: "
        "`docs/statistics.md`).",
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
                  *[f"- {line}." for line in source_lines(r)],
                  *[f"- Incomplete: {line}." for line in r.incomplete],
                  *[f"- Diverged: {line}." for line in r.diverged],
                  *[f"- At a grid edge: {line}." for line in r.at_edge],
                  *[f"- {line}." for line in r.notes], ""]
        if not r.effects:
            lines += [f"No finished trials yet: `cemlab run "
                      f"{directory.rstrip('/')}/{r.spec.name}.yaml`.", ""]
            continue
        lines += ["```", format_table([_effect_row(r, e) for e in r.effects]), "",
                  "per size (detail, not a verdict):", format_table(detail_rows(r)), "",
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
