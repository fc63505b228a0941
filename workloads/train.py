"""The training loop that runs in each Ray Train worker: a DeepSpeed engine on packed text.

``train_loop_per_worker(job)`` is handed to ``ray.train.torch.TorchTrainer``; ``job`` is
``TrainJob.to_dict()``. Ray and DeepSpeed are imported inside it, never at module level.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from workloads.data.corpus import PreparedCorpus
from workloads.data.packing import PackedSequences
from workloads.metrics import MetricSink
from workloads.models import ModelConfig, build_model, flops_per_token
from workloads.models.diagnostics import energy_diagnostics
from workloads.optim import (
    OptimConfig,
    build_optimizer,
    build_scheduler,
    deepspeed_config,
    resolve_precision,
)

log = logging.getLogger("cemlab.train")
_CKPT_TAG = "ckpt"  # DeepSpeed checkpoint tag inside every reported Ray Train checkpoint


def steps_for(tokens: int, batch_size: int, seq_len: int) -> int:
    """Optimizer steps of ``batch_size`` sequences of ``seq_len`` that cover ``tokens`` (ceil)."""
    return math.ceil(tokens / (batch_size * seq_len))


@dataclass(frozen=True)
class TrainJob:
    """Everything one trial's workers need, as plain data (it travels to Ray workers).

    ``tokens`` is the training budget in tokens; ``batch_size`` the global batch in sequences
    per optimizer step (``micro_batch_size * grad_accum * world_size``); ``eval_interval`` in
    optimizer steps; ``eval_sequences`` caps the periodic validation (the final test pass reads
    the whole test split).
    """

    model: dict[str, Any]
    corpus: dict[str, Any]
    optim: dict[str, Any]
    tokens: int
    batch_size: int
    micro_batch_size: int
    world_size: int
    zero_stage: int = 2
    precision: str = "auto"
    eval_interval: int = 50
    eval_sequences: int = 128
    log_interval: int = 10
    seed: int = 0
    threads_per_worker: int = 1
    energy_diagnostics: bool = False
    log_model: bool = True
    tracking_uri: str | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        per_step = self.micro_batch_size * self.world_size
        if self.batch_size % per_step:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of "
                             f"micro_batch_size x workers = {per_step}")

    @property
    def grad_accum(self) -> int:
        return self.batch_size // (self.micro_batch_size * self.world_size)

    @property
    def total_steps(self) -> int:
        """Optimizer steps that cover the token budget (rounded up)."""
        return steps_for(self.tokens, self.batch_size, self.model["context_length"])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _forever(loader: DataLoader, sampler: DistributedSampler, skip: int = 0):
    """Micro-batches of ``loader`` epoch after epoch (reshuffled per epoch), after the first
    ``skip`` of them: a resumed run sees the batches it would have seen uninterrupted."""
    epoch, skip_in_epoch = divmod(skip, len(loader))
    while True:
        sampler.set_epoch(epoch)
        yield from itertools.islice(loader, skip_in_epoch, None)
        skip_in_epoch = 0
        epoch += 1


@torch.no_grad()
def sequence_nll(model, dataset: PackedSequences, indices, batch_size: int,
                 device: torch.device) -> tuple[float, int]:
    """Summed next-token NLL (nats, float64) and token count of ``model`` over the sequences
    ``indices`` of ``dataset``, ``batch_size`` at a time. Index -1 is padding: it runs (so that
    every rank runs the same passes) but is not counted."""
    indices = list(indices)
    nll_sum, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for start in range(0, len(indices), batch_size):
        idx = indices[start:start + batch_size]
        xs, ys = zip(*(dataset[max(i, 0)] for i in idx))
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        keep = torch.tensor([i >= 0 for i in idx], device=device)
        logits = model(x)  # (B, T, vocab)
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        nll = nll.view_as(y)[keep]
        nll_sum += nll.sum().double()
        count += nll.numel()
    return nll_sum.item(), count


def evaluate(engine, dataset: PackedSequences, micro_batch_size: int,
             max_sequences: int | None = None) -> tuple[float, int]:
    """Summed next-token NLL (nats) and token count over ``dataset``, across all ranks.

    At most ``max_sequences`` sequences, evenly spaced through the split. Every rank runs the
    same number of forward passes (a short shard is padded with masked-out sequences), as ZeRO-3
    requires.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    n = len(dataset) if max_sequences is None else min(len(dataset), max_sequences)
    chosen = [i * len(dataset) // n for i in range(n)]
    per_rank = math.ceil(n / world)
    mine = chosen[rank::world]
    mine = mine + [-1] * (per_rank - len(mine))  # -1: padding, not counted
    engine.eval()
    nll, count = sequence_nll(engine, dataset, mine, micro_batch_size, engine.device)
    engine.train()
    totals = torch.tensor([nll, count], dtype=torch.float64, device=engine.device)
    dist.all_reduce(totals)
    return totals[0].item(), int(totals[1].item())


def full_model(engine, job: TrainJob) -> torch.nn.Module:
    """A plain replica of the engine's model (same dtype and device) with all its weights, free
    of DeepSpeed's hooks and process groups: callable sublayer by sublayer, picklable. Every
    rank must call it (with ZeRO-3 the partitioned parameters are gathered)."""
    import deepspeed

    dtype = next(engine.module.parameters()).dtype
    model = build_model(ModelConfig(**job.model)).to(engine.device, dtype)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=job.zero_stage == 3):
        model.load_state_dict({n: p.detach() for n, p in engine.module.named_parameters()},
                              strict=False)
    return model


def diagnose(engine, dataset: PackedSequences, job: TrainJob) -> dict[str, float]:
    """``energy_diagnostics`` of the model on the first validation micro-batch (every rank)."""
    x = torch.stack([dataset[i][0] for i in range(min(job.micro_batch_size, len(dataset)))])
    model = full_model(engine, job)
    model.eval()
    out = energy_diagnostics(model, x.to(engine.device))
    model.train()
    return out


def train_loop_per_worker(job_dict: dict[str, Any]) -> None:
    """Train one model to its token budget with DeepSpeed; report and log metrics.

    Per optimizer step: ``loss`` (mean over the global batch), ``lr``, ``tokens_seen``; every
    ``log_interval`` steps ``tokens_per_s`` and ``flops_per_s`` (all workers; achieved FLOP/s from
    the analytic ``flops_per_token``). With ``energy_diagnostics``, each evaluation also logs
    per-layer per-step energies and preconditioner eigenvalues. Every ``eval_interval`` steps and at
    the end: ``val_loss``, ``val_perplexity`` and a DeepSpeed checkpoint reported to Ray Train,
    from which a resubmitted trial resumes (same step, same data order). At the end:
    ``test_loss``, ``test_perplexity`` on the whole test split, ``train_wall_s``, and the model
    logged to MLflow (``log_model``). Metrics reach MLflow run ``job.run_id`` from rank 0 and Ray
    Train through ``ray.train.report`` from every rank.
    """
    job = TrainJob(**job_dict)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import ray.train

    from workloads.checkpoint import report_with_checkpoint, restore_checkpoint

    # DeepSpeed still calls torch.distributed's deprecated all_gather_into_tensor.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    torch.set_num_threads(job.threads_per_worker)
    rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    torch.manual_seed(job.seed)

    cfg = ModelConfig(**job.model)
    corpus = PreparedCorpus.from_dict(job.corpus)
    optim = OptimConfig(**job.optim)
    precision = resolve_precision(job.precision)
    total_steps = job.total_steps

    model = build_model(cfg)
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(job.micro_batch_size, job.grad_accum, world, job.zero_stage,
                                precision, optim.grad_clip))

    start_step = 0
    restored = restore_checkpoint(lambda d: engine.load_checkpoint(d, tag=_CKPT_TAG)[1])
    if restored:
        client_state, checkpoint = restored
        start_step = client_state["step"]
        if rank == 0:
            log.info("[train] resumed from step %d (%s)", start_step, checkpoint.path)

    train_set = corpus.dataset("train", cfg.context_length)
    val_set = corpus.dataset("validation", cfg.context_length)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                 seed=job.seed, drop_last=True)
    batches = _forever(DataLoader(train_set, batch_size=job.micro_batch_size, sampler=sampler),
                       sampler, skip=start_step * job.grad_accum)
    sink = MetricSink(job.tracking_uri, job.run_id, enabled=rank == 0)
    tokens_per_step = job.batch_size * cfg.context_length
    flops_per_tok = flops_per_token(cfg, cfg.context_length)
    device = engine.device

    def validate(step: int) -> dict[str, float]:
        nll, n = evaluate(engine, val_set, job.micro_batch_size, job.eval_sequences)
        out = {"val_loss": nll / n, "val_perplexity": math.exp(nll / n)}
        sink.log(out, step)
        if job.energy_diagnostics:
            sink.log(diagnose(engine, val_set, job), step)
        sink.flush()
        return out

    def report(step: int, metrics: dict[str, float]) -> None:
        """Report to Ray Train with a checkpoint: every rank saves its shard, Ray merges them."""
        report_with_checkpoint(step, metrics, lambda d: engine.save_checkpoint(
            d, tag=_CKPT_TAG, client_state={"step": step}))

    if rank == 0:
        log.info("[train] %s attention, %s mlp: %d steps x %d tokens, %d workers, ZeRO %d, %s",
                 cfg.attention, cfg.mlp, total_steps, tokens_per_step, world, job.zero_stage,
                 precision)
    start = interval_start = time.perf_counter()
    for step in range(start_step + 1, total_steps + 1):
        lr = engine.get_lr()[0]  # the LR this optimizer step uses
        loss_sum = torch.zeros((), device=device)
        for _ in range(job.grad_accum):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            logits = engine(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        metrics = {"loss": loss_sum.item() / (job.grad_accum * world),
                   "lr": lr, "tokens_seen": step * tokens_per_step}
        if step % job.log_interval == 0 or step == total_steps:
            now = time.perf_counter()
            steps_in_interval = step % job.log_interval or job.log_interval
            metrics["tokens_per_s"] = steps_in_interval * tokens_per_step / (now - interval_start)
            metrics["flops_per_s"] = metrics["tokens_per_s"] * flops_per_tok  # achieved
            interval_start = now
            if rank == 0:
                eta = (now - start) / (step - start_step) * (total_steps - step)
                log.info("[train] step %d/%d | loss %.4f | lr %.2e | %s tok/s | eta %.0fs", step,
                         total_steps, metrics["loss"], metrics["lr"],
                         f"{metrics['tokens_per_s']:,.0f}", eta)
        sink.log(metrics, step)
        if "tokens_per_s" in metrics:
            sink.flush()
        if step % job.eval_interval == 0 and step < total_steps:
            paused = time.perf_counter()
            report(step, validate(step))
            interval_start += time.perf_counter() - paused  # tokens/s counts training time only

    final = validate(total_steps)
    nll, n = evaluate(engine, corpus.dataset("test", cfg.context_length), job.micro_batch_size)
    test = {"test_loss": nll / n, "test_perplexity": math.exp(nll / n), "test_tokens": n,
            "train_wall_s": time.perf_counter() - start}
    sink.log(test, total_steps)
    sink.flush()
    if rank == 0:
        log.info("[train] done: val perplexity %.2f, test perplexity %.2f in %.0fs",
                 final["val_perplexity"], test["test_perplexity"], test["train_wall_s"])
    report(total_steps, {**final, **test})
    model = full_model(engine, job)
    if rank == 0 and job.log_model and job.run_id:
        log_torch_model(model, job.tracking_uri, job.run_id)


def log_torch_model(model: torch.nn.Module, tracking_uri: str | None, run_id: str) -> None:
    """Save ``model`` (its training dtype, on the CPU) as an MLflow PyTorch model and upload it
    as artifact ``model`` of run ``run_id``, without touching the run's status."""
    import mlflow.pytorch
    from mlflow import MlflowClient

    logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)  # pickle notice: our own code
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model")
        # Pickled (the classes come from the installed cemlab), not a traced pt2 graph.
        mlflow.pytorch.save_model(model.cpu().eval(), path, serialization_format="pickle",
                                  pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
        MlflowClient(tracking_uri).log_artifacts(run_id, path, "model")
