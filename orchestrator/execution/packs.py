"""The trials of a submission in packs: a ``Task`` per pending trial, and ``Pack`` s of
same-shaped tasks that one Ray Train worker group trains in turn (``packs``), those that differ
only in learning rate and seed several at once, as one stacked model
(``orchestrator.planning.stacks``).

Plain data, light to import: Ray Train ships a run's ``RunConfig``, its callbacks and so the
pack they hold, to the run's controller and to every one of its workers, each of which imports
this module to unpickle it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.planning.stacks import form_stacks
from workloads.core.storage import StorageRoot
from workloads.core.trial import Job, Trial
from workloads.core.workload import Workload

TRIALS_DIR = ("ray_results", "trials")  # Ray Train runs under the storage root, by experiment


@dataclass(frozen=True)
class Task:
    """One pending trial of experiment ``experiment``: its ``Job``, the ``Workload`` that
    trains it, its ledger row, where the ledger is, the storage root its checkpoints go to (the
    same trial in two experiments keeps two runs: each resumes only its own), and the lease it
    is trained under (``owner``, renewed for ``lease_s`` seconds); when its submission started
    (``submitted_at``) and handed it to Ray Tune (``queued_at``), UNIX seconds."""

    job: Job
    workload: Workload
    experiment: str
    row_id: int
    ledger_url: str
    storage: StorageRoot
    owner: str
    lease_s: float
    submitted_at: float | None = None
    queued_at: float | None = None

    @property
    def trial_id(self) -> str:
        return self.job.trial.trial_id

    @property
    def label(self) -> str:
        return self.job.trial.label


@dataclass(frozen=True)
class Pack:
    """Same-shaped trials that one Ray Train run trains in turn, in this order; ``sizes``:
    the sizes of the consecutive runs of them that train at once as one stacked model
    (``orchestrator.planning.stacks``; empty: each alone).

    Raises:
        ValueError: ``sizes`` do not add up to the trials.
    """

    tasks: tuple[Task, ...]
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.sizes and (sum(self.sizes) != len(self.tasks) or min(self.sizes) < 1):
            raise ValueError(f"stack sizes {self.sizes} do not split {len(self.tasks)} trials")

    @classmethod
    def of(cls, stacks: list[tuple[Task, ...]]) -> Pack:
        """The pack that trains ``stacks`` in turn, each as one stacked model."""
        sizes = tuple(len(s) for s in stacks)
        return cls(tuple(t for s in stacks for t in s), sizes if max(sizes, default=1) > 1
                   else ())

    @property
    def stacks(self) -> list[tuple[Task, ...]]:
        """The trials in the groups that train at once, in order (one trial each, unstacked)."""
        out, start = [], 0
        for size in self.sizes or (1,) * len(self.tasks):
            out.append(self.tasks[start:start + size])
            start += size
        return out

    @property
    def largest_stack(self) -> int:
        return max(self.sizes, default=1)

    def where(self, keep: Callable[[Task], bool]) -> Pack:
        """This pack with only the trials that ``keep``, each stack keeping its order."""
        return Pack.of([kept for s in self.stacks if (kept := tuple(t for t in s if keep(t)))])

    @property
    def name(self) -> str:
        """``trial-<id>`` for one trial, else ``pack-<hash of the trial ids>``."""
        if len(self.tasks) == 1:
            return f"trial-{self.tasks[0].trial_id}"
        ids = ",".join(t.trial_id for t in self.tasks)
        return f"pack-{hashlib.sha256(ids.encode()).hexdigest()[:12]}"

    @property
    def label(self) -> str:
        first = self.tasks[0].label
        return first if len(self.tasks) == 1 else f"{first} +{len(self.tasks) - 1}"

    def uri(self, *parts: str) -> str:
        """URI of ``parts`` under this pack's Ray Train run directory."""
        head = self.tasks[0]
        return head.storage.uri_of(*TRIALS_DIR, head.experiment, self.name, *parts)

    def stack_of(self, task: Task) -> tuple[Task, ...]:
        """The stack ``task`` trains in."""
        return next(s for s in self.stacks if task in s)

    def after(self, task: Task) -> Pack:
        """The pack of the stacks after the one ``task`` trains in."""
        stacks = self.stacks
        return Pack.of(stacks[stacks.index(self.stack_of(task)) + 1:])


def shape(trial: Trial) -> tuple:
    """What a worker group is kept for: the trial's workers and their resources, and on GPUs
    its model too (the compiled model's cache stays warm for the next trial)."""
    r = trial.resources
    return (r.model_dump_json(), trial.model if r.use_gpu else None)


def packs(tasks: list[Task], concurrency: int) -> list[Pack]:
    """``tasks`` in packs: by ``shape``, each shape's trials in stacks (``form_stacks``: one
    trial each where they do not stack), the stacks in as many packs as run at once
    (``concurrency``), dealt largest first (budget FLOPs) to the pack with the fewest FLOPs so
    far, then each pack in the grid's order; a pack per stack where the trials'
    ``resources.reuse_workers`` is off."""
    order = {t.trial_id: i for i, t in enumerate(tasks)}
    groups: dict[tuple, list[Task]] = {}
    for t in tasks:
        groups.setdefault(shape(t.job.trial), []).append(t)
    out = []
    for group in groups.values():
        stacks = form_stacks(group, lambda t: t.job.trial, group[0].workload, concurrency)
        if not group[0].job.trial.resources.reuse_workers:
            out += [Pack.of([s]) for s in stacks]
            continue
        bins: list[tuple[float, list[tuple[Task, ...]]]] = [
            (0.0, []) for _ in range(min(concurrency, len(stacks)))]
        for s in sorted(stacks, key=lambda s: -sum(t.job.trial.budget.flops for t in s)):
            i = min(range(len(bins)), key=lambda i: bins[i][0])
            bins[i] = (bins[i][0] + sum(t.job.trial.budget.flops for t in s), bins[i][1] + [s])
        out += [Pack.of(sorted(b, key=lambda s: order[s[0].trial_id])) for _, b in bins]
    return sorted(out, key=lambda p: order[p.tasks[0].trial_id])
