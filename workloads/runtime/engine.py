"""Training engines behind one interface: a DeepSpeed ZeRO engine (Ray Train workers of a language
model) and a plain PyTorch engine (in-process runs, and DDP replicas under Ray Train).

Both drive an optimizer and its LR schedule built by the caller (``runtime.optim``, from the
``optimizer`` and ``schedule`` sections) and take micro-batches: ``engine(x)`` forward
(``engine(x, y)`` where the model scores targets ``y`` itself), ``engine.backward(loss)`` (the
loss of one micro-batch; gradients are averaged over ``grad_accum`` micro-batches),
``engine.step()`` after every micro-batch (the optimizer steps, with gradient clipping and the
LR schedule, at every ``grad_accum``-th call), ``engine.lr()`` the learning rate the next
optimizer step uses. They are built from the ``engine`` section.
"""

from __future__ import annotations

import copy
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from workloads.core.config import EngineConfig
from workloads.runtime.optim import deepspeed_config

Optimizer = torch.optim.Optimizer
Scheduler = torch.optim.lr_scheduler.LRScheduler

_DS_TAG = "ckpt"  # DeepSpeed checkpoint tag inside every checkpoint directory
_TORCH_STATE = "engine_state.pt"


class Engine(ABC):
    """A model with its optimizer and schedule. ``module`` is what runs forward; ``device`` where
    its inputs go."""

    module: nn.Module
    device: torch.device
    name: str  # for logs: "torch", "DeepSpeed ZeRO-2"
    compiled = False  # whether ``module``'s forward runs through torch.compile

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.module(*inputs)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def step(self) -> None: ...

    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def save(self, directory: str, client_state: dict[str, Any]) -> None:
        """Write this rank's part of a checkpoint into ``directory`` (every rank calls it)."""

    @abstractmethod
    def load(self, directory: str) -> dict[str, Any]:
        """Restore from a checkpoint directory; returns the ``client_state`` saved with it."""

    @abstractmethod
    def full_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        """A plain replica of the model with all its weights (same dtype and device), free of
        engine hooks and process groups; ``build`` makes an empty model of the same
        architecture. Every rank must call it."""


class TorchEngine(Engine):
    """``optimizer`` and ``scheduler`` stepped with gradient clipping at ``grad_clip`` (global
    norm) in plain PyTorch, every ``grad_accum`` micro-batches. ``wrap`` (e.g. Ray Train's
    ``prepare_model``, which adds DDP) turns the model into the module that runs forward;
    ``rank`` 0 alone writes checkpoints (the replicas are identical). ``precision="bf16"`` runs
    the forward under ``torch.autocast`` with fp32 weights. It never compiles (``compiled``
    stays False): ``engine.compile`` is DeepSpeed's."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
                 device: torch.device, precision: str, grad_clip: float, grad_accum: int,
                 wrap: Callable[[nn.Module], nn.Module] | None = None, rank: int = 0) -> None:
        self.model = model.to(device)
        self.module = wrap(self.model) if wrap else self.model
        self.name = "torch DDP" if wrap else "torch"
        self.device, self.precision, self.rank = device, precision, rank
        self.grad_accum, self.grad_clip = grad_accum, grad_clip
        self.optimizer, self.scheduler = optimizer, scheduler
        self._micro_steps = 0

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.precision == "bf16"):
            return self.module(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        self._micro_steps += 1
        if self._micro_steps % self.grad_accum:
            return
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def save(self, directory: str, client_state: dict[str, Any]) -> None:
        if self.rank == 0:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "client_state": client_state},
                       os.path.join(directory, _TORCH_STATE))

    def load(self, directory: str) -> dict[str, Any]:
        state = torch.load(os.path.join(directory, _TORCH_STATE), map_location=self.device,
                           weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["client_state"]

    def full_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        return copy.deepcopy(self.model)


def use_interpreter_tools() -> None:
    """Put this interpreter's ``bin`` directory first on ``PATH``, and keep torch's extension
    cache in its environment (``<sys.prefix>/torch_extensions``) where that is writable and
    ``TORCH_EXTENSIONS_DIR`` is not set.

    DeepSpeed JIT-builds its CPU ops (the shared-memory comm op) with whichever ``ninja`` is
    first on ``PATH``: the environment's own (a DeepSpeed dependency) where it is activated, as
    on the Ray workers ``up.sh`` starts, and a system one elsewhere (``make test``). Two ninja
    versions do not read each other's build log, so every switch rebuilt the op (20-30 s of a
    trial's startup). The interpreter's own tools are the same everywhere it runs. The cache
    torch shares by default (``~/.cache/torch_extensions``) was rebuilt the same way by every
    switch between two checkouts' environments on one machine (21 s of a demo's first trial).
    """
    here = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != here:
        os.environ["PATH"] = here + os.pathsep + path
    if os.access(sys.prefix, os.W_OK):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


def import_deepspeed() -> ModuleType:
    """``import deepspeed``, in a process that has not imported MLflow, without the MLflow import
    its autotuner makes whenever MLflow is installed: 1.2-1.5 of the 1.4-1.7 core-seconds the
    import takes next to torch and Ray Train, in every process that trains with DeepSpeed but
    logs nothing (a Ray Train worker of rank > 0, ``cemlab train --engine deepspeed``). No trial
    runs DeepSpeed's autotuner; a process that logs imports MLflow itself, before or after."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed
        return deepspeed
    sys.modules["mlflow"] = None  # its `import mlflow` raises ImportError meanwhile
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


def build_cpu_comm_op() -> Any:
    """Build DeepSpeed's CPU shared-memory comm op into torch's extension cache (or load it from
    there), as the first DeepSpeed trial on a CPU machine otherwise does inside its startup
    (about 40 s on 2 cores). ``make setup`` calls it once per machine; every later trial, on
    any interpreter of this environment, loads the built op (``use_interpreter_tools``).
    Returns the loaded op module, or None where DeepSpeed finds it incompatible.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    use_interpreter_tools()
    import_deepspeed()
    from deepspeed.comm.torch import build_shm_op

    return build_shm_op()


def load_weights_only(path: str, map_location: Any = None) -> Any:
    """``torch.load`` of a DeepSpeed checkpoint file without unpickling code: tensors, containers
    and the three plain DeepSpeed types its ZeRO states hold (a loss scaler, the ZeRO stage enum
    and a fragment address), ZeRO 0 to 3, fp32 and bf16.

    Raises:
        pickle.UnpicklingError: the file holds anything else (it is not loaded).
    """
    import_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location=map_location, weights_only=True)


def compiles(setting: bool | str, device: torch.device, zero_stage: int) -> bool:
    """Whether a trial's engine runs its model through ``torch.compile`` (``engine.compile``):
    as set, and for ``auto`` on a GPU at ZeRO stage 0-2: a cold compile takes seconds to
    minutes per model, which a GPU trial's hours of faster steps repay and a short CPU trial's
    steps do not (docs/benchmarks.md). ZeRO-3 is left out: it gathers each layer's parameters in
    module hooks, and compiling through them is DeepSpeed's separate DeepCompile path."""
    if setting == "auto":
        return device.type == "cuda" and zero_stage < 3
    return bool(setting)


class DeepSpeedEngine(Engine):
    """A DeepSpeed engine (ZeRO ``engine.zero_stage``, bf16 or fp32 ``precision``, clipping at
    ``grad_clip``) over ``world_size`` ranks of an initialised process group, stepping the
    client ``optimizer`` (torch's AdamW, Table 2) and ``scheduler`` every ``grad_accum``
    micro-batches of ``micro_batch_size``. Compiled (``compiles``, ``engine.compile``) with
    DeepSpeed's ``engine.compile``: the module's forward in place, so its parameter names, and
    so its checkpoints, stay the same."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, scheduler: Scheduler,
                 engine: EngineConfig, precision: str, grad_clip: float, micro_batch_size: int,
                 grad_accum: int, world_size: int) -> None:
        use_interpreter_tools()
        deepspeed = import_deepspeed()
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(micro_batch_size, grad_accum, world_size, engine.zero_stage,
                                    precision, grad_clip, engine.deepspeed))
        # DeepSpeed's own checkpoint engine unpickles (torch.load(weights_only=False)): restore
        # through a weights-only load instead, nothing but tensors and DeepSpeed's plain types.
        self.engine.checkpoint_engine.load = load_weights_only
        self.module, self.device = self.engine, self.engine.device
        self.zero_stage = engine.zero_stage
        self.name = f"DeepSpeed ZeRO-{engine.zero_stage}"
        if compiles(engine.compile, self.device, engine.zero_stage):
            self.engine.compile(compile_kwargs={"dynamic": False})  # in place: same parameters
            self.compiled, self.name = True, self.name + ", compiled"

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def save(self, directory: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(directory, tag=_DS_TAG, client_state=client_state)

    def load(self, directory: str) -> dict[str, Any]:
        return self.engine.load_checkpoint(directory, tag=_DS_TAG)[1]

    def full_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        import deepspeed

        params = list(self.engine.module.parameters())
        model = build().to(self.device, params[0].dtype)
        with deepspeed.zero.GatheredParameters(params, enabled=self.zero_stage == 3):
            model.load_state_dict({n: p.detach()
                                   for n, p in self.engine.module.named_parameters()},
                                  strict=False)
        return model
