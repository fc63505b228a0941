"""Checkpoints through Ray Train: every rank writes its part into a temporary directory that
``ray.train.report`` persists; a resubmitted run gets the last one back.

Called only inside Ray Train workers; ``ray`` is imported there, not at module level.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def report_with_checkpoint(step: int, metrics: dict[str, float],
                           save: Callable[[str], None]) -> None:
    """``ray.train.report({"step": step, **metrics})`` with a checkpoint: ``save(directory)``
    writes this rank's part (every rank must call this); Ray merges the ranks' parts into one
    checkpoint under the run's storage path."""
    import ray.train

    with tempfile.TemporaryDirectory() as d:
        save(d)
        ray.train.report({"step": step, **metrics},
                         checkpoint=ray.train.Checkpoint.from_directory(d))


def restore_checkpoint(load: Callable[[str], T]) -> tuple[T, Any] | None:
    """``(load(directory), checkpoint)`` of the run's last reported checkpoint, or None when the
    run starts fresh (``ray.train.get_checkpoint``)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        return load(d), checkpoint
