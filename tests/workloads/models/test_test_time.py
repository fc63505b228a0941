"""Test-time recursion: a trained model run at other recursion steps computes what a model built
at those steps with the same weights computes, and leaves the trained model as it was."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workloads.models import ModelConfig, build_model
from workloads.models.test_time import Steps, at_steps

CEM = {"attention": "cem", "mlp": "cem", "kq_diag": "shared",
       "attn_preconditioner": "diag_lowrank", "mlp_preconditioner": "diag"}


def _trained(cfg: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    return model.eval()


def _same_weights_at(model: torch.nn.Module, **fields) -> torch.nn.Module:
    """Independently: a model built from the changed config, the trained weights loaded."""
    other = build_model(dataclasses.replace(model.cfg, **fields))
    other.load_state_dict(model.state_dict())
    return other.eval()


IDX = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("trained_t", "eval_t"), [(1, 2), (2, 1), (2, 4), (1, 8)])
def test_a_model_runs_at_other_steps_as_one_built_there_with_its_weights(trained_t, eval_t):
    model = _trained(ModelConfig.from_preset("nano", **CEM, attn_steps=trained_t,
                                             mlp_steps=trained_t))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale = trained_t / eval_t  # the rule that keeps the total step
    with torch.no_grad():
        got = at_steps(model, Steps(eval_t, eval_t, scale))(IDX)
        expected = _same_weights_at(model, attn_steps=eval_t, mlp_steps=eval_t,
                                    attn_step_size=scale, mlp_step_size=scale)(IDX)
        as_trained = at_steps(model, Steps())(IDX)
        torch.testing.assert_close(as_trained, model(IDX), rtol=0, atol=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(got, as_trained)  # T and eta matter
    assert model.cfg.attn_steps == trained_t  # the trained model is unchanged
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_learned_step_sizes_are_scaled_and_counts_left_out_stay_as_trained():
    model = _trained(ModelConfig.from_preset("nano", **CEM, learn_step_size=True))
    changed = at_steps(model, Steps(mlp_steps=3, step_size_scale=0.5))
    assert (changed.cfg.attn_steps, changed.cfg.mlp_steps) == (1, 3)
    for (name, p), q in zip(model.named_parameters(), changed.parameters(), strict=True):
        expected = p * 0.5 if name.endswith(".step_size") else p
        torch.testing.assert_close(q, expected, rtol=0, atol=0)


def test_settings_that_cannot_run_are_one_line_errors():
    with pytest.raises(ValueError, match="attn_steps must be >= 1, got 0"):
        Steps(attn_steps=0)
    with pytest.raises(ValueError, match="step_size_scale must be > 0"):
        Steps(step_size_scale=0.0)
    momentum = _trained(ModelConfig.from_preset("nano", **CEM, attn_steps=2, update="momentum"))
    with pytest.raises(ValueError, match="keeps no velocity"):
        at_steps(momentum, Steps(attn_steps=1))
