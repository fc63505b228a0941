"""Causality of every model option: changing the tokens at positions >= P leaves the logits of
positions < P bit-identical, for every field of ``ModelConfig`` that changes the computation,
with each CEM attention kernel, with and without gradients (each takes its own kernels), in
fp32 and bf16. A model that lets a position see the next token fails the same check."""

from __future__ import annotations

import contextlib

import pytest
import torch

from workloads.models import ModelConfig, build_model
from workloads.models.cem import CEMAttention

P = 9  # the first changed position
CEM = {"attention": "cem", "mlp": "cem"}
OPTIONS = {
    "llama": {},
    "llama-alibi": {"position": "alibi"},
    "llama-reuse-T2": {"attn_steps": 2, "mlp_steps": 2},
    "cem-attn": {"attention": "cem"},
    "cem-mlp": {"mlp": "cem"},
    "cem": CEM,
    "cem-T2": {**CEM, "attn_steps": 2, "mlp_steps": 2},
    "cem-T3-attn": {**CEM, "attn_steps": 3},
    "cem-layer-reuse": {**CEM, "attn_steps": 2, "mlp_steps": 2, "layer_reuse": True},
    "recursion-from-norm": {**CEM, "attn_steps": 2, "mlp_steps": 2, "recursion_start": "norm_h"},
    "fixed-input-h": {**CEM, "fixed_input": "h"},
    "step-sizes": {**CEM, "attn_steps": 2, "attn_step_size": 0.5, "mlp_step_size": 2.0},
    "learned-step-sizes": {**CEM, "learn_step_size": True},
    "kq-diag-shared": {**CEM, "kq_diag": "shared"},
    "kq-diag-per-head": {**CEM, "kq_diag": "per_head"},
    "energy-exact": {**CEM, "kq_diag": "shared", "energy_exact": True},
    "precond-diag": {**CEM, "attn_preconditioner": "diag", "mlp_preconditioner": "diag"},
    "precond-diag-lowrank": {**CEM, "attn_preconditioner": "diag_lowrank",
                             "mlp_preconditioner": "diag_lowrank", "attn_precond_rank": 2,
                             "mlp_precond_rank": 3},
    "precond-shared-psd-unit": {**CEM, "attn_preconditioner": "diag_lowrank",
                                "attn_precond_placement": "shared", "preconditioner_psd": True,
                                "precond_init": "unit"},
    "momentum": {**CEM, "attn_steps": 2, "update": "momentum"},
    "nesterov": {**CEM, "attn_steps": 2, "update": "nesterov", "momentum": 0.5},
    "momentum-across-layers": {**CEM, "update": "momentum", "momentum_scope": "layer"},
    "newton": {**CEM, "kq_diag": "shared", "energy_exact": True, "update": "newton"},
}
# Every field that changes what is computed, and the sizes, which only scale it.
SIZES = {"vocab_size", "d_model", "n_layer", "n_head", "d_mlp", "context_length"}
NUMERICS = {"rope_theta", "norm_eps", "init_std"}


def test_the_options_cover_every_field_of_the_model_config():
    covered = {name for overrides in OPTIONS.values() for name in overrides}
    assert ModelConfig.field_names() - SIZES - NUMERICS - covered == set()


def _model(overrides: dict, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("nano", **overrides))
    with torch.no_grad():  # every parameter away from its init: diagonals, biases, U and V
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    return model.to(device, dtype)


def assert_causal(model: torch.nn.Module, grad: bool) -> None:
    """Logits before position ``P`` do not move when the tokens from ``P`` on change, and
    those from ``P`` on do."""
    vocab = model.cfg.vocab_size
    idx = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    idx = idx.to(next(model.parameters()).device)
    changed = idx.clone()
    changed[:, P:] = (changed[:, P:] + 1 + torch.arange(16 - P, device=idx.device)) % vocab
    with contextlib.nullcontext() if grad else torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :P], before[:, :P], rtol=0, atol=0)
    assert not torch.equal(after[:, P:], before[:, P:])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("kernel", ["sdpa", "explicit", "flex"])
@pytest.mark.parametrize("option", OPTIONS)
def test_earlier_logits_ignore_later_tokens(option, kernel, grad, dtype, device, monkeypatch):
    overrides = OPTIONS[option]
    if kernel != "sdpa" and overrides.get("attention") != "cem":
        pytest.skip("the kernel choice is CEM attention's")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    if (device, kernel, grad) == ("cpu", "flex", True):
        pytest.skip("FlexAttention has no backward on a CPU: the GPU runs this case")
    monkeypatch.setattr(CEMAttention, "kernel", kernel)
    assert_causal(_model(overrides, dtype, device), grad)


class PeekingAttention(CEMAttention):
    """CEM attention whose score bias lets position i see token i + 1: a leak."""

    def score_bias(self, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        bias = super().score_bias(seq_len, dtype).clone()
        i = torch.arange(seq_len - 1)
        bias[:, i, i + 1] = 0.0
        return bias


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_a_model_that_sees_the_next_token_fails_the_check(grad, monkeypatch):
    monkeypatch.setattr(CEMAttention, "kernel", "sdpa")
    model = _model(CEM, torch.float32)
    for block in model.blocks:
        block.attn.__class__ = PeekingAttention
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_causal(model, grad)
