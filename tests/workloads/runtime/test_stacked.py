"""Stacked trials (``runtime.stacked``): a member of a stack trains as it does alone."""

import dataclasses
import math

import pytest
import torch

from tests.workloads.lm.test_workload import LM, nano_job
from workloads.core.config import OptimizerConfig
from workloads.runtime.stacked import StackedAdamW, clip_per_member
from workloads.runtime.worker import run_in_process, run_stacked_in_process


def _variant(job, lr: float, seed: int):
    trial = dataclasses.replace(job.trial, trial_id=f"lr{lr}-s{seed}", lr=lr, seed=seed)
    return dataclasses.replace(job, trial=trial)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, {"attention": "cem", "mlp": "cem", "attn_steps": 2}],
                         ids=["llama", "cem"])
def test_a_member_of_a_stack_of_four_trains_as_it_does_alone(corpus_glob, tmp_path, variant):
    """fp32: the loss at each of the first 50 steps within 1e-4 relative, the final test
    perplexity within 0.1 %, for the member with the largest learning rate and for another."""
    job = nano_job(corpus_glob, tmp_path, micro=8, accum=1, steps=50, **variant)
    training = job.trial.training.model_copy(update={"eval_interval": 25})
    job = dataclasses.replace(job, trial=dataclasses.replace(job.trial, training=training))
    members = [_variant(job, lr, seed) for lr, seed in
               ((0.004, 0), (0.002, 1), (0.008, 2), (0.004, 3))]
    stacked = run_stacked_in_process(members, LM)
    for k in (2, 3):
        final, session = run_in_process(members[k], LM)
        alone, together = session.history["loss"], stacked[k][1].history["loss"]
        assert sorted(together) == list(range(1, 51))
        for step in range(1, 51):
            assert together[step] == pytest.approx(alone[step], rel=1e-4), step
        assert stacked[k][1].history["lr"] == session.history["lr"]
        assert stacked[k][0]["test_perplexity"] == pytest.approx(final["test_perplexity"],
                                                                 rel=1e-3)
        assert sorted(stacked[k][1].history["val_loss"]) == sorted(session.history["val_loss"])
    # the members are distinct trials: other seeds and rates, other losses
    assert len({round(s.history["loss"][50], 6) for _, s in stacked}) == 4


def test_stacked_adamw_is_torchs_adamw_per_member():
    """Three members at three learning rates, one decayed and one undecayed tensor, 5 steps
    with clipping: each member equals torch.optim.AdamW with clip_grad_norm_ on it alone."""
    torch.manual_seed(0)
    cfg = OptimizerConfig(weight_decay=0.1, grad_clip=0.5)
    lrs = [1e-3, 3e-2, 1e-1]
    w, b = torch.randn(3, 4, 5), torch.randn(3, 5)
    stacked = {"w": w.clone().requires_grad_(), "b": b.clone().requires_grad_()}
    opt = StackedAdamW(stacked, {"w"}, lrs, cfg)
    alone = [(w[k].clone().requires_grad_(), b[k].clone().requires_grad_()) for k in range(3)]
    opts = [torch.optim.AdamW([{"params": [wk], "weight_decay": 0.1},
                               {"params": [bk], "weight_decay": 0.0}], lr=lrs[k],
                              betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
            for k, (wk, bk) in enumerate(alone)]
    x = torch.randn(7, 4)
    for step in range(5):
        factor = 1 - 0.1 * step
        ((x @ stacked["w"] + stacked["b"][:, None]).pow(2).sum(dim=(1, 2))).sum().backward()
        clip_per_member([stacked["w"].grad, stacked["b"].grad], cfg.grad_clip)
        opt.step(factor, torch.ones(3, dtype=torch.bool))
        stacked["w"].grad = stacked["b"].grad = None
        for (wk, bk), o, lr in zip(alone, opts, lrs):
            (x @ wk + bk).pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_([wk, bk], cfg.grad_clip)
            for group in o.param_groups:
                group["lr"] = lr * factor
            o.step()
            o.zero_grad()
    for k, (wk, bk) in enumerate(alone):
        torch.testing.assert_close(stacked["w"][k].detach(), wk.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(stacked["b"][k].detach(), bk.detach(), rtol=1e-6, atol=1e-7)


def test_a_member_that_diverges_stops_and_the_others_go_on(corpus_glob, tmp_path):
    job = nano_job(corpus_glob, tmp_path, micro=8, accum=1, steps=12)
    members = [_variant(job, 0.004, 0), _variant(job, 1e30, 1)]
    (final, session), (bad, bad_session) = run_stacked_in_process(members, LM)
    alone, _ = run_in_process(members[0], LM)
    assert final["test_perplexity"] == pytest.approx(alone["test_perplexity"], rel=1e-3)
    assert bad["diverged"] == 1.0 and 1 <= bad["diverged_step"] <= 12
    assert math.isnan(bad["test_perplexity"]) and math.isnan(bad["val_perplexity"])  # as NaN
    assert bad_session.history["diverged"] == {int(bad["diverged_step"]): 1.0}
    assert all(math.isfinite(v) for v in bad_session.history["loss"].values())


def test_trials_that_differ_in_more_than_lr_and_seed_cannot_share_a_stack(corpus_glob,
                                                                          tmp_path):
    a = nano_job(corpus_glob, tmp_path, micro=8, accum=1, steps=4)
    b = nano_job(corpus_glob, tmp_path, micro=8, accum=1, steps=5)
    with pytest.raises(ValueError, match="more than lr and seed"):
        run_stacked_in_process([a, b], LM)
