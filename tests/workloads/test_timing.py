"""The time breakdown of a trial: phases add up what they timed; the driver's total closes it."""

import time

import pytest

from workloads.timing import PhaseClock, breakdown


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
