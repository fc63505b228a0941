"""How the submission packs trials into worker groups, how a pack names and scores its
checkpoints, and what it records of a failed driver: the exception it raised, read from Tune's
error.txt (the shape below is that of a real one, from the end-to-end failed-trial test,
shortened)."""

import pickle
import subprocess
import sys

import pytest

from orchestrator.execution.launch import failure_text
from orchestrator.execution.packs import Pack, Task, packs
from orchestrator.execution.settle import SettleTrials
from orchestrator.planning.plan import plan
from orchestrator.planning.spec import parse_spec
from workloads.core.pack import checkpoint_name, keep_score, num_to_keep, parse_name
from workloads.core.storage import StorageRoot
from workloads.core.trial import Job

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


def _tasks(spec: dict) -> list[Task]:
    storage = StorageRoot(uri="/tmp/cemlab-packs")
    parsed = parse_spec(spec)
    return [Task(Job(t), parsed.workload_impl, "packs", i, "sqlite://", storage, "me", 60.0)
            for i, t in enumerate(plan(parsed))]


PACKED = {"name": "packs", "data": {"source": "shakespeare", "vocab_size": 512},
          "sizes": ["nano", "micro"], "variants": {"llama": {}}, "learning_rates": [1e-3, 2e-3],
          "seeds": [0, 1, 2], "budget": {"tokens": 40960},
          "resources": {"num_workers": 1, "cpus_per_worker": 1, "stack": 1}}


def test_same_shaped_trials_share_as_many_worker_groups_as_run_at_once_balanced_by_flops():
    tasks = _tasks(PACKED)
    made = packs(tasks, concurrency=3)
    assert len(made) == 3
    order = [t.trial_id for t in tasks]
    assert sorted(t.trial_id for p in made for t in p.tasks) == sorted(order)  # each once
    for p in made:  # in the grid's order within a pack
        assert [t.trial_id for t in p.tasks] == sorted((t.trial_id for t in p.tasks),
                                                       key=order.index)
        assert p.name.startswith("pack-") and len(p.name) == len("pack-") + 12
    loads = sorted(sum(t.job.trial.budget.flops for t in p.tasks) for p in made)
    largest = max(t.job.trial.budget.flops for t in tasks)
    assert loads[-1] - loads[0] <= largest  # greedy longest-first: within one trial's FLOPs
    assert len({p.name for p in made}) == 3
    assert packs(tasks, concurrency=100) == [Pack((t,)) for t in tasks]  # a group per trial
    assert packs(tasks[:1], concurrency=3)[0].name == f"trial-{tasks[0].trial_id}"


def test_reuse_workers_off_gives_every_trial_its_own_worker_group():
    spec = {**PACKED, "resources": {**PACKED["resources"], "reuse_workers": False}}
    tasks = _tasks(spec)
    assert packs(tasks, concurrency=2) == [Pack((t,)) for t in tasks]


def test_on_gpus_a_worker_group_keeps_one_model_for_its_compile_cache():
    spec = {**PACKED, "resources": {"num_workers": 1, "cpus_per_worker": 1, "use_gpu": True,
                                    "stack": 8}}  # GPU trials train alone
    tasks = _tasks(spec)
    made = packs(tasks, concurrency=1)
    assert len(made) == 2  # one per size, though one runs at a time
    assert all(len({t.job.trial.size for t in p.tasks}) == 1 for p in made)


def test_a_pack_after_a_failed_trial_holds_the_trials_behind_it():
    tasks = _tasks(PACKED)[:3]
    pack = Pack(tuple(tasks))
    assert pack.after(tasks[0]).tasks == tuple(tasks[1:])
    assert pack.after(tasks[2]).tasks == ()
    assert pack.label == f"{tasks[0].label} +2"


def test_checkpoint_names_sort_by_step_and_final_ones_outscore_the_rest():
    names = [checkpoint_name("a1b2c3d4e5f6", s, 1795779050641) for s in (5, 40, 300)]
    assert names == sorted(names)
    assert parse_name(names[1]) == ("a1b2c3d4e5f6", 40, 1795779050641)
    assert parse_name("checkpoint_2026-11-27_11-00-00.1") is None
    # a pack of 3: every final checkpoint outscores every other, and later ones score higher
    finals = [keep_score(p, 1000, True) for p in range(3)]
    others = [keep_score(p, s, False) for p in range(3) for s in (20, 40)]
    assert min(finals) > max(others) and others == sorted(others)
    assert num_to_keep(3) == 5
    assert num_to_keep(3, stack=2) == 7  # the two newest of each member of a stack of 2


# Room for 8 trials of each size whatever precision `auto` plans on this CPU (fp32 where there
# is no bf16, twice the bytes): the cap under test is resources.stack, not the memory bound.
STACKED = {**PACKED, "resources": {"num_workers": 1, "cpus_per_worker": 1,
                                   "memory_per_worker_gb": 4}}


def test_trials_that_differ_in_lr_and_seed_stack_within_the_cap_and_fill_the_slots():
    tasks = _tasks(STACKED)  # per size: 2 learning rates x 3 seeds, one shape
    order = [t.trial_id for t in tasks]

    def stacks_of(made: list[Pack]) -> list[tuple[Task, ...]]:
        return [s for p in made for s in p.stacks]

    one_slot = stacks_of(packs(tasks, concurrency=1))
    assert [len(s) for s in one_slot] == [6, 6]  # one stack per size (default cap 8)
    three = stacks_of(packs(tasks, concurrency=3))  # a stack split so that no slot idles
    assert sorted(len(s) for s in three) == [3, 3, 6]
    for stack in three:
        assert len({(t.job.trial.size, t.job.trial.variant) for t in stack}) == 1
        ids = [order.index(t.trial_id) for t in stack]
        assert ids == list(range(ids[0], ids[0] + len(ids)))  # consecutive in the grid
    capped = _tasks({**STACKED, "resources": {**STACKED["resources"], "stack": 4}})
    assert [len(s) for s in stacks_of(packs(capped, concurrency=1))] == [3, 3, 3, 3]
    assert sorted(t.trial_id for p in packs(tasks, 3) for t in p.tasks) == sorted(order)
    for alone in ({"stack": 1}, {"num_workers": 2}, {"use_gpu": True}):
        spec = {**STACKED, "resources": {**STACKED["resources"], **alone}}
        assert all(p.sizes == () for p in packs(_tasks(spec), concurrency=2)), alone


def test_a_stack_holds_no_more_trials_than_its_workers_memory_holds():
    parsed = parse_spec(STACKED)
    t = plan(parsed)[0]
    per_trial = parsed.workload_impl.memory(t.model, t.engine, t.resources, t.micro_batch_size,
                                            t.config).total
    room = 2.5 * per_trial / 2**30  # GiB: two trials' worth, not three
    tasks = _tasks({**STACKED, "sizes": ["nano"],
                    "resources": {**STACKED["resources"], "memory_per_worker_gb": room}})
    assert [len(s) for p in packs(tasks, concurrency=1) for s in p.stacks] == [2, 2, 2]


def test_a_pack_of_stacks_goes_on_after_a_failed_stack_and_keeps_its_stacks_when_filtered():
    tasks = _tasks(STACKED)[:5]
    pack = Pack(tuple(tasks), (2, 3))
    assert pack.stacks == [tuple(tasks[:2]), tuple(tasks[2:])]
    assert pack.after(tasks[1]).stacks == [tuple(tasks[2:])]  # the failed trial's whole stack
    assert pack.after(tasks[0]).tasks == tuple(tasks[2:])
    assert pack.after(tasks[4]).tasks == ()
    kept = pack.where(lambda t: t is not tasks[3])
    assert kept.stacks == [tuple(tasks[:2]), (tasks[2], tasks[4])]
    assert pack.where(lambda t: t in tasks[:1] + tasks[2:3]).sizes == ()  # all alone now
    with pytest.raises(ValueError, match="do not split"):
        Pack(tuple(tasks), (2, 2))


def test_a_worker_unpickles_the_pack_callback_without_importing_mlflow_or_the_ledger():
    """Ray Train sends a run's callbacks, and so the pack's ``SettleTrials``, to every worker;
    unpickling it there must not import MLflow or SQLAlchemy (seconds of a core each, before
    the worker's first step), which only the controller uses."""
    heavy = ("mlflow", "sqlalchemy", "orchestrator.records.ledger", "orchestrator.records.tracking")
    code = ("import pickle, sys; settle = pickle.loads(sys.stdin.buffer.read()); "
            f"print(len(settle.tasks), *(m for m in {heavy!r} if m in sys.modules))")
    callback = SettleTrials(Pack(tuple(_tasks(PACKED))))
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(callback),
                         capture_output=True, check=True).stdout.decode().split()
    assert out == [str(len(callback.tasks))]
