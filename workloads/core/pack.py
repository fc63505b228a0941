"""What a worker group that trains a pack of trials in turn tells its driver, and how it names
their checkpoints.

One Ray Train run trains a pack of same-shaped trials one after another on one worker group.
Every ``ray.train.report`` of the run names its trial (``TRIAL``). A trial's first report marks
its start (``STARTED_AT``: when its clock started, UNIX seconds); its last carries the trained
model's checkpoint and its final metrics (``FINAL``), after the model was kept. A trial found
already trained (its newest checkpoint is its final one: a restart of the worker group after
it ended) is reported again from that checkpoint's ``FINAL_FILE``, with the checkpoint's
directory in ``CHECKPOINT``, and not trained twice.

Checkpoints are named ``checkpoint_<trial id>_<step, 9 digits>_<attempt>`` so that a trial
finds its own among the pack's, newest first by step and then by attempt (the milliseconds at
which rank 0 started the trial's session: a step replayed after a restart gets a new name, as
Ray Train's checkpoint manager requires). Ray Train keeps the ``num_to_keep(n)`` best by ``KEEP``:
every trial's final checkpoint scores above every other, and the others by their order in the
run, so the pack keeps each trial's final checkpoint and the two newest others (of each
member, for the trials of a stack, which checkpoint together and score alike).
"""

from __future__ import annotations

import re

TRIAL = "cemlab/trial"
STARTED_AT = "cemlab/started_at"
FINAL = "cemlab/final"
CHECKPOINT = "cemlab/checkpoint"
KEEP = "cemlab/keep"
FINAL_FILE = "final.json"  # in a trial's final checkpoint: its final metrics

_NAME = re.compile(r"checkpoint_(?P<trial>\w+?)_(?P<step>\d{9})_(?P<attempt>\d+)")
_FINAL_SCORE = 1e15
_STEPS_PER_POSITION = 1e9  # more than any trial's steps


def checkpoint_name(trial_id: str, step: int, attempt: int) -> str:
    """The directory name of ``trial_id``'s checkpoint at optimizer step ``step``, written by
    the attempt that started at ``attempt`` (UNIX milliseconds)."""
    return f"checkpoint_{trial_id}_{step:09d}_{attempt}"


def parse_name(name: str) -> tuple[str, int, int] | None:
    """``(trial id, step, attempt)`` of a ``checkpoint_name``, or None for any other name."""
    m = _NAME.fullmatch(name)
    return (m["trial"], int(m["step"]), int(m["attempt"])) if m else None


def keep_score(position: int, step: int, final: bool) -> float:
    """The score of the checkpoint at ``step`` of the trial at ``position`` (0-based) of its
    pack (every member of a stack at the stack's first position): the final checkpoints above
    all others, then later positions and steps higher."""
    return _FINAL_SCORE + position if final else position * _STEPS_PER_POSITION + step


def num_to_keep(trials: int, stack: int = 1) -> int:
    """Checkpoints a pack of ``trials`` keeps: a final one per trial and, of the others, the
    two newest of every trial of the stack in training (largest ``stack``; the newest, and the
    one before it should the newest not verify). The members of a stack checkpoint at the same
    steps and score by the stack's position (``keep_score``)."""
    return trials + 2 * stack
