"""What a device can do and what a process used: peak FLOP/s (for MFU) and peak memory.

MFU, model FLOPs utilisation (Chowdhery et al., 2022, PaLM App. B), is the achieved FLOP/s of the
analytic ``flops_per_token`` (no recomputation counted) over the peak FLOP/s of the devices that
trained. A known GPU's peak comes from ``PEAK_TFLOPS`` (dense, no sparsity, vendor datasheets); a
CPU's, or an unknown GPU's, is measured: the best FLOP/s of a square matmul in the training dtype on
this process's threads, measured once per machine and cached in
``$XDG_CACHE_HOME/cemlab/peak_flops.json`` (default ``~/.cache``); each ``workloads.lm.step_bench``
run measures again and keeps the higher.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# Dense peak TFLOP/s per GPU by dtype; the first name contained in the device's name wins, so
# the more specific names come first. fp32 is plain FP32 (TF32 off, torch's default for matmul).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},  # SXM
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
}

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # precision name: torch dtype
# How ``peak_flops`` measures a device: the best of square matmuls of these sizes, each timed
# for at least MIN_SECONDS unless one run takes longer than MAX_SECONDS.
MATMUL_SIZES, MIN_SECONDS, MAX_SECONDS = (128, 1024), 0.5, 2.0
# Part of the peak cache's key: a changed way of measuring measures again.
MEASURE_METHOD = (f"matmul {'/'.join(map(str, MATMUL_SIZES))}, best over >= {MIN_SECONDS} s "
                  f"(<= {MAX_SECONDS} s) each")


def measure_matmul_flops(precision: str, device: torch.device | str = "cpu",
                         sizes: tuple[int, ...] = MATMUL_SIZES, repeats: int = 8,
                         min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS,
                         ) -> float:
    """The best FLOP/s of an ``n`` x ``n`` by ``n`` x ``n`` matmul (2 n^3 FLOPs) in ``precision``
    (``bf16`` or ``fp32``) on ``device``, over ``n`` in ``sizes``, with this process's torch
    threads.

    Each size runs once to warm up (unless that run alone takes ``min_seconds``), then is timed
    at least ``repeats`` times and for at least ``min_seconds`` (clocks ramp up, other work
    comes and goes), stopping after ``max_seconds`` once one run is timed. Fast kernels (AMX,
    a GPU) peak at the large size. bf16 emulated on a CPU without bf16 instructions (AVX2) runs
    1 GFLOP/s at 1024, 2 s a run (ten runs were 20 s of a trial's startup), and 3 GFLOP/s at
    128, in cache, as training's small products do: against 1024 alone its MFU read 200 %.

    Raises:
        KeyError: ``precision`` is neither ``bf16`` nor ``fp32``.
    """
    device = torch.device(device)
    return max(_matmul_flops(DTYPES[precision], device, n, repeats, min_seconds, max_seconds)
               for n in sizes)


def _matmul_flops(dtype: torch.dtype, device: torch.device, n: int, repeats: int,
                  min_seconds: float, max_seconds: float) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best, timed, warm, began = float("inf"), 0, False, time.perf_counter()
    while True:
        elapsed = time.perf_counter() - began
        if timed and elapsed >= min_seconds and (timed >= repeats or elapsed >= max_seconds):
            return 2 * n**3 / best
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - start
        if warm or took >= min_seconds:  # the first run warms up, unless it is this long
            best, timed = min(best, took), timed + 1
        warm = True


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "cemlab" / "peak_flops.json"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or the CPU's model name."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()


def table_peak(gpu_name: str, precision: str) -> tuple[float, str] | None:
    """``(FLOP/s, "table: <entry> <precision>")`` of the first ``PEAK_TFLOPS`` entry contained in
    ``gpu_name`` (``torch.cuda.get_device_name``), or None for a GPU the table lacks."""
    for known, peaks in PEAK_TFLOPS.items():
        if known in gpu_name:
            return peaks[precision] * 1e12, f"table: {known} {precision}"
    return None


def peak_flops(device: torch.device | str, precision: str, remeasure: bool = False,
               ) -> tuple[float, str]:
    """Peak FLOP/s of one ``device`` in ``precision`` and where the number comes from.

    Returns ``(flops_per_s, source)``: ``PEAK_TFLOPS`` for a GPU it names (source ``"table:
    <name>"``), else the measured matmul peak (``measure_matmul_flops``, source ``"measured:
    <device>, <threads> thread(s)"``), cached per device name, thread count, precision, torch
    version and ``MEASURE_METHOD`` so that a machine measures once: the processes that ask at
    once (a trial's ranks) take turns, so the first measures and the others read its number,
    and every trial on the machine divides by the same peak. With ``remeasure`` (the bench
    does) it measures again and keeps the higher of the two: a peak is the best the device
    can do, and one measurement on a shared machine can land in a slow second, which would put
    a later, faster step above 100 % MFU.

    Raises:
        KeyError: ``precision`` is neither ``bf16`` nor ``fp32``.
    """
    device = torch.device(device)
    DTYPES[precision]  # noqa: B018 - the KeyError for an unknown precision
    name = device_name(device)
    known = table_peak(name, precision) if device.type == "cuda" else None
    if known:
        return known
    threads = torch.get_num_threads()
    key = (f"{name}|{device.type}|threads={threads}|{precision}|torch {torch.__version__}"
           f"|{MEASURE_METHOD}")
    source = f"measured: {name}, {threads} thread(s)"
    path = _cache_path()
    with _exclusive(path.with_suffix(".lock")):  # a trial's ranks start together: one measures
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
        if not isinstance(cached, dict):
            cached = {}
        before = cached.get(key) if isinstance(cached.get(key), float) else None
        if before is not None and not remeasure:
            return before, source
        flops = max(measure_matmul_flops(precision, device), before or 0.0)
        try:  # a whole file or none: written beside, then renamed over
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
                json.dump({**cached, key: flops}, f)
            os.replace(f.name, path)
        except OSError:
            pass  # a read-only home: measured again next time
    return flops, source


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (created if missing) for the block, so that the
    processes of one machine take turns; without a writable directory, no lock."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    if fd is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def peak_memory_bytes(device: torch.device | str) -> int:
    """The most memory this process has held: on a GPU the peak of torch's allocator on
    ``device`` (``torch.cuda.max_memory_allocated``), on a CPU the process's peak resident set
    (``getrusage``: the interpreter and its libraries included)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
