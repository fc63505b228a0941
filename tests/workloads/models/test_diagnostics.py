"""Energy diagnostics: one energy per layer, sublayer and iterate; preconditioner spectra."""

import math

import torch

from workloads.core.architecture import CEM_BEST
from workloads.models import ModelConfig, build_model
from workloads.models.diagnostics import energy_diagnostics


def test_diagnostics_cover_every_layer_step_and_preconditioner():
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("nano", **CEM_BEST)
    model = build_model(cfg)
    out = energy_diagnostics(model, torch.randint(0, cfg.vocab_size, (2, 16)))
    for layer in range(cfg.n_layer):
        for name in ("attn", "mlp"):
            energies = [out[f"energy/{name}/layer{layer}/step{t}"] for t in range(3)]
            assert all(math.isfinite(e) for e in energies)
        # At initialisation V = 0, so P = diag(softplus(1)): its smallest eigenvalue is log(1+e).
        for head in range(cfg.n_head):
            assert math.isclose(out[f"precond_min_eig/attn/layer{layer}/head{head}"],
                                math.log1p(math.e), rel_tol=1e-5)
        assert math.isclose(out[f"precond_min_eig/mlp/layer{layer}"], math.log1p(math.e),
                            rel_tol=1e-5)
    # Per layer: 2 sublayers x 3 energies, 2 x 2 steps x (descent, energy_fell, update_norm),
    # 2 attention entropies, the spectra.
    assert len(out) == cfg.n_layer * (2 * 3 + 2 * 2 * 3 + 2 + cfg.n_head + 1)


def test_diagnostics_energies_are_those_of_the_sublayers():
    torch.manual_seed(1)
    cfg = ModelConfig.from_preset("nano", attention="cem", mlp="cem", attn_steps=2)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 8))
    out = energy_diagnostics(model, idx)
    h = model.embed_tokens(idx)
    attn = model.blocks[0].attn
    xs = attn.iterates(h)
    for t, x in enumerate(xs):
        assert math.isclose(out[f"energy/attn/layer0/step{t}"],
                            attn.energy(x, h).mean().item(), rel_tol=1e-6)
    assert "energy/mlp/layer0/step1" in out and "energy/mlp/layer0/step2" not in out
    assert not any(k.startswith("precond") for k in out)  # identity preconditioners


def test_descent_and_the_fraction_of_tokens_whose_energy_fell():
    torch.manual_seed(2)
    # Exact gradient steps (no diagonal), small: downhill to first order, and in fact.
    cfg = ModelConfig.from_preset("nano", attention="cem", mlp="cem", attn_steps=2,
                                  attn_step_size=0.05, mlp_step_size=0.05)
    assert cfg.exact_gradient
    model = build_model(cfg).double()
    idx = torch.randint(0, cfg.vocab_size, (2, 12))
    out = energy_diagnostics(model, idx)
    h = model.embed_tokens(idx)
    attn = model.blocks[0].attn
    xs = attn.iterates(h)
    for t in (1, 2):
        # Independently: the finite difference of each token's energy along its step.
        eps = 1e-6
        step = xs[t] - xs[t - 1]
        fd = (attn.energy(xs[t - 1] + eps * step, h) - attn.energy(xs[t - 1] - eps * step, h)
              ) / (2 * eps)
        assert math.isclose(out[f"descent/attn/layer0/step{t}"], fd.mean().item(),
                            rel_tol=1e-5)
        assert out[f"descent/attn/layer0/step{t}"] < 0
        fell = (attn.energy(xs[t], h) < attn.energy(xs[t - 1], h)).double().mean().item()
        assert out[f"energy_fell/attn/layer0/step{t}"] == fell > 0.9
    assert not ModelConfig.from_preset("nano", **CEM_BEST).exact_gradient  # diagonal, Alg. 1


def test_uniform_attention_has_the_entropy_of_a_uniform_distribution_over_the_past():
    # No query (W^Q = 0), no ALiBi slopes, no biases: p_ij = 1 / i over j <= i (1-based), so
    # the mean entropy over tokens is mean_i log(i), whatever the keys.
    torch.manual_seed(3)
    cfg = ModelConfig.from_preset("nano", attention="cem", mlp="cem", attn_steps=2)
    model = build_model(cfg).double()
    for block in model.blocks:
        torch.nn.init.zeros_(block.attn.q_proj.weight)
        block.attn.alibi_slopes.zero_()
    seq = 10
    out = energy_diagnostics(model, torch.randint(0, cfg.vocab_size, (2, seq)))
    expected = sum(math.log(i) for i in range(1, seq + 1)) / seq
    for layer in range(cfg.n_layer):
        for t in (1, 2):
            assert math.isclose(out[f"attn_entropy/attn/layer{layer}/step{t}"], expected,
                                rel_tol=1e-6)
        # W^Q = 0 also makes the attention step (its output map is W^Qᵀ) zero.
        assert out[f"update_norm/attn/layer{layer}/step1"] == 0.0


def test_the_update_norm_is_the_relative_size_of_each_step():
    torch.manual_seed(4)
    cfg = ModelConfig.from_preset("nano", attention="cem", mlp="cem", mlp_steps=2,
                                  mlp_step_size=0.3)
    model = build_model(cfg).double()
    idx = torch.randint(0, cfg.vocab_size, (2, 12))
    out = energy_diagnostics(model, idx)
    h = model.blocks[0].attn(model.embed_tokens(idx))  # the MLP's input in layer 0
    mlp = model.blocks[0].mlp
    gamma = mlp.gate_proj(mlp.norm(h))
    step = 0.3 * (gamma * torch.nn.functional.silu(mlp.norm(h) @ mlp.up_proj.weight.T)
                  ) @ mlp.up_proj.weight
    expected = (step.norm(dim=-1) / h.norm(dim=-1)).mean().item()
    assert math.isclose(out["update_norm/mlp/layer0/step1"], expected, rel_tol=1e-6)
    assert "attn_entropy/mlp/layer0/step1" not in out


def test_llama_sublayers_report_only_their_update_size():
    torch.manual_seed(5)
    cfg = ModelConfig.from_preset("nano")
    model = build_model(cfg).double()
    idx = torch.randint(0, cfg.vocab_size, (2, 12))
    out = energy_diagnostics(model, idx)
    assert sorted(out) == sorted(f"update_norm/{name}/layer{layer}/step1"
                                 for layer in range(cfg.n_layer) for name in ("attn", "mlp"))
    h = model.embed_tokens(idx)
    step = model.blocks[0].attn(h) - h
    assert math.isclose(out["update_norm/attn/layer0/step1"],
                        (step.norm(dim=-1) / h.norm(dim=-1)).mean().item(), rel_tol=1e-6)
