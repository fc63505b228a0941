"""Where a trial's wall time goes: startup, compile, train steps, evaluation, checkpoints,
teardown.

A worker's ``PhaseClock`` adds up the seconds of each phase of its train loop; the final
checkpoint reports them (``time/<phase>_s``), and the trial's driver, which knows when it handed
the trial to Ray Train and when Ray Train gave it back, adds ``time/total_s`` and
``time/teardown_s`` (``orchestrator.tracking.breakdown``). Also the profile of steps: the
longest GPU kernels (torch operators on a CPU) of a run under ``torch.profiler``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from tabulate import tabulate
from torch.autograd import DeviceType

from workloads.core.trial import PHASES


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


class ProfiledClock(PhaseClock):
    """A ``PhaseClock`` that also runs ``torch.profiler`` over ``steps`` train steps (``train``
    phases) after the first ``skip`` (warm-up: allocations, a DeepSpeed engine's first optimizer
    step), so that a whole train step is split up: the forward and backward that
    ``workloads.lm.step_bench`` times, and the rest (the optimizer step, gradient reduction, the
    loss's all-reduce and read-back, data). Each profiled step has a profiler of its own, so that
    what runs between steps (a validation) stays out. ``profile`` is then ``{"wall_ms_per_step",
    "busy_ms_per_step", "kernels"}``: the steps' wall time, the time their ``kernel_rows`` add up to
    (on a GPU, wall minus busy is the GPU left idle), and the ``top`` longest entries; None until
    the last profiled step has ended."""

    def __init__(self, started_at: float | None, top: int, skip: int = 3, steps: int = 2,
                 cuda: bool = False) -> None:
        super().__init__(started_at)
        self.top, self.skip, self.steps, self.cuda = top, skip, steps, cuda
        self.profile: dict | None = None
        self._train_steps, self._wall = 0, 0.0
        self._profiles: list[torch.profiler.profile] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        index = self._train_steps if name == "train" else -1
        self._train_steps += name == "train"
        if not self.skip <= index < self.skip + self.steps:
            with super().phase(name):
                yield
            return
        with profiler(self.cuda) as prof:
            start = time.perf_counter()
            with super().phase(name):
                yield
            if self.cuda:
                torch.cuda.synchronize()
            self._wall += time.perf_counter() - start
        self._profiles.append(prof)
        if index == self.skip + self.steps - 1:
            everything = kernel_rows(self._profiles, self.cuda, None, self.steps)
            self.profile = {"wall_ms_per_step": 1000 * self._wall / self.steps,
                            "busy_ms_per_step": sum(k["ms_per_step"] for k in everything),
                            "kernels": everything[:self.top]}


def profiler(cuda: bool) -> torch.profiler.profile:
    """A ``torch.profiler.profile`` of the CPU's operators, and with ``cuda`` the GPU's
    kernels, for ``kernel_rows``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    return torch.profiler.profile(
        activities=activities + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))


def kernel_rows(profiles: list[torch.profiler.profile], cuda: bool, top: int | None,
                steps: int) -> list[dict]:
    """Where ``steps`` steps under the finished ``profiles`` (one profiler, or one per step)
    spent their time: the ``top`` entries (all with None) by exclusive time, longest first: GPU
    kernels with ``cuda`` (the device's time; not the operators that launch them, which the
    profiler also credits with their kernels' time, nor the host-side launch records Inductor's
    kernels share their names with), torch operators otherwise (their own CPU time, without the
    operators they call). Each is ``{"kernel": name, "ms_per_step", "calls_per_step",
    "share"}``, ``share`` its part of all the entries' time."""
    totals: dict[str, list[float]] = {}
    for prof in profiles:
        for e in prof.key_averages():
            if cuda and e.device_type != DeviceType.CUDA:
                continue
            entry = totals.setdefault(e.key, [0.0, 0])
            entry[0] += e.self_device_time_total if cuda else e.self_cpu_time_total
            entry[1] += e.count
    events = sorted(((k, us, n) for k, (us, n) in totals.items() if us > 0),
                    key=lambda e: -e[1])
    total = sum(us for _, us, _ in events)
    return [{"kernel": name, "ms_per_step": us / steps / 1000, "calls_per_step": count / steps,
             "share": us / total} for name, us, count in events[:top]]


def format_kernels(rows: list[dict]) -> str:
    """``kernel_rows`` as a table, names cut at 100 characters, shares in percent."""
    return tabulate([{**k, "kernel": k["kernel"][:100], "share": f"{100 * k['share']:.1f} %"}
                     for k in rows], headers="keys", floatfmt=",.3f")



def timed_calls(step: Callable[[], object], seconds: float) -> list[float]:
    """The wall seconds of each call of ``step`` over about ``seconds`` (at least 3 calls)."""
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times
