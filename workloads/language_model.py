"""The language-model workload: Llama and CEM decoders on packed text (paper Sec. 4).

Spec section ``data`` (``CorpusConfig``); the driver prepares the corpus once on Ray Data
(tokenizer, token shards, cached on disk) and every worker reads the same files. A trial trains
to a Chinchilla budget (or a fixed ``training.tokens``) and is judged by test perplexity.

The train loop (``LanguageModel.train``) is the same code in a Ray Train worker (DeepSpeed
ZeRO, ``RaySession``) and in-process (plain PyTorch, ``LocalSession``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from workloads.base import Budget, Job, Prepared, Workload
from workloads.config import TrainingConfig
from workloads.data import CorpusConfig, PackedSequences, PreparedCorpus, prepare_corpus
from workloads.engine import Engine
from workloads.models import (
    PRESETS,
    ModelConfig,
    build_model,
    flops_per_token,
    next_token_loss,
    parameter_counts,
)
from workloads.models.diagnostics import energy_diagnostics
from workloads.session import Session
from workloads.settings import Paths
from workloads.storage import StorageRoot


def steps_for(tokens: int, batch_size: int, seq_len: int) -> int:
    """Optimizer steps of ``batch_size`` sequences of ``seq_len`` that cover ``tokens`` (ceil)."""
    return math.ceil(tokens / (batch_size * seq_len))


def baseline_model(size: str, vocab_size: int) -> ModelConfig:
    """The Llama baseline of preset ``size`` (its dimensions, Llama sublayers), whose total
    parameters set the Chinchilla budget of every variant of that size."""
    p = PRESETS[size]
    return ModelConfig(vocab_size=vocab_size, d_model=p.d_model, n_layer=p.n_layer,
                       n_head=p.n_head, d_mlp=p.d_mlp, context_length=p.context_length)


def token_budget(training: TrainingConfig, size: str, vocab_size: int) -> int:
    """``training.tokens``, else Chinchilla: ``tokens_per_param`` x total parameters of the
    Llama baseline of ``size`` x its ``budget_scale`` (paper Sec. 4, App. C.3)."""
    if training.tokens is not None:
        return training.tokens
    baseline = parameter_counts(baseline_model(size, vocab_size))["total"]
    return max(1, round(training.tokens_per_param * baseline * training.scale_for(size)))


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
def sequence_nll(model: Callable[[torch.Tensor], torch.Tensor], dataset: PackedSequences,
                 indices: Iterable[int], batch_size: int, device: torch.device,
                 ) -> tuple[float, int]:
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


def evaluate(engine: Engine, session: Session, dataset: PackedSequences, micro_batch_size: int,
             max_sequences: int | None = None) -> tuple[float, int]:
    """Summed next-token NLL (nats) and token count over ``dataset``, across all ranks.

    At most ``max_sequences`` sequences, evenly spaced through the split. Every rank runs the
    same number of forward passes (a short shard is padded with masked-out sequences), as ZeRO-3
    requires.
    """
    rank, world = session.rank, session.world_size
    n = len(dataset) if max_sequences is None else min(len(dataset), max_sequences)
    chosen = [i * len(dataset) // n for i in range(n)]
    per_rank = math.ceil(n / world)
    mine = chosen[rank::world]
    mine = mine + [-1] * (per_rank - len(mine))  # -1: padding, not counted
    engine.eval()
    nll, count = sequence_nll(engine, dataset, mine, micro_batch_size, engine.device)
    engine.train()
    totals = session.all_reduce(torch.tensor([nll, count], dtype=torch.float64,
                                             device=engine.device))
    return totals[0].item(), int(totals[1].item())


class LanguageModel(Workload[CorpusConfig, PreparedCorpus]):
    """Decoder language models on a corpus; test perplexity decides (lower is better)."""

    name = "language_model"
    section = "data"
    config_type = CorpusConfig
    metric = "test_perplexity"
    selection_metric = "val_perplexity"
    unit = "tokens"
    registers_models = True

    def datasets(self, config: CorpusConfig) -> list[str]:
        return [config.source]

    def identity(self, config: CorpusConfig, data: PreparedCorpus | None = None) -> dict:
        """The config, and with ``data`` the prepared corpus's name ``corpus-<key>``, a hash of
        the config and of every document's id and content: an edited corpus is new data."""
        return {**config.model_dump(), **({"corpus": data.name} if data is not None else {})}

    def vocab_size(self, config: CorpusConfig, data: PreparedCorpus | None) -> int:
        return data.vocab_size if data is not None else config.vocab_size

    def prepare(self, config: CorpusConfig, data_dir: str) -> Prepared[PreparedCorpus]:
        corpus = prepare_corpus(config, data_dir)
        return Prepared(corpus, {"unigram_test_perplexity": corpus.unigram_test_perplexity},
                        f"corpus: {corpus.n_tokens} tokens, {corpus.n_documents} documents, "
                        f"unigram test perplexity {corpus.unigram_test_perplexity:.1f}")

    def publish(self, data: PreparedCorpus, storage: StorageRoot) -> PreparedCorpus:
        return data.publish(storage)

    def budget(self, config: CorpusConfig, training: TrainingConfig, size: str,
               model: ModelConfig) -> Budget:
        """``ceil(token_budget / (batch_size x context_length))`` steps of whole batches."""
        seq = model.context_length
        steps = steps_for(token_budget(training, size, model.vocab_size), training.batch_size,
                          seq)
        tokens = steps * training.batch_size * seq
        return Budget(steps, tokens, flops_per_token(model, seq) * tokens,
                      parameter_counts(model))

    def calibration_step(self, config: CorpusConfig, model: ModelConfig, micro_batch_size: int,
                         device: torch.device, seq_len: int = 128,
                         ) -> tuple[Callable[[], None], float]:
        """One forward + backward of ``micro_batch_size`` random sequences of at most
        ``seq_len`` tokens (short: a paper-size calibration step takes seconds)."""
        seq = min(model.context_length, seq_len)
        net = build_model(model).to(device)
        idx = torch.randint(model.vocab_size, (micro_batch_size, seq + 1), device=device)

        def step() -> None:
            logits = net(idx[:, :-1])
            next_token_loss(logits, idx[:, 1:]).backward()
        return step, flops_per_token(model, seq) * micro_batch_size * seq

    def train(self, job: Job, session: Session) -> dict[str, float]:
        """Train one model to its token budget; report and log metrics.

        Per optimizer step: ``loss`` (mean over the global batch), ``lr``, ``tokens_seen``; every
        ``log_interval`` steps ``tokens_per_s``, ``flops_per_s`` (all workers; achieved FLOP/s
        from the analytic ``flops_per_token``) and ``mfu`` (over the workers' peak,
        ``Session.peak_flops``). With ``energy_diagnostics``, each evaluation also
        logs per-layer per-step energies and preconditioner eigenvalues. Every ``eval_interval``
        steps and at the end: ``val_loss``, ``val_perplexity`` and a checkpoint, from which a
        resubmitted trial resumes (same step, same data order). At the end: ``test_loss``,
        ``test_perplexity`` on the whole test split, ``train_wall_s``, ``train_mfu`` and
        ``peak_memory_mib`` (``Session.efficiency``), and the model kept by the session. A
        compiled engine's first step, which compiles the model, is the clock's ``compile`` phase
        and counts in neither ``tokens_per_s`` nor ``train_mfu``.
        Returns the final validation and test metrics.
        """
        trial, corpus = job.trial, job.data.localized(Paths().data_dir)
        t, cfg = trial.training, trial.model
        rank, world = session.rank, session.world_size
        torch.manual_seed(trial.seed)
        engine = session.engine(build_model(cfg), backend="deepspeed")
        start_step = session.restore(engine)

        train_set = corpus.dataset("train", cfg.context_length)
        val_set = corpus.dataset("validation", cfg.context_length)
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                     seed=trial.seed, drop_last=True)
        batches = _forever(DataLoader(train_set, batch_size=trial.micro_batch_size,
                                      sampler=sampler), sampler,
                           skip=start_step * trial.grad_accum)
        # compiled with the model (``training.compile``): one fused pass over the logits
        loss_of = (torch.compile(next_token_loss, dynamic=False) if engine.compiled
                   else next_token_loss)
        tokens_per_step = t.batch_size * cfg.context_length
        flops_per_tok = flops_per_token(cfg, cfg.context_length)
        total_steps, device = trial.steps, engine.device

        def validate(step: int) -> dict[str, float]:
            with session.clock.phase("eval"):
                nll, n = evaluate(engine, session, val_set, trial.micro_batch_size,
                                  t.eval_sequences)
                out = {"val_loss": nll / n, "val_perplexity": math.exp(nll / n)}
                session.log(out, step)
                if t.energy_diagnostics:
                    x = torch.stack([val_set[i][0]
                                     for i in range(min(trial.micro_batch_size, len(val_set)))])
                    model = engine.full_model(lambda: build_model(cfg))
                    model.eval()
                    session.log(energy_diagnostics(model, x.to(device)), step)
                session.flush()
            return out

        session.info("[train] %s attention, %s mlp: %d steps x %d tokens, %d worker(s), %s, %s",
                     cfg.attention, cfg.mlp, total_steps, tokens_per_step, world, engine.name,
                     session.precision)
        peak_flops = session.peak_flops(device) * world  # all workers
        start = interval_start = time.perf_counter()
        interval_from = start_step  # tokens/s: over the steps after this one
        # A compiled model compiles in its first step: that step is the clock's "compile"
        # phase, left out of tokens/s and train_mfu (CEM-134M compiles for 101 s, Llama for 21).
        compiling, timed_steps = engine.compiled, 0
        for step in range(start_step + 1, total_steps + 1):
            session.clock.first_step()
            with session.clock.phase("compile" if compiling else "train"):
                lr = engine.lr()  # the LR this optimizer step uses
                loss_sum = torch.zeros((), device=device)
                for _ in range(trial.grad_accum):
                    x, y = next(batches)
                    x, y = x.to(device), y.to(device)
                    logits = engine(x)
                    loss = loss_of(logits, y)
                    engine.backward(loss)
                    engine.step()
                    loss_sum += loss.detach()
                session.all_reduce(loss_sum)
                metrics = {"loss": loss_sum.item() / (trial.grad_accum * world),
                           "lr": lr, "tokens_seen": step * tokens_per_step}
                if step % t.log_interval == 0 or step == total_steps:
                    now = time.perf_counter()
                    metrics["tokens_per_s"] = ((step - interval_from) * tokens_per_step
                                               / (now - interval_start))
                    metrics["flops_per_s"] = metrics["tokens_per_s"] * flops_per_tok  # achieved
                    metrics["mfu"] = metrics["flops_per_s"] / peak_flops
                    interval_start, interval_from = now, step
                    eta = (now - start) / (step - start_step) * (total_steps - step)
                    session.info("[train] step %d/%d | loss %.4f | lr %.2e | %s tok/s | MFU %.1f%% "
                                 "| eta %.0fs", step, total_steps, metrics["loss"], metrics["lr"],
                                 f"{metrics['tokens_per_s']:,.0f}", 100 * metrics["mfu"], eta)
                session.log(metrics, step)
                if "tokens_per_s" in metrics:
                    session.flush()
            if compiling:  # tokens/s from the next step on
                compiling, interval_start, interval_from = False, time.perf_counter(), step
            else:
                timed_steps += 1
            if step % t.eval_interval == 0 and step < total_steps:
                paused = time.perf_counter()
                scores = validate(step)
                with session.clock.phase("checkpoint"):
                    session.checkpoint(engine, step, scores)
                interval_start += time.perf_counter() - paused  # tokens/s: training time only

        final = validate(total_steps)
        with session.clock.phase("eval"):
            nll, n = evaluate(engine, session, corpus.dataset("test", cfg.context_length),
                              trial.micro_batch_size)
        test = {"test_loss": nll / n, "test_perplexity": math.exp(nll / n), "test_tokens": n,
                "train_wall_s": time.perf_counter() - start,
                **session.efficiency(flops_per_tok * tokens_per_step * timed_steps, device)}
        session.log(test, total_steps)
        session.flush()
        session.info("[train] done: val perplexity %.2f, test perplexity %.2f in %.0fs",
                     final["val_perplexity"], test["test_perplexity"], test["train_wall_s"])
        # The phases so far go to the driver with the last report (time/*: workloads.timing).
        session.checkpoint(engine, total_steps, {**final, **test, **session.clock.metrics()})
        model = engine.full_model(lambda: build_model(cfg))
        if rank == 0:
            session.log_model(model, corpus.tokenizer_path)
        return {**final, **test}
