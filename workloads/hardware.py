"""What a device can do and what a process used: peak FLOP/s (for MFU) and peak memory.

MFU, model FLOPs utilisation (Chowdhery et al., 2022, PaLM App. B), is the achieved FLOP/s of
the analytic ``flops_per_token`` (no recomputation counted) over the peak FLOP/s of the devices
that trained. A known GPU's peak comes from ``PEAK_TFLOPS`` (dense, no sparsity, vendor
datasheets); a CPU's, or an unknown GPU's, is measured: the best FLOP/s of a square matmul in
the training dtype on this process's threads, measured once per machine and cached in
``$XDG_CACHE_HOME/cemlab/peak_flops.json`` (default ``~/.cache``).
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
MATMUL_N, MIN_SECONDS = 1024, 0.5  # how ``peak_flops`` measures a device
# Part of the peak cache's key: a changed way of measuring measures again.
MEASURE_METHOD = f"matmul {MATMUL_N}, best over >= {MIN_SECONDS} s"


def measure_matmul_flops(precision: str, device: torch.device | str = "cpu", n: int = MATMUL_N,
                         repeats: int = 8, min_seconds: float = MIN_SECONDS) -> float:
    """The best FLOP/s of an ``n`` x ``n`` by ``n`` x ``n`` matmul (2 n^3 FLOPs) in ``precision``
    (``bf16`` or ``fp32``) on ``device``, over at least ``repeats`` timed runs and at least
    ``min_seconds`` of them (clocks ramp up, other work comes and goes) after one warm-up, with
    this process's torch threads."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device).to(DTYPES[precision])
    b = torch.randn(n, n, device=device).to(DTYPES[precision])
    best, runs, began = float("inf"), 0, time.perf_counter()
    while runs <= repeats or time.perf_counter() - began < min_seconds:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if runs:  # the first run warms up
            best = min(best, time.perf_counter() - start)
        runs += 1
    return 2 * n**3 / best


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


def peak_flops(device: torch.device | str, precision: str) -> tuple[float, str]:
    """Peak FLOP/s of one ``device`` in ``precision`` and where the number comes from.

    Returns ``(flops_per_s, source)``: ``PEAK_TFLOPS`` for a GPU it names (source ``"table:
    <name>"``), else the measured matmul peak (``measure_matmul_flops``, source ``"measured:
    <device>, <threads> thread(s)"``), cached per device name, thread count, precision, torch
    version and ``MEASURE_METHOD`` so that a machine measures once: the processes that ask at
    once (a trial's ranks) take turns, so the first measures and the others read its number,
    and every trial on the machine divides by the same peak.

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
        if isinstance(cached, dict) and isinstance(cached.get(key), float):
            return cached[key], source
        flops = measure_matmul_flops(precision, device)
        try:  # a whole file or none: written beside, then renamed over
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
                json.dump({**(cached if isinstance(cached, dict) else {}), key: flops}, f)
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
