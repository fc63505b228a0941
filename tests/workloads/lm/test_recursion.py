"""Test-time recursion at the end of a trial (``training.eval_steps``): the trained model on
the test split at other numbers of CEM steps, eta per step kept and scaled."""

import dataclasses
import math

import pytest
import torch

from tests.workloads.lm.test_workload import LM, nano_job
from workloads.lm import recursion
from workloads.models import ModelConfig, build_model
from workloads.models.test_time import at_steps
from workloads.runtime.worker import run_in_process


def test_each_t_eval_has_a_kept_and_a_scaled_step_size_where_the_model_has_one_t_train():
    cfg = ModelConfig.from_preset("nano", attention="cem", mlp="cem", attn_steps=2, mlp_steps=2)
    at = recursion.settings(cfg, [1, 4])
    assert list(at) == ["T1_kept", "T1_scaled", "T4_kept", "T4_scaled"]
    assert (at["T4_scaled"].attn_steps, at["T4_scaled"].mlp_steps) == (4, 4)
    assert at["T4_scaled"].step_size_scale == 2 / 4 and at["T1_scaled"].step_size_scale == 2
    assert at["T1_kept"].step_size_scale == 1
    # T_train 2 for attention, 1 for the MLP: no one total step to keep
    assert list(recursion.settings(dataclasses.replace(cfg, mlp_steps=1), [4])) == ["T4_kept"]
    attn_only = recursion.settings(ModelConfig.from_preset("nano", attention="cem"), [3])
    assert attn_only["T3_kept"].mlp_steps is None  # the Llama MLP runs as it is
    assert recursion.settings(ModelConfig.from_preset("nano"), [1, 2]) == {}


def _perplexity(model, dataset) -> float:
    """exp of the mean next-token NLL of ``model`` over every sequence of ``dataset``, from its
    logits in float64 (not the model's own targets path, which the trial's evaluation uses)."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), 16):
            xs, ys = zip(*(dataset[i] for i in range(start, min(start + 16, len(dataset)))))
            y = torch.stack(ys)  # (B, T)
            logp = torch.log_softmax(model(torch.stack(xs)).double(), dim=-1)  # (B, T, vocab)
            nll -= logp.gather(2, y[..., None]).sum().item()
            n += y.numel()
    return math.exp(nll / n)


@pytest.mark.slow
def test_a_trial_evaluates_its_model_at_each_recursion_on_the_test_split(corpus_glob, tmp_path):
    """At its own T and step size the model is the trained one: the test perplexity itself.
    Every other setting is another model (other logits), and its perplexity is that model's on
    the test split; every setting has the sublayers' energy at each of its steps.

    Whether a setting's perplexity differs from the trained one's is no test: T4_scaled keeps
    the total step T * eta, so it moves the model at second order in eta only, and an 8-step
    model's perplexity there came within 1.3e-7 of the trained one on one CPU."""
    job = nano_job(corpus_glob, tmp_path, micro=8, accum=1, steps=8, attention="cem",
                   mlp="cem", attn_steps=2, mlp_steps=2)
    training = job.trial.training.model_copy(update={"eval_steps": [1, 2, 4]})
    job = dataclasses.replace(job, trial=dataclasses.replace(job.trial, training=training))
    final, session = run_in_process(job, LM)
    test = final["test_perplexity"]
    assert final["test_time/T2_kept/perplexity"] == pytest.approx(test, rel=1e-9)
    assert final["test_time/T2_scaled/perplexity"] == final["test_time/T2_kept/perplexity"]
    model = session.made.full_model(lambda: build_model(job.trial.model)).eval()
    test_set = job.data.dataset("test", job.trial.model.context_length)
    x = torch.stack([test_set[i][0] for i in range(8)])
    with torch.no_grad():
        trained = model(x)
        for name, steps in recursion.settings(model.cfg, [1, 2, 4]).items():
            changed = at_steps(model, steps)
            moved = (changed(x) - trained).abs().max().item()
            assert (moved == 0) == (name.startswith("T2")), (name, moved)
            assert final[f"test_time/{name}/perplexity"] == pytest.approx(
                _perplexity(changed, test_set), rel=1e-5), name
    for t in (1, 2, 4):
        for rule in ("kept", "scaled"):
            energies = [final[f"test_time/T{t}_{rule}/energy/{kind}/step{s}"]
                        for kind in ("attn", "mlp") for s in range(t + 1)]
            assert all(math.isfinite(e) for e in energies)
            assert f"test_time/T{t}_{rule}/energy/attn/step{t + 1}" not in final
    assert session.history["test_time/T4_scaled/perplexity"][8] == (
        final["test_time/T4_scaled/perplexity"])  # logged at the trial's last step
