"""``workloads.runtime.hardware``: the peak FLOP/s MFU divides by, and a process's peak memory."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from workloads.runtime import hardware


@pytest.mark.parametrize(("name", "precision", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0),  # the specific entry before the generic one
    ("NVIDIA H200", "fp32", 67.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
])
def test_known_gpus_take_their_datasheet_peak(name, precision, tflops):
    flops, source = hardware.table_peak(name, precision)
    assert flops == tflops * 1e12 and source.startswith("table: ")


def test_an_unknown_gpu_is_not_guessed():
    assert hardware.table_peak("Tesla T4", "bf16") is None


def test_the_cpu_peak_is_a_matmul_rate_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flops, source = hardware.peak_flops("cpu", "fp32")
    assert source.startswith("measured: ") and f"{torch.get_num_threads()} thread" in source
    # Independently: one timed 512^3 matmul cannot beat the measured best by much.
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    start = time.perf_counter()
    a @ b
    assert 2 * 512**3 / (time.perf_counter() - start) < 2 * flops
    cache = tmp_path / "cemlab" / "peak_flops.json"
    (key,) = json.loads(cache.read_text())
    assert json.loads(cache.read_text())[key] == flops
    cache.write_text(json.dumps({key: 123.0}))  # read back, not measured again
    assert hardware.peak_flops("cpu", "fp32") == (123.0, source)
    # Measured again on demand, the higher of the two stays: here the new measurement.
    again, _ = hardware.peak_flops("cpu", "fp32", remeasure=True)
    assert again > 1e6 and json.loads(cache.read_text())[key] == again
    cache.write_text(json.dumps({key: 1e18}))  # a peak no CPU here beats stays
    assert hardware.peak_flops("cpu", "fp32", remeasure=True) == (1e18, source)
    with pytest.raises(KeyError):
        hardware.peak_flops("cpu", "fp16")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_small_product_runs_faster_than_the_peak(precision):
    """MFU divides by the peak, so the small products training does must not beat it: bf16
    emulated on an AVX2 CPU ran a 128 matmul 3x faster than the 1024 one the peak was. The peak
    and the small products are measured in turns, in this process, so that another job on the
    same cores slows both alike, and each keeps its best over the same turns. One thread, as a
    trial of one CPU a worker runs: a two-thread product waits on its preempted thread whenever
    another process takes a core, which a small product, run in one thread, never does."""
    peak, small = 0.0, dict.fromkeys((64, 256), 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(2):
            peak = max(peak, hardware.measure_matmul_flops(precision, repeats=3, min_seconds=0.02,
                                                           max_seconds=0.3))
            for n in small:
                small[n] = max(small[n], hardware.measure_matmul_flops(
                    precision, sizes=(n,), repeats=3, min_seconds=0.02, max_seconds=0.3))
    finally:
        torch.set_num_threads(threads)
    for n, flops in small.items():
        assert flops < 2 * peak, (n, flops, peak)


def test_processes_that_ask_at_once_share_one_measured_peak(tmp_path):
    """A trial's ranks ask together: one measures, the others read its number (two independent
    measurements never agree to the last bit), so every trial divides by the same peak."""
    code = ("import torch; torch.set_num_threads(1); from workloads.runtime import hardware; "
            "print(repr(hardware.peak_flops('cpu', 'fp32')[0]))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(3)]
    peaks = {float(p.communicate(timeout=120)[0]) for p in procs}
    (cached,) = json.loads((tmp_path / "cemlab" / "peak_flops.json").read_text()).values()
    assert peaks == {cached}


def test_peak_memory_follows_what_the_process_touched():
    before = hardware.peak_memory_bytes("cpu")
    with open("/proc/self/status") as f:  # the kernel's own high-water mark, independently
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    assert before == pytest.approx(hwm, rel=0.05)
    block = torch.ones(96 * 2**20 // 4 + before // 4)  # beyond the old peak by 96 MiB
    assert hardware.peak_memory_bytes("cpu") >= before + 90 * 2**20
    del block
