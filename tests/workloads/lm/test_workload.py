"""The language-model workload without Ray: resumed data order, sequence NLL, its budget, and
its train loop in-process (the loop the Ray workers run), on a small real corpus."""

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from workloads.core.config import (
    BudgetConfig,
    EngineConfig,
    OptimizerConfig,
    ResourcesConfig,
    ScheduleConfig,
    TrainingConfig,
)
from workloads.core.registry import get_workload
from workloads.core.trial import Job, Trial
from workloads.lm.data import CorpusConfig
from workloads.lm.workload import _forever, sequence_nll, token_budget
from workloads.models import ModelConfig, parameter_counts
from workloads.runtime.worker import run_in_process

LM = get_workload("language_model")


def batches(skip: int, n: int):
    data = TensorDataset(torch.arange(10))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    stream = _forever(DataLoader(data, batch_size=3, sampler=sampler), sampler, skip=skip)
    return [b[0].tolist() for b in itertools.islice(stream, n)]


def test_a_resumed_stream_continues_where_the_uninterrupted_one_was():
    whole = batches(0, 12)  # 4 batches per epoch (drop_last off: 3 + 3 + 3 + 1)
    for skip in (1, 4, 5, 9):
        assert batches(skip, 12 - skip) == whole[skip:]
    assert whole[:4] != whole[4:8]  # every epoch is reshuffled


class Bigram(torch.nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, x, y):  # scores targets, as DecoderLM(x, y) does
        return F.cross_entropy(self.table(x).transpose(1, 2), y, reduction="none")


def test_sequence_nll_counts_real_sequences_only():
    torch.manual_seed(0)
    seqs = [(torch.randint(8, (5,)), torch.randint(8, (5,))) for _ in range(3)]
    model = Bigram(8)
    nll, n = sequence_nll(model, seqs, [0, 2, -1, -1], batch_size=3, device=torch.device("cpu"))
    expected = sum(F.cross_entropy(model.table(x), y, reduction="sum").item()
                   for x, y in (seqs[0], seqs[2]))
    assert n == 10 and math.isclose(nll, expected, rel_tol=1e-6)


def nano_job(corpus_glob: str, tmp_path, micro: int, accum: int, steps: int = 12,
             **model) -> Job:
    """A nano trial of ``steps`` steps of 8 sequences, ``micro`` x ``accum`` per step, fp32."""
    workload = get_workload("language_model")
    corpus = CorpusConfig(source="text_files", paths=corpus_glob, vocab_size=300,
                          val_fraction=0.1, test_fraction=0.1)
    prepared = workload.prepare(corpus, str(tmp_path / "data"))
    cfg = ModelConfig.from_preset("nano", vocab_size=prepared.data.vocab_size, **model)
    budget = BudgetConfig(tokens=steps * 8 * cfg.context_length)
    training = TrainingConfig(batch_size=8, micro_batch_size=micro, eval_interval=5,
                              eval_sequences=16, log_interval=4)
    trial = Trial("t", workload.name, "text_files", "v", "nano", 0.004, 0, cfg, corpus,
                  training=training, optimizer=OptimizerConfig(), schedule=ScheduleConfig(),
                  engine=EngineConfig(precision="fp32"), resources=ResourcesConfig(num_workers=1),
                  budget=workload.budget(corpus, budget, training, "nano", cfg),
                  micro_batch_size=micro, grad_accum=accum)
    return Job(trial, prepared.data)


def test_budget_is_whole_steps_covering_the_chinchilla_tokens():
    workload = get_workload("language_model")
    scale = BudgetConfig(budget_scale=0.05)
    cfg = ModelConfig.from_preset("nano", attention="cem", mlp="cem", attn_steps=2)
    budget = workload.budget(CorpusConfig(), scale, TrainingConfig(batch_size=16), "nano", cfg)
    baseline = parameter_counts(ModelConfig.from_preset("nano"))["total"]  # Llama, same dims
    assert token_budget(scale, "nano", 512) == round(20 * baseline * 0.05)
    assert budget.steps == math.ceil(round(20 * baseline * 0.05) / (16 * 64))
    assert budget.units == budget.steps * 16 * 64
    assert budget.params == parameter_counts(cfg) and budget.params["total"] < baseline


def test_in_process_training_lowers_the_loss_and_reports_test_perplexity(corpus_glob, tmp_path):
    job = nano_job(corpus_glob, tmp_path, micro=8, accum=1, steps=30)
    final, session = run_in_process(job, LM)
    loss = session.history["loss"]
    assert sorted(loss) == list(range(1, 31))  # every step logged once
    assert sum(loss[s] for s in range(26, 31)) / 5 < sum(loss[s] for s in range(1, 6)) / 5 - 1
    assert final["test_perplexity"] == pytest.approx(math.exp(final["test_loss"]), rel=1e-9)
    assert final["test_loss"] < loss[1] - 1  # held-out text, not only the training batches
    assert sorted(session.history["val_loss"]) == [5, 10, 15, 20, 25, 30]
    lrs = [session.history["lr"][s] for s in (1, 30)]  # warmup from lr/2, cosine to lr/10
    assert lrs == pytest.approx([0.004 / 2, 0.004 * 0.1])
    # Where the time went: train steps and evaluations (six validations and the test split)
    # account for the loop's wall time; the in-process session keeps no checkpoint.
    spent = session.clock.seconds
    assert spent["train"] > 0 and spent["eval"] > 0 and spent["checkpoint"] < 0.01
    assert spent["startup"] >= 0
    assert spent["train"] + spent["eval"] <= final["train_wall_s"] * 1.05 + 0.1
    assert spent["train"] + spent["eval"] >= final["train_wall_s"] * 0.8


def test_gradient_accumulation_gives_the_full_batch_step(corpus_glob, tmp_path):
    """8 sequences per step as one micro-batch or as 4 accumulated micro-batches of 2: the same
    optimizer steps (fp32), so the same losses up to summation order."""
    whole, _ = run_in_process(nano_job(corpus_glob, tmp_path, micro=8, accum=1), LM)
    _, one = run_in_process(nano_job(corpus_glob, tmp_path, micro=8, accum=1), LM)
    _, four = run_in_process(nano_job(corpus_glob, tmp_path, micro=2, accum=4), LM)
    steps = sorted(one.history["loss"])
    assert [four.history["loss"][s] for s in steps] == pytest.approx(
        [one.history["loss"][s] for s in steps], rel=1e-4)
    assert four.history["test_loss"] == pytest.approx(one.history["test_loss"], rel=1e-4)
    assert whole["test_loss"] == one.history["test_loss"][12]  # deterministic given the seed


def test_a_cem_model_trains_in_the_same_loop(corpus_glob, tmp_path):
    job = nano_job(corpus_glob, tmp_path, micro=8, accum=1, steps=20, attention="cem",
                   mlp="cem", attn_steps=2, kq_diag="shared",
                   attn_preconditioner="diag_lowrank")
    job = dataclasses.replace(job, trial=dataclasses.replace(
        job.trial, training=job.trial.training.model_copy(update={"energy_diagnostics": True})))
    final, session = run_in_process(job, LM)
    assert math.isfinite(final["test_loss"])
    assert session.history["loss"][20] < session.history["loss"][1]
    assert all(math.isfinite(v) for v in session.history["energy/attn/layer1/step2"].values())
