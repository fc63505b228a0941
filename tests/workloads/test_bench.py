"""``python -m workloads.bench``: step times of every variant, with MFU against this machine."""

import pytest
import torch

from workloads import bench, hardware


def test_the_bench_reports_mfu_against_the_measured_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rows = bench.run("nano", 2, 0.05, torch.device("cpu"), "fp32")
    peak = hardware.peak_flops("cpu", "fp32")[0]
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    assert rows[0]["step_time_vs_llama"] == 1.0
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(2 * 64 / (row["step_ms"] / 1000))
        assert row["mfu"] == pytest.approx(row["gflops_per_s"] * 1e9 / peak)
        assert 0 < row["mfu"] < 1 and row["peak_memory_mib"] > 100
