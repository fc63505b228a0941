"""Where a trial's wall time goes: startup, compile, train steps, evaluation, checkpoints,
teardown.

A worker's ``PhaseClock`` adds up the seconds of each phase of its train loop; the final
checkpoint reports them (``time/<phase>_s``), and the trial's driver, which knows when it handed
the trial to Ray Train and when Ray Train gave it back, adds ``time/total_s`` and
``time/teardown_s`` (``breakdown``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("startup", "compile", "train", "eval", "checkpoint")


class PhaseClock:
    """Seconds per phase of one worker's train loop.

    ``startup``: wall (UNIX) time from ``started_at`` (when the driver handed the trial over;
    this clock's creation when None) to the first train step (``first_step``); ``compile``
    (the first train step of a compiled model, which compiles it), ``train``, ``eval``,
    ``checkpoint``: the sums of the ``phase(...)`` blocks of that name.
    """

    def __init__(self, started_at: float | None = None) -> None:
        self.started_at = started_at if started_at is not None else time.time()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._started = False

    def first_step(self) -> None:
        """Mark the start of the first train step (later calls do nothing)."""
        if not self._started:
            self.seconds["startup"] = time.time() - self.started_at
            self._started = True

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall seconds of the block to phase ``name``.

        Raises:
            KeyError: not one of ``compile``, ``train``, ``eval``, ``checkpoint``.
        """
        if name not in PHASES[1:]:
            raise KeyError(f"unknown phase {name!r}; known: {', '.join(PHASES[1:])}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``{"time/<phase>_s": seconds}`` for every phase."""
        return {f"time/{k}_s": v for k, v in self.seconds.items()}


def breakdown(reported: dict[str, float], started_at: float, ended_at: float,
              ) -> dict[str, float]:
    """The worker's ``reported`` phases plus ``time/total_s`` (``ended_at - started_at``, UNIX
    seconds) and ``time/teardown_s``: the rest of the total (the final checkpoint, the model
    upload, stopping the workers), never negative."""
    parts = {f"time/{k}_s": float(reported.get(f"time/{k}_s", 0.0)) for k in PHASES}
    total = ended_at - started_at
    return {**parts, "time/teardown_s": max(0.0, total - sum(parts.values())),
            "time/total_s": total}
