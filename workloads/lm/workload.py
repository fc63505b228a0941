"""The language-model workload: Llama and CEM decoders on packed text (paper Sec. 4).

Spec section ``data`` (``CorpusConfig``); the driver prepares the corpus once on Ray Data
(tokenizer, token shards, cached on disk) and every worker reads the same files. A trial trains
to a Chinchilla budget (or a fixed ``budget.tokens``) and is judged by test perplexity.

The train loop (``LanguageModel.train``) is the same code in a Ray Train worker (DeepSpeed
ZeRO, ``RaySession``) and in-process (plain PyTorch, ``LocalSession``). Its best trials go to the
MLflow model registry as pyfunc packages (``serving``), which the registry's commands evaluate,
probe (``probe``) and export to Hugging Face (``export``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

from workloads.core.architecture import PRESETS, ModelConfig
from workloads.core.config import (
    BudgetConfig,
    EngineConfig,
    OptimizerConfig,
    ResourcesConfig,
    TrainingConfig,
)
from workloads.core.paths import Paths
from workloads.core.storage import StorageRoot
from workloads.core.trial import Budget, Job, Prepared, Trial
from workloads.lm.data import CorpusConfig, PackedSequences, PreparedCorpus, prepare_corpus
from workloads.lm.memory import MemoryEstimate, trial_memory
from workloads.lm.model_card import model_card
from workloads.lm.package import CONFIG, PACKAGE, TOKENIZER, WEIGHTS, load_decoder
from workloads.lm.recursion import test_time_metrics
from workloads.models import build_model, flops_per_token, next_token_loss, parameter_counts
from workloads.models.decoder import DecoderLM, with_math_attention
from workloads.models.diagnostics import energy_diagnostics
from workloads.models.test_time import Steps, at_steps
from workloads.runtime.engine import Engine
from workloads.runtime.session import Session
from workloads.runtime.stacked import Stack
from workloads.runtime.trainer import Task
from workloads.runtime.worker import TrainedWorkload


def steps_for(tokens: int, batch_size: int, seq_len: int) -> int:
    """Optimizer steps of ``batch_size`` sequences of ``seq_len`` that cover ``tokens`` (ceil)."""
    return math.ceil(tokens / (batch_size * seq_len))


def baseline_model(size: str, vocab_size: int) -> ModelConfig:
    """The Llama baseline of preset ``size`` (its dimensions, Llama sublayers), whose total
    parameters set the Chinchilla budget of every variant of that size."""
    p = PRESETS[size]
    return ModelConfig(vocab_size=vocab_size, d_model=p.d_model, n_layer=p.n_layer,
                       n_head=p.n_head, d_mlp=p.d_mlp, context_length=p.context_length)


def token_budget(budget: BudgetConfig, size: str, vocab_size: int) -> int:
    """``budget.tokens``, else Chinchilla: ``tokens_per_param`` x total parameters of the
    Llama baseline of ``size`` x its ``budget_scale`` (paper Sec. 4, App. C.3)."""
    if budget.tokens is not None:
        return budget.tokens
    baseline = parameter_counts(baseline_model(size, vocab_size))["total"]
    return max(1, round(budget.tokens_per_param * baseline * budget.scale_for(size)))


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
def sequence_nll(model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 dataset: PackedSequences, indices: Iterable[int], batch_size: int,
                 device: torch.device) -> tuple[float, int]:
    """Summed next-token NLL (nats, float64) and token count of ``model`` over the sequences
    ``indices`` of ``dataset``, ``batch_size`` at a time; ``model(x, y)`` scores each position
    (``DecoderLM``'s targets path: no logits are kept). Index -1 is padding: it runs (so that
    every rank runs the same passes) but is not counted."""
    indices = list(indices)
    nll_sum, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for start in range(0, len(indices), batch_size):
        idx = indices[start:start + batch_size]
        xs, ys = zip(*(dataset[max(i, 0)] for i in idx))
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        keep = torch.tensor([i >= 0 for i in idx], device=device)
        nll = model(x, y)[keep]  # (B, T) -> the kept sequences
        nll_sum += nll.sum().double()
        count += nll.numel()
    return nll_sum.item(), count


def evaluate(engine: Engine | DecoderLM, session: Session, dataset: PackedSequences,
             batch_size: int, max_sequences: int | None = None) -> tuple[float, int]:
    """Summed next-token NLL (nats) and token count over ``dataset``, across all ranks, without
    gradients (the models' no-grad paths: no graph is kept), ``batch_size`` sequences a pass,
    of the ``engine``'s model or of a whole ``DecoderLM`` held by every rank.

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
    device = engine.device if isinstance(engine, Engine) else next(engine.parameters()).device
    engine.eval()
    with torch.no_grad():
        nll, count = sequence_nll(engine, dataset, mine, batch_size, device)
    engine.train()
    totals = session.all_reduce(torch.tensor([nll, count], dtype=torch.float64, device=device))
    return totals[0].item(), int(totals[1].item())


def mean_loss(engine: Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean next-token loss of ``engine`` on ``batch`` ((B, T) inputs, (B, T) targets):
    ``Task.loss`` of a stack's calibration and benchmark steps."""
    x, y = batch
    return next_token_loss(engine(x), y)


class LanguageModel(TrainedWorkload):
    """Decoder language models on a corpus; test perplexity decides (lower is better)."""

    name = "language_model"
    section = "data"
    config_type = CorpusConfig
    metric = "test_perplexity"
    selection_metric = "val_perplexity"
    unit = "tokens"
    registers_models = True
    stackable = True
    model_files = ("MLmodel", *(f"artifacts/{PACKAGE}/{f}" for f in (WEIGHTS, CONFIG, TOKENIZER)))

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

    def budget(self, config: CorpusConfig, budget: BudgetConfig, training: TrainingConfig,
               size: str, model: ModelConfig) -> Budget:
        """``ceil(token_budget / (batch_size x context_length))`` steps of whole batches."""
        seq = model.context_length
        steps = steps_for(token_budget(budget, size, model.vocab_size), training.batch_size,
                          seq)
        tokens = steps * training.batch_size * seq
        return Budget(steps, tokens, flops_per_token(model, seq) * tokens,
                      parameter_counts(model))

    def memory(self, model: ModelConfig, engine: EngineConfig, resources: ResourcesConfig,
               micro_batch_size: int, config: CorpusConfig | None = None) -> MemoryEstimate:
        """``workloads.lm.memory.trial_memory``: model states under ZeRO plus one micro-batch's
        activations (the corpus section does not change them)."""
        return trial_memory(model, engine, resources, micro_batch_size)

    def calibration_step(self, config: CorpusConfig, model: ModelConfig, micro_batch_size: int,
                         device: torch.device, stack: int = 1, seq_len: int = 128,
                         ) -> tuple[Callable[[], None], float]:
        """One forward + backward of ``micro_batch_size`` random sequences of at most
        ``seq_len`` tokens (short: a paper-size calibration step takes seconds); with ``stack``
        > 1, one train step of that many models as one stacked model (``Stack.step``: the
        optimizer's update too)."""
        seq = min(model.context_length, seq_len)
        flops = flops_per_token(model, seq) * micro_batch_size * seq
        idx = torch.randint(model.vocab_size, (stack, micro_batch_size, seq + 1), device=device)
        if stack > 1:
            stacked = Stack([build_model(model) for _ in range(stack)], [1e-3] * stack,
                            OptimizerConfig(), mean_loss, with_math_attention, device, False)
            pairs = [(idx[k, :, :-1], idx[k, :, 1:]) for k in range(stack)]
            alive = torch.ones(stack, dtype=torch.bool, device=device)
            return lambda: stacked.step([pairs], 1.0, alive), flops * stack
        net = build_model(model).to(device)

        def step() -> None:
            logits = net(idx[0, :, :-1])
            next_token_loss(logits, idx[0, :, 1:]).backward()
        return step, flops

    def task(self, job: Job, session: Session) -> LanguageModelTask:
        return LanguageModelTask(job, session)

    def model_card(self, name: str, experiment: str, trial: Trial, val: float, test: float,
                   commit: str | None, code: str | None) -> str:
        return model_card(name, experiment, trial, val, test, commit, code)

    def evaluate_model(self, model_dir: Path, tags: dict[str, str], data_dir: Path,
                       split: str, batch_size: int = 8,
                       recursion: dict[str, float] | None = None) -> float:
        """Perplexity on ``split`` of the corpus the tags name, in the dtype it trained in; with
        ``recursion``, at those recursion steps (``workloads.models.test_time.Steps``)."""
        model, dataset = _model_and_split(model_dir, tags, data_dir, split)
        if recursion:
            model = at_steps(model, Steps(**recursion))
        nll, n = sequence_nll(model, dataset, range(len(dataset)), batch_size,
                              torch.device("cpu"))
        return math.exp(nll / n)

    def probe_model(self, model_dir: Path, tags: dict[str, str], data_dir: Path, split: str,
                    sequences: int) -> list[dict]:
        """``workloads.lm.probe.position_prior_kl`` of the model (in fp32) on ``sequences``
        evenly spaced sequences of ``split``: per attention layer and step, entropy,
        position-prior entropy and KL(p || prior), nats."""
        from workloads.lm.probe import position_prior_kl

        model, dataset = _model_and_split(model_dir, tags, data_dir, split, torch.float32)
        picks = torch.linspace(0, len(dataset) - 1, min(sequences, len(dataset))).long()
        return position_prior_kl(model, torch.stack([dataset[i][0] for i in picks.tolist()]))

    def export_model(self, model_dir: Path, directory: Path) -> Path:
        """A Llama baseline as a Hugging Face ``LlamaForCausalLM`` directory
        (``workloads.lm.export``)."""
        from workloads.lm.export import export_hf

        return export_hf(package_dir(model_dir), directory)


class LanguageModelTask(Task):
    """One worker's share of a language-model trial for the ``Trainer``: the decoder, this
    rank's micro-batches of the train split (a ``DistributedSampler`` reshuffled per epoch),
    next-token cross-entropy (compiled with the model where the engine compiles, one fused pass
    over the logits), validation and test perplexity, and the trained model kept as a pyfunc.

    Validation: ``val_loss``, ``val_perplexity`` on ``training.eval_sequences`` sequences (with
    ``energy_diagnostics`` also per-layer per-step energies and preconditioner eigenvalues,
    logged alone); test: ``test_loss``, ``test_perplexity``, ``test_tokens`` on the whole split,
    and with ``eval_steps`` the test-time recursion metrics (``workloads.lm.recursion``).
    """

    backend, unit = "deepspeed", "tokens"
    headline = ("val_perplexity", "test_perplexity")

    def __init__(self, job: Job, session: Session) -> None:
        self.trial, self.session = job.trial, session
        self.corpus = job.data.localized(Paths().data_dir)
        self.cfg = cfg = self.trial.model
        self.units_per_step = self.trial.training.batch_size * cfg.context_length
        self.flops_per_unit = flops_per_token(cfg, cfg.context_length)
        self.describe = f"{cfg.attention} attention, {cfg.mlp} mlp"
        self.splits = {split: self.corpus.dataset(split, cfg.context_length)
                       for split in ("train", "validation", "test")}
        self._loss_of: Callable | None = None

    def build_model(self) -> DecoderLM:
        return build_model(self.cfg)

    def vmappable(self, model: DecoderLM) -> DecoderLM:
        return with_math_attention(model)

    def batches(self, skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        train_set, session = self.splits["train"], self.session
        sampler = DistributedSampler(train_set, num_replicas=session.world_size,
                                     rank=session.rank, shuffle=True, seed=self.trial.seed,
                                     drop_last=True)
        return _forever(DataLoader(train_set, batch_size=self.trial.micro_batch_size,
                                   sampler=sampler), sampler, skip=skip)

    def loss(self, engine: Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self._loss_of is None:  # compiled with the model (``engine.compile``)
            self._loss_of = (torch.compile(next_token_loss, dynamic=False) if engine.compiled
                             else next_token_loss)
        x, y = batch
        return self._loss_of(engine(x.to(engine.device)), y.to(engine.device))

    def evaluate(self, engine: Engine, split: str) -> dict[str, float]:
        validation = split == "validation"
        # without gradients, a worker's share of the global batch fits where one micro-batch
        # and its graph did
        nll, n = evaluate(engine, self.session, self.splits[split],
                          self.trial.micro_batch_size * self.trial.grad_accum,
                          self.trial.training.eval_sequences if validation else None)
        prefix = "val" if validation else "test"
        out = {f"{prefix}_loss": nll / n, f"{prefix}_perplexity": math.exp(nll / n),
               **({} if validation else {"test_tokens": n})}
        if not validation and self.trial.training.eval_steps:
            out.update(self._test_time(engine))
        return out

    def _test_time(self, engine: Engine) -> dict[str, float]:
        """``workloads.lm.recursion.test_time_metrics`` of the trained model on the test split
        (the energies on its first micro-batch of sequences). A collective."""
        model = engine.full_model(self.build_model).eval()
        test_set = self.splits["test"]
        x = torch.stack([test_set[i][0]
                         for i in range(min(self.trial.micro_batch_size, len(test_set)))])
        batch = self.trial.micro_batch_size * self.trial.grad_accum
        return test_time_metrics(
            model, self.trial.training.eval_steps, x.to(engine.device),
            lambda m: evaluate(m, self.session, test_set, batch))

    def diagnostics(self, engine: Engine) -> dict[str, float]:
        if not self.trial.training.energy_diagnostics:
            return {}
        val_set = self.splits["validation"]
        x = torch.stack([val_set[i][0]
                         for i in range(min(self.trial.micro_batch_size, len(val_set)))])
        model = engine.full_model(self.build_model)
        model.eval()
        return energy_diagnostics(model, x.to(engine.device))

    def keep(self, engine: Engine) -> None:
        model = engine.full_model(self.build_model)
        if self.session.rank == 0:
            self.session.keep_model(
                lambda path: _save_pyfunc(model, self.corpus.tokenizer_path, path))


def _save_pyfunc(model: DecoderLM, tokenizer_json: str, path: str) -> None:
    """``serving.save_pyfunc`` of ``model`` (on the CPU, in eval mode): MLflow is imported only
    where a model is kept."""
    from workloads.lm.serving import save_pyfunc

    save_pyfunc(model.cpu().eval(), tokenizer_json, path)


def package_dir(model_dir: Path) -> Path:
    """The safetensors package (weights, config, tokenizer) inside a registered model's
    directory.

    Raises:
        LookupError: a model registered before packages (a pickled model), never loaded.
    """
    package = Path(model_dir) / "artifacts" / PACKAGE
    if not (package / WEIGHTS).is_file():
        raise LookupError(f"{model_dir} has no safetensors package (registered by an older CEM "
                          "Lab, as a pickle, which is never loaded): run its experiment again "
                          "to register one")
    return package


def _model_and_split(model_dir: Path, tags: dict[str, str], data_dir: Path, split: str,
                     dtype: torch.dtype | None = None) -> tuple[DecoderLM, PackedSequences]:
    """The registered decoder (in ``dtype``, default its training dtype) and ``split`` of the
    corpus its tags name, as sequences of its context length."""
    model = load_decoder(package_dir(model_dir), dtype=dtype)
    corpus = prepare_corpus(CorpusConfig.model_validate_json(tags["data"]), data_dir)
    return model, corpus.dataset(split, int(tags["context_length"]))
