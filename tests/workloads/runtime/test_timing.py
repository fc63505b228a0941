"""A worker's phase clock adds up what it timed; a profile counts each kernel once."""

import time

import pytest
import torch

from workloads.runtime.timing import PhaseClock, kernel_rows, profiler


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
