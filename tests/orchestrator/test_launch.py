"""What the submission records of a failed trial: the exception its driver raised, read from
Tune's error.txt (the shape below is that of a real one, from the end-to-end failed-trial test,
shortened)."""

from orchestrator.launch import failure_text

TUNE_ERROR_TXT = """\
Failure # 1 (occurred at 2026-11-26_05-10-26)
\x1b[36mray::ImplicitFunc.train()\x1b[39m (pid=7156, ip=127.0.0.1, repr=trial_driver)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/ray/tune/trainable/trainable.py", line 329
    raise skipped from exception_cause(skipped)
  File "/work/main/orchestrator/launch.py", line 174, in trial_driver
    result = fit(task, job)
             ^^^^^^^^^^^^^^
ray.train.WorkerGroupError: Training failed due to worker errors:
[Rank 0 Error Snippet]:
A worker health check failed.
Worker info: Worker(
  actor=Actor(RayTrainWorker, f60be4e737af91792b62280101000000),
)
The actor died unexpectedly before finishing this task.
"""


def test_the_recorded_failure_is_the_drivers_exception_without_tunes_header_or_stack():
    text = failure_text(TUNE_ERROR_TXT)
    assert text.splitlines()[0] == "WorkerGroupError: Training failed due to worker errors:"
    assert text.endswith("The actor died unexpectedly before finishing this task.")
    assert "Failure # 1" not in text and "File " not in text  # the exception, whole
    assert "  actor=Actor(RayTrainWorker" in text


def test_a_failure_without_a_stack_is_kept_whole():
    assert failure_text("Failure # 1 (occurred at now)\nthe actor died\n") == (
        "Failure # 1 (occurred at now)\nthe actor died")
    assert failure_text("") == ""
