"""Where a train loop's side effects go: ranks, engines, checkpoints, metrics.

The same train loop runs in two sessions:

- ``RaySession``: one Ray Train worker of a trial, the trial at some position of the pack its
  worker group trains in turn (``workloads.core.pack``). Checkpoints go through
  ``ray.train.report`` (every rank writes its part and its sha256 manifest into a temporary
  directory that Ray persists, named after the trial and step), and a restarted or resubmitted
  trial resumes from the newest of its own that verifies, in its run or a run that trained it
  before (``workloads.runtime.checkpoints``); metrics go to the trial's MLflow run from rank 0,
  and the run's ``ray.nodes`` tag lists each rank's ``<Ray node id>@<node IP>``.
- ``LocalSession``: one process, no Ray, no MLflow (``cemlab train``), a plain PyTorch
  engine; ``LocalDeepSpeedSession``: the same with DeepSpeed's engine, inside a
  ``one_rank_process_group``. Nothing is checkpointed; metrics are kept in ``history`` and the
  loop's log lines are printed.

``ray`` is imported inside ``RaySession`` only, ``deepspeed`` inside ``DeepSpeedEngine``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from workloads.core import logged_model, pack
from workloads.core.precision import resolve_precision
from workloads.core.reach import check_tracking
from workloads.core.trial import Job
from workloads.runtime import allocator, hardware
from workloads.runtime.checkpoints import newest_good, problem, write_manifest
from workloads.runtime.engine import DeepSpeedEngine, Engine, Optimizer, Scheduler, TorchEngine
from workloads.runtime.environ import environ
from workloads.runtime.metrics import MetricSink
from workloads.runtime.timing import PhaseClock

Backend = Literal["deepspeed", "ddp"]  # how a workload wants its replicas kept in step

log = logging.getLogger("cemlab.train")


class Session(ABC):
    """Rank ``rank`` of ``world_size`` running ``job``."""

    rank: int
    world_size: int

    def __init__(self, job: Job) -> None:
        self.job = job
        allocator.reuse_freed_memory()  # a step reuses the pages of the step before
        self.clock = PhaseClock(job.submitted_at)  # time/startup_s, train_s, eval_s, ...
        self._peak_flops: float | None = None  # per worker, once looked up

    @property
    def precision(self) -> str:
        """``bf16`` or ``fp32`` (``auto`` resolved for this machine)."""
        return resolve_precision(self.job.trial.engine.precision)

    def info(self, msg: str, *args) -> None:
        """Log ``msg`` from rank 0 only."""
        if self.rank == 0:
            log.info(msg, *args)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (a no-op without a process group); returns it."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t)
        return t

    def peak_flops(self, device: torch.device) -> float:
        """Peak FLOP/s of this worker's ``device`` in the session's precision
        (``workloads.runtime.hardware.peak_flops``), looked up and logged with its source once."""
        if self._peak_flops is None:
            self._peak_flops, source = hardware.peak_flops(device, self.precision)
            self.info("[train] MFU against %.3g FLOP/s per worker (%s)", self._peak_flops, source)
        return self._peak_flops

    def efficiency(self, flops: float, device: torch.device) -> dict[str, float]:
        """``train_mfu``: ``flops`` (the model FLOPs of the steps this attempt trained, all
        workers together) per second of the clock's ``train`` phase, over the peak of all
        workers (``peak_flops_per_s``: ``peak_flops`` x ``world_size``); ``peak_memory_mib``:
        the most memory any worker has held (``workloads.runtime.hardware.peak_memory_bytes``), MiB.
        A collective: every rank calls it."""
        memory = torch.zeros(self.world_size, dtype=torch.float64, device=device)
        memory[self.rank] = hardware.peak_memory_bytes(device)
        self.all_reduce(memory)
        seconds = self.clock.seconds["train"]
        peak = self.peak_flops(device) * self.world_size
        return {"train_mfu": flops / seconds / peak if seconds > 0 else 0.0,
                "peak_flops_per_s": peak, "peak_memory_mib": memory.max().item() / 2**20}

    @abstractmethod
    def engine(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
               backend: Backend) -> Engine:
        """The engine that trains ``model`` with ``optimizer`` and ``scheduler`` for this
        session's trial (its ``engine`` section, clipping and batch geometry)."""

    def _deepspeed(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
                   ) -> DeepSpeedEngine:
        t = self.job.trial
        return DeepSpeedEngine(model, optimizer, scheduler, t.engine, self.precision,
                               t.optimizer.grad_clip, t.micro_batch_size, t.grad_accum,
                               self.world_size)

    def _torch(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
               device: torch.device, **kwargs) -> TorchEngine:
        t = self.job.trial
        return TorchEngine(model, optimizer, scheduler, device, self.precision,
                           t.optimizer.grad_clip, t.grad_accum, **kwargs)

    @abstractmethod
    def restore(self, engine: Engine, at_most: int | None = None) -> int:
        """Load the trial's last checkpoint (with ``at_most``, of a step no later) into
        ``engine``; returns its step (0: fresh)."""

    @abstractmethod
    def checkpoint(self, engine: Engine, step: int, metrics: dict[str, float]) -> None:
        """Report ``metrics`` at ``step`` with a checkpoint of ``engine`` (every rank calls)."""

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record metrics of optimizer step ``step`` (buffered until ``flush``)."""

    @abstractmethod
    def flush(self) -> None:
        """Send buffered metrics (what cannot be sent now stays buffered)."""

    @abstractmethod
    def close(self) -> None:
        """After the train loop: deliver whatever is still buffered, or raise."""

    @abstractmethod
    def keep_model(self, write: Callable[[str], None]) -> None:
        """Keep the trained model: ``write(path)`` saves it as an MLflow model in a new
        directory ``path``, which becomes the logged model of the trial's MLflow run
        (``workloads.core.logged_model``; rank 0 only calls it)."""


FINAL_FLUSH_S = 300.0  # how long a finished trial waits for an unreachable tracking server


class RaySession(Session):
    """Inside a Ray Train worker: ranks from the Train context, DeepSpeed or DDP, checkpoints
    through ``ray.train.report``, metrics to MLflow run ``job.run_id`` at ``job.tracking_uri``;
    ``position``: the trial's place (0-based) in the pack its worker group trains in turn.
    """

    def __init__(self, job: Job, position: int = 0) -> None:
        super().__init__(job)
        import ray.train

        # DeepSpeed still calls torch.distributed's deprecated all_gather_into_tensor (and, at
        # ZeRO-3, reduce_scatter_tensor): those two messages, no other FutureWarning.
        warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|"
                                r"reduce_scatter_tensor)` is deprecated", FutureWarning)
        torch.set_num_threads(job.trial.resources.cpus_per_worker)
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.position = position
        storage = ctx.get_storage()
        self._fs = storage.storage_filesystem
        self._runs = list(dict.fromkeys([storage.experiment_fs_path, *job.earlier_runs]))
        here = ray.util.get_node_ip_address()
        check_tracking(job.tracking_uri, where=here)  # before any step: one line if unreachable
        self.sink = MetricSink(job.tracking_uri, job.run_id, enabled=self.rank == 0)
        logged = self.sink.skip_logged()
        if logged:
            self.info("[train] the run has metrics up to step %d: replayed steps are not logged "
                      "again", logged)
        self.sink.tag("ray.nodes", ",".join(self._gather(
            f"{ray.get_runtime_context().get_node_id()}@{here}")))
        self.attempt = int(self._gather(str(time.time_ns() // 10**6))[0])  # rank 0's start

    def _gather(self, value: str) -> list[str]:
        """``value`` of every rank, in rank order."""
        if not (dist.is_available() and dist.is_initialized()):
            return [value]
        values: list = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def _report(self, metrics: dict, checkpoint=None, step: int = 0) -> None:
        import ray.train

        metrics = {pack.TRIAL: self.job.trial.trial_id, **metrics}
        if checkpoint is None:
            ray.train.report(metrics)
            return
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=pack.checkpoint_name(
            self.job.trial.trial_id, step, self.attempt))

    def start(self) -> None:
        """Tell the driver the trial starts, and when its clock started (every rank calls)."""
        self._report({pack.STARTED_AT: self.clock.started_at})

    def checkpoints(self) -> list:
        """This trial's checkpoints (``ray.train.Checkpoint``) in its run and in the runs that
        trained it before, newest first (by step, then attempt; this run's first at a tie), as
        rank 0 lists them: every rank then walks the same ones (a collective)."""
        import pyarrow.fs
        import ray.train

        found = []
        for order, run in enumerate(self._runs):
            infos = self._fs.get_file_info(pyarrow.fs.FileSelector(run, allow_not_found=True))
            for info in infos:
                parsed = pack.parse_name(info.base_name)
                if (info.type == pyarrow.fs.FileType.Directory and parsed
                        and parsed[0] == self.job.trial.trial_id):
                    found.append((-parsed[1], -parsed[2], order, info.path))
        paths = json.loads(self._gather(json.dumps([path for *_, path in sorted(found)]))[0])
        return [ray.train.Checkpoint(path, filesystem=self._fs) for path in paths]

    def report_if_trained(self) -> bool:
        """When this trial's newest checkpoint is its final one and verifies (its worker group
        restarted after it ended), report its final metrics again, naming that checkpoint,
        and return True: the trial is not trained twice. False otherwise (every rank calls)."""
        newest = next(iter(self.checkpoints()), None)
        metrics = None
        if newest is not None and pack.parse_name(newest.path.rsplit("/", 1)[-1])[1] \
                == self.job.trial.steps:
            with newest.as_directory() as d:
                final = Path(d) / pack.FINAL_FILE
                if problem(d) is None and final.is_file():
                    metrics = json.loads(final.read_text())
        # rank 0 decides, for every rank: the path of the final checkpoint, or null
        path = json.loads(self._gather(json.dumps(newest.path if metrics else None))[0])
        if path is None:
            return False
        self.info("[train] trained already (%s): reported again, not trained", path)
        self._report({**(metrics or {}), pack.FINAL: 1, pack.CHECKPOINT: path})
        return True

    def engine(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
               backend: Backend) -> Engine:
        if backend == "deepspeed":
            return self._deepspeed(model, optimizer, scheduler)
        import ray.train.torch

        return self._torch(model, optimizer, scheduler, ray.train.torch.get_device(),
                           wrap=ray.train.torch.prepare_model, rank=self.rank)

    def restore(self, engine: Engine, at_most: int | None = None) -> int:
        """The newest of the trial's checkpoints (of a step up to ``at_most``) that verifies
        (``checkpoints``, walked by ``checkpoints.newest_good``).

        Raises:
            RuntimeError: checkpoints exist but none verifies.
        """
        def load(directory: str) -> int:
            self.sink.add_pending(directory)  # points an outage kept from the run
            return engine.load(directory)["step"]

        candidates = [c for c in self.checkpoints() if at_most is None
                      or pack.parse_name(c.path.rsplit("/", 1)[-1])[1] <= at_most]
        found = newest_good(candidates, lambda c: c.as_directory(), load)
        if not found:
            return 0
        checkpoint, step = found
        self.info("[train] resumed from step %d (%s)", step, checkpoint.path)
        return step

    def checkpoint(self, engine: Engine, step: int, metrics: dict[str, float]) -> None:
        """Report ``metrics`` with a checkpoint of ``engine`` at ``step``; at the trial's last
        step, its final one (``pack.FINAL``, the metrics in ``pack.FINAL_FILE``)."""
        import ray.train

        final = step == self.job.trial.steps
        with tempfile.TemporaryDirectory() as d:
            engine.save(d, {"step": step})
            self.sink.write_pending(d)  # what an outage kept from MLflow survives a crash
            if final and self.rank == 0:
                (Path(d) / pack.FINAL_FILE).write_text(json.dumps(metrics))
            write_manifest(d, self.rank, self.world_size, step)
            self._report({"step": step, **metrics,
                          pack.KEEP: pack.keep_score(self.position, step, final),
                          **({pack.FINAL: 1} if final else {})},
                         ray.train.Checkpoint.from_directory(d), step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.sink.log(metrics, step)

    def flush(self) -> None:
        self.sink.flush()

    def close(self) -> None:
        """Send the points still pending, retrying for up to ``FINAL_FLUSH_S``.

        Raises:
            RuntimeError: the tracking server stayed unreachable; the points are in the last
                checkpoint, and a restart of the trial sends them.
        """
        if not self.sink.flush(deadline_s=FINAL_FLUSH_S):
            raise RuntimeError(f"MLflow at {self.job.tracking_uri} unreachable for "
                               f"{FINAL_FLUSH_S:.0f} s: {self.sink.pending} metric point(s) not "
                               "sent (kept in the last checkpoint)")

    def keep_model(self, write: Callable[[str], None]) -> None:
        """Upload the model once the tracking server answers: ``close`` first sends the pending
        points, probing the server every few seconds for up to ``FINAL_FLUSH_S``, so that an
        outage is waited out there and not inside MLflow's own retries, whose exponential
        backoff (64 s between the last tries) kept a finished trial a minute past the
        server's return.

        The model becomes a logged model of run ``job.run_id``, its output at the trial's last
        step (``logged_model.log_model``): through the tracking server, with no other service.

        Raises:
            RuntimeError: the tracking server stayed unreachable (``close``).
            mlflow.exceptions.MlflowException: the server refused the model or went away while
                it was uploaded (the logged model is ``FAILED`` where it was created).
        """
        if self.job.run_id:
            self.close()
            from mlflow import MlflowClient

            logged_model.log_model(MlflowClient(self.job.tracking_uri), self.job.run_id, write,
                                   step=self.job.trial.steps)


class LocalSession(Session):
    """One process on this machine's GPU or CPU: a plain PyTorch engine, no checkpoints, metrics
    kept in ``history`` (``{name: {step: value}}``)."""

    rank, world_size = 0, 1

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.history: dict[str, dict[int, float]] = {}
        self.made: Engine | None = None  # the engine ``engine`` built last (its name, for reports)

    def engine(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
               backend: Backend) -> Engine:
        self.made = self._build(model, optimizer, scheduler, backend)
        return self.made

    def _build(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
               backend: Backend) -> Engine:
        return self._torch(model, optimizer, scheduler, self.device)

    def restore(self, engine: Engine, at_most: int | None = None) -> int:
        return 0

    def checkpoint(self, engine: Engine, step: int, metrics: dict[str, float]) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.history.setdefault(k, {})[step] = float(v)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass  # history is in memory: nothing is pending

    def keep_model(self, write: Callable[[str], None]) -> None:
        pass  # in-process runs keep no model: nothing here tracks it


class LocalDeepSpeedSession(LocalSession):
    """A ``LocalSession`` whose engine is DeepSpeed's (ZeRO ``engine.zero_stage``, compiled as
    ``engine.compile`` says) on this one rank, as a Ray worker of a one-worker trial runs it,
    for a workload that asks for the ``deepspeed`` backend (the others get the plain engine, as
    ``RaySession`` gives them DDP): use it inside ``one_rank_process_group``."""

    def _build(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
               backend: Backend) -> Engine:
        if backend != "deepspeed":
            return super()._build(model, optimizer, scheduler, backend)
        return self._deepspeed(model, optimizer, scheduler)


@contextmanager
def one_rank_process_group() -> Iterator[None]:
    """A torch.distributed process group of this process alone (rank 0 of 1) for the block,
    destroyed after it: NCCL on a GPU (device 0), gloo on a CPU, where DeepSpeed is told to use
    its CPU accelerator (``DS_ACCELERATOR=cpu``, unless set) as ``run_in_ray`` does. Sets the
    launcher variables DeepSpeed reads (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) for the block, and puts back what they were.

    Raises:
        RuntimeError: a process group is already initialised.
    """
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised")
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # Any free port on 127.0.0.1 serves: the group's one rank is this process, so nothing on
    # another host has to reach the store (a port taken between here and the bind fails loudly).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}
    with environ(launcher):
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                                **({"device_id": torch.device("cuda", 0)} if cuda else {}))
        try:
            yield
        finally:
            dist.destroy_process_group()

