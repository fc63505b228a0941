"""Models: shapes, causality, parameter accounting, and CEM updates against their formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from workloads.models import ModelConfig, build_model, count_parameters
from workloads.models.cem import CEMMLP, CEMAttention
from workloads.models.position import alibi_slopes

COMBOS = [("llama", "llama"), ("cem", "llama"), ("llama", "cem"), ("cem", "cem")]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize(("attention", "mlp"), COMBOS)
def test_forward_shape_and_causality(attention, mlp):
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("nano", attention=attention, mlp=mlp)
    model = build_model(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, cfg.vocab_size)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
    # Changing tokens 10.. must leave the logits of positions 0..9 untouched.
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


@pytest.mark.parametrize("vocab_size", [512, 8192])  # 300 rows: one block; blocks of 128
def test_scoring_targets_gives_each_positions_nll_from_the_logits(vocab_size):
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("nano", attention="cem", mlp="cem", vocab_size=vocab_size)
    model = build_model(cfg).eval()
    idx, targets = (torch.randint(0, vocab_size, (5, 60)) for _ in range(2))
    with torch.no_grad():
        nll = model(idx, targets)
        logits = model(idx).double()
    # -log softmax at the target, in float64, from the logits path
    expected = logits.logsumexp(-1) - logits.gather(-1, targets[..., None]).squeeze(-1)
    assert nll.shape == (5, 60) and nll.dtype == torch.float32
    torch.testing.assert_close(nll.double(), expected, rtol=1e-5, atol=1e-5)


def test_sequence_longer_than_context_is_rejected():
    cfg = ModelConfig.from_preset("nano")
    with pytest.raises(ValueError, match="context_length"):
        build_model(cfg)(torch.zeros(1, cfg.context_length + 1, dtype=torch.long))


@pytest.mark.parametrize("preset", ["nano", "micro", "llama-134m"])
def test_cem_attention_has_half_and_cem_mlp_two_thirds_of_llama(preset):
    cfg = ModelConfig.from_preset(preset)
    d, f, n = cfg.d_model, cfg.d_mlp, cfg.n_layer
    with torch.device("meta"):
        llama = count_parameters(build_model(cfg))
        cem = count_parameters(build_model(ModelConfig.from_preset(preset, attention="cem",
                                                                   mlp="cem")))
    # Independent formulas: per layer, q/k/v/o (4 D^2) vs tied q/k (2 D^2) + self/cross bias;
    # gate/up/down (3 D F) vs tied gate/up (2 D F); one RMSNorm gain (D) per sublayer.
    assert llama["attention"] == n * (4 * d * d + d)
    assert cem["attention"] == n * (2 * d * d + d + 2)
    assert llama["mlp"] == n * (3 * d * f + d)
    assert cem["mlp"] == n * (2 * d * f + d)
    assert cem["attention"] / llama["attention"] == pytest.approx(0.5, rel=0.01)
    assert cem["mlp"] / llama["mlp"] == pytest.approx(2 / 3, rel=0.01)
    assert llama["embedding"] == cem["embedding"] == 2 * cfg.vocab_size * d
    assert llama["total"] == sum(v for k, v in llama.items() if k != "total")


@pytest.mark.parametrize(("preset", "millions"), [("llama-86m", 86.4), ("llama-108m", 108),
                                                  ("llama-134m", 134.1), ("llama-162m", 162.8)])
def test_paper_table1_llama_sizes(preset, millions):
    with torch.device("meta"):
        total = count_parameters(build_model(ModelConfig.from_preset(preset)))["total"]
    assert total / 1e6 == pytest.approx(millions, rel=0.005)


def test_alibi_slopes_follow_press_et_al():
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    expected_12 = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -k for k in (0.5, 1.5, 2.5, 3.5)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected_12))
    assert alibi_slopes(4).tolist() == [2.0 ** -k for k in (2, 4, 6, 8)]


def _random_(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)


@pytest.mark.parametrize(("n_head", "steps", "step_size"), [(2, 1, 1.0), (3, 2, 0.5), (4, 1, 0.7)])
def test_cem_attention_matches_algorithm_1(n_head, steps, step_size):
    torch.manual_seed(n_head)
    cfg = ModelConfig(d_model=6 * n_head, n_head=n_head, context_length=7, attention="cem",
                      attn_steps=steps, attn_step_size=step_size)
    layer = CEMAttention(cfg).double()
    _random_(layer)
    h = torch.randn(2, 7, cfg.d_model, dtype=torch.float64)
    wq = layer.q_proj.weight.view(n_head, cfg.d_head, cfg.d_model)  # W^Q_k
    wk = layer.k_proj.weight.view(n_head, cfg.d_head, cfg.d_model)  # W^K_k
    g_, eps = layer.norm.weight, layer.norm.eps
    slopes, tau = alibi_slopes(n_head).double(), math.sqrt(cfg.d_head)
    b_self, b_cross = layer.self_bias.item(), layer.cross_bias.item()

    # Token-by-token loops over the formula of docs/DESIGN.md (no SDPA, no masks).
    h_t = rms(h, g_, eps)
    x = h.clone()
    for _ in range(steps):
        u = rms(x, g_, eps)
        new = x.clone()
        for b in range(2):
            for i in range(7):
                g = torch.zeros(cfg.d_model, dtype=torch.float64)
                for k in range(n_head):
                    q = wq[k] @ u[b, i]
                    keys = [wk[k] @ h_t[b, j] for j in range(i + 1)]
                    s = torch.stack([
                        keys[j] @ q / tau - slopes[k] * (i - j) + (b_self if i == j else b_cross)
                        for j in range(i + 1)])
                    p = torch.softmax(s, 0)
                    g += wq[k].T @ sum(p[j] * keys[j] for j in range(i + 1))
                new[b, i] = x[b, i] + step_size * g
        x = new
    torch.testing.assert_close(layer(h), x)


@pytest.mark.parametrize(("steps", "step_size"), [(1, 1.0), (3, 0.4)])
def test_cem_mlp_matches_eq_9_to_11(steps, step_size):
    torch.manual_seed(steps)
    cfg = ModelConfig(d_model=8, n_head=2, d_mlp=20, mlp="cem", mlp_steps=steps,
                      mlp_step_size=step_size)
    layer = CEMMLP(cfg).double()
    _random_(layer)
    h = torch.randn(3, 5, 8, dtype=torch.float64)
    w, v = layer.gate_proj.weight, layer.up_proj.weight  # W, V: (d_mlp, D)
    gamma = rms(h, layer.norm.weight, layer.norm.eps) @ w.T
    x = h
    for _ in range(steps):
        u = rms(x, layer.norm.weight, layer.norm.eps)
        x = x + step_size * (gamma * F.silu(u @ v.T)) @ v  # x + eta V^T (gamma . SiLU(V u))
    torch.testing.assert_close(layer(h), x)
