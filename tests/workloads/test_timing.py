"""The time breakdown of a trial: phases add up what they timed; the driver's total closes it."""

import time

import pytest
import torch

from workloads.timing import PhaseClock, breakdown, kernel_rows, profiler


def test_phases_add_up_their_blocks_and_startup_runs_to_the_first_step():
    started = time.time() - 2.0  # handed over two seconds ago
    clock = PhaseClock(started)
    clock.first_step()
    clock.first_step()  # only the first counts
    assert 2.0 <= clock.seconds["startup"] < 3.0
    for _ in range(3):
        with clock.phase("train"):
            time.sleep(0.02)
    with clock.phase("checkpoint"):
        time.sleep(0.01)
    assert 0.06 <= clock.seconds["train"] < 1.0 and clock.seconds["eval"] == 0
    assert 0.01 <= clock.seconds["checkpoint"] < 1.0
    with pytest.raises(KeyError, match="unknown phase 'startup'"):
        with clock.phase("startup"):
            pass
    assert set(clock.metrics()) == {"time/startup_s", "time/compile_s", "time/train_s",
                                    "time/eval_s", "time/checkpoint_s"}


def test_teardown_is_the_rest_of_the_total_and_never_negative():
    reported = {"time/startup_s": 10.0, "time/train_s": 70.0, "time/eval_s": 5.0,
                "time/checkpoint_s": 3.0, "val_loss": 1.0}
    out = breakdown(reported, started_at=1000.0, ended_at=1100.0)
    assert out["time/total_s"] == 100.0 and out["time/teardown_s"] == pytest.approx(12.0)
    assert sum(v for k, v in out.items() if k != "time/total_s") == pytest.approx(100.0)
    assert "val_loss" not in out
    assert breakdown(reported, 1000.0, 1050.0)["time/teardown_s"] == 0.0  # clocks disagree


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels need a GPU")
def test_on_a_gpu_each_kernel_is_counted_once():
    """The profiler credits a kernel's time to the kernel and to the operator that launched it
    (``aten::mm``), and Inductor's kernels have a host-side launch record of the same name:
    the rows are the kernels alone, each call once, so two steps of a 4096² fp32 product
    (milliseconds each) and a compiled elementwise kernel add up to no more than their wall."""
    x = torch.randn(4096, 4096, device="cuda")
    double_relu = torch.compile(lambda y: (2 * y).relu())
    double_relu(x)
    torch.cuda.synchronize()
    with profiler(cuda=True) as prof:
        start = time.perf_counter()
        for _ in range(2):
            double_relu(x @ x)
        torch.cuda.synchronize()
        wall_ms = 1000 * (time.perf_counter() - start)
    rows = kernel_rows([prof], cuda=True, top=None, steps=2)
    assert not [r for r in rows if r["kernel"].startswith("aten::")], rows
    assert [r["calls_per_step"] for r in rows if r["kernel"].startswith("triton_")] == [1], rows
    assert 0 < 2 * sum(r["ms_per_step"] for r in rows) <= wall_ms
