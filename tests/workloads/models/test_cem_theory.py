"""The theory made binding: CEM steps against autograd on their energies (float64).

Every test builds layers with random weights, so a step that only looks right at initialisation
would fail here.
"""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.attention.flex_attention as flex_attention_module
import torch.nn.functional as F
from scipy.integrate import quad

from workloads.models import ModelConfig
from workloads.models.cem import CEMMLP, CEMAttention
from workloads.models.energy import (
    elementwise_energy,
    interaction_energy,
    interaction_scores,
    silu_integral,
)
from workloads.models.flex import alibi_flex_attention
from workloads.models.llama import LlamaAttention, LlamaMLP
from workloads.models.position import alibi_bias, alibi_slopes, sdpa_mask, sdpa_math
from workloads.models.precond import Preconditioner

SHAPES = [(2, 1, 5), (4, 2, 6), (3, 3, 4), (6, 1, 3)]  # (n_head, batch, seq_len); d_head = 4


def make(cls, seed: int, positive_norm: bool = False, **overrides):
    torch.manual_seed(seed)
    base = {"d_model": 4 * overrides.get("n_head", 2), "d_mlp": 12, "context_length": 16}
    layer = cls(ModelConfig(**{**base, **overrides})).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "norm.weight":
                p.copy_(1 + 0.1 * torch.rand_like(p) if positive_norm else torch.randn_like(p))
            elif "precond.p" in name:
                p.normal_(0.3, 0.2)
            else:
                p.normal_(0, 0.4)
    return layer


def descent_step(layer, x, h, eta, precond=None):
    """x + eta sum_k P_k (-grad_u eps_k(u)), u = norm(x), by autograd on ``layer.energy``."""
    u = layer.norm(x).detach().requires_grad_(True)
    h_norm = h if layer.cfg.fixed_input == "h" else layer.norm(h)  # the fixed side's input
    if isinstance(layer, CEMAttention):
        energies = interaction_energy(u, h_norm, layer._w(layer.q_proj), layer._w(layer.k_proj),
                                      layer._diag(), layer.score_bias(h.shape[1], h.dtype),
                                      per_head=True)  # (B, T, K)
        grads = torch.stack([-torch.autograd.grad(energies[..., k].sum(), u, retain_graph=True)[0]
                             for k in range(energies.shape[-1])], dim=2)  # (B, T, K, D)
    else:
        energy = elementwise_energy(u, layer.gate_proj(h_norm), layer.up_proj.weight)
        grads = -torch.autograd.grad(energy.sum(), u)[0][:, :, None]  # (B, T, 1, D)
    if precond is not None:
        if precond.p.shape[0] == 1:  # one shared P, after the head sum
            grads = grads.sum(2, keepdim=True)
        grads = precond(grads)
    return x + eta * grads.sum(2)


@pytest.mark.parametrize(("shape", "diag", "precond", "psd"), [
    (s, d, p, psd) for s, d, (p, psd) in itertools.product(
        SHAPES, ["none", "shared", "per_head"],
        [("identity", False), ("diag", False), ("diag_lowrank", False), ("diag_lowrank", True)])
])
def test_exact_attention_steps_are_preconditioned_autograd_descent(shape, diag, precond, psd):
    n_head, batch, seq = shape
    layer = make(CEMAttention, seed=n_head + seq, n_head=n_head, attention="cem", attn_steps=2,
                 attn_step_size=0.7, kq_diag=diag, attn_preconditioner=precond,
                 preconditioner_psd=psd, energy_exact=True)
    h = torch.randn(batch, seq, layer.cfg.d_model, dtype=torch.float64)
    xs = layer.iterates(h)
    for t in range(2):  # keys stay those of h: every step descends the same energy
        expected = descent_step(layer, xs[t], h, 0.7, layer.precond)
        torch.testing.assert_close(xs[t + 1], expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("diag", "precond", "psd"), [
    (d, p, psd) for d, (p, psd) in itertools.product(
        ["none", "per_head"], [("diag", False), ("diag_lowrank", False), ("diag_lowrank", True)])
])
def test_a_shared_preconditioner_is_one_p_after_the_head_sum(diag, precond, psd):
    layer = make(CEMAttention, seed=5, n_head=3, attention="cem", attn_steps=2,
                 attn_step_size=0.7, kq_diag=diag, attn_preconditioner=precond,
                 preconditioner_psd=psd, energy_exact=True, attn_precond_placement="shared")
    assert layer.precond.p.shape == (1, layer.cfg.d_model)  # one P, not one per head
    h = torch.randn(2, 5, layer.cfg.d_model, dtype=torch.float64)
    xs = layer.iterates(h)
    for t in range(2):
        torch.testing.assert_close(xs[t + 1], descent_step(layer, xs[t], h, 0.7, layer.precond),
                                   rtol=1e-6, atol=1e-9)


def test_only_a_shared_positive_definite_p_guarantees_a_descent_direction():
    ascents = {}
    for placement in ("per_head", "shared"):
        ascents[placement] = 0
        for seed in range(100):
            layer = make(CEMAttention, seed=seed, n_head=2, attention="cem", kq_diag="shared",
                         attn_preconditioner="diag_lowrank", preconditioner_psd=True,
                         energy_exact=True, attn_precond_placement=placement)
            with torch.no_grad():
                layer.precond.lowrank_u.normal_(0, 2.0)  # every P (P_k) positive definite
            h = torch.randn(2, 8, layer.cfg.d_model, dtype=torch.float64)
            u = layer.norm(h).detach().requires_grad_(True)
            energy = interaction_energy(u, layer.norm(h), layer._w(layer.q_proj),
                                        layer._w(layer.k_proj), layer._diag(),
                                        layer.score_bias(8, h.dtype))
            (grad,) = torch.autograd.grad(energy.sum(), u)
            direction = layer.direction(h, *layer.fixed_side(h), layer.score_bias(8, h.dtype))
            ascents[placement] += int(((grad * direction).sum(-1) > 0).any())
    assert ascents["shared"] == 0  # <grad, -P grad> <= 0 for every token
    assert ascents["per_head"] > 0  # sum_k P_k g_k: some tokens go uphill


@pytest.mark.parametrize(("shape", "diag"),
                         list(itertools.product(SHAPES, ["shared", "per_head"])))
def test_paper_attention_step_matches_algorithm_1(shape, diag):
    n_head, batch, seq = shape
    layer = make(CEMAttention, seed=seq, n_head=n_head, attention="cem", kq_diag=diag)
    h = torch.randn(batch, seq, layer.cfg.d_model, dtype=torch.float64)
    h_norm, u = layer.norm(h), layer.norm(h)
    s = interaction_scores(u, h_norm, layer._w(layer.q_proj), layer._w(layer.k_proj),
                           layer._diag(), layer.score_bias(seq, h.dtype))
    keys = torch.einsum("kcd,btd->bktc", layer._w(layer.k_proj), h_norm)
    o = torch.softmax(s, -1) @ keys  # values are the keys; no D_k h~ term (Algorithm 1)
    expected = h + torch.einsum("bktc,kcd->btd", o, layer._w(layer.q_proj))
    torch.testing.assert_close(layer(h), expected, rtol=1e-6, atol=1e-9)
    exact = make(CEMAttention, seed=seq, n_head=n_head, attention="cem", kq_diag=diag,
                 energy_exact=True)
    assert not torch.allclose(exact(h), layer(h))  # the dropped term matters


@pytest.mark.parametrize(("precond", "psd"), [("identity", False), ("diag", False),
                                               ("diag_lowrank", False), ("diag_lowrank", True)])
def test_mlp_steps_are_preconditioned_autograd_descent(precond, psd):
    layer = make(CEMMLP, seed=3, mlp="cem", mlp_steps=3, mlp_step_size=0.6,
                 mlp_preconditioner=precond, preconditioner_psd=psd)
    h = torch.randn(2, 5, layer.cfg.d_model, dtype=torch.float64)
    xs = layer.iterates(h)
    for t in range(3):
        torch.testing.assert_close(xs[t + 1], descent_step(layer, xs[t], h, 0.6, layer.precond),
                                   rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("cls", "overrides"), [
    (CEMAttention, {"attention": "cem", "kq_diag": "none", "n_head": 2}),
    (CEMAttention, {"attention": "cem", "kq_diag": "shared", "energy_exact": True, "n_head": 3}),
    (CEMAttention, {"attention": "cem", "kq_diag": "per_head", "energy_exact": True,
                    "n_head": 2}),
    (CEMMLP, {"mlp": "cem"}),
])
def test_small_steps_lower_the_energy(cls, overrides):
    steps = {"attn_steps": 4, "attn_step_size": 0.01} if cls is CEMAttention else {
        "mlp_steps": 4, "mlp_step_size": 0.01}
    layer = make(cls, seed=7, positive_norm=True, **overrides, **steps)
    with torch.no_grad():
        layer.norm.weight.fill_(1.0)  # J_norm = (I - x xᵀ/|x|^2)/rms: descent needs no skew
    h = torch.randn(3, 6, layer.cfg.d_model, dtype=torch.float64)
    energies = [layer.energy(x, h) for x in layer.iterates(h)]
    for before, after in zip(energies, energies[1:]):
        assert (after <= before + 1e-12).all()
        assert after.sum() < before.sum()


def test_one_step_is_a_tied_pre_norm_llama_layer_with_alibi():
    cem_attn = make(CEMAttention, seed=11, attention="cem", n_head=3)
    llama = LlamaAttention(ModelConfig(d_model=12, n_head=3, context_length=16,
                                       position="alibi")).double()
    cem_mlp = make(CEMMLP, seed=12, mlp="cem", d_model=12, n_head=3)
    llama_mlp = LlamaMLP(ModelConfig(d_model=12, n_head=3, d_mlp=12)).double()
    with torch.no_grad():  # Eq. 5: W^V = W^K, W^O = W^Qᵀ; Eq. 11: W^d = Vᵀ, W^u = V, W^g = W
        llama.norm.weight.copy_(cem_attn.norm.weight)
        llama.q_proj.weight.copy_(cem_attn.q_proj.weight)
        llama.k_proj.weight.copy_(cem_attn.k_proj.weight)
        llama.v_proj.weight.copy_(cem_attn.k_proj.weight)
        llama.o_proj.weight.copy_(cem_attn.q_proj.weight.T)
        llama.self_bias.copy_(cem_attn.self_bias)
        llama.cross_bias.copy_(cem_attn.cross_bias)
        llama_mlp.norm.weight.copy_(cem_mlp.norm.weight)
        llama_mlp.gate_proj.weight.copy_(cem_mlp.gate_proj.weight)
        llama_mlp.up_proj.weight.copy_(cem_mlp.up_proj.weight)
        llama_mlp.down_proj.weight.copy_(cem_mlp.up_proj.weight.T)
    h = torch.randn(2, 9, 12, dtype=torch.float64)
    torch.testing.assert_close(cem_attn(h), llama(h))
    torch.testing.assert_close(cem_mlp(h), llama_mlp(h))


def _outputs_and_gradients(layer: CEMAttention, h: torch.Tensor, kernel: str,
                           monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(CEMAttention, "kernel", kernel)
    layer.zero_grad()
    x = h.clone().requires_grad_(True)
    out = layer(x)
    out.square().sum().backward()
    return [out, x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("diag", "exact"), [("none", False), ("shared", True),
                                             ("per_head", True), ("shared", False)])
def test_fused_paths_equal_the_explicit_path(kernel, diag, exact, dtype, monkeypatch):
    """SDPA and FlexAttention against scores-softmax-sum, outputs and every gradient (the
    learned self/cross bias and the diagonal's included), with T = 2 steps."""
    if kernel == "flex":
        # torch refuses FlexAttention's backward on a CPU because its compiled CPU kernel has
        # none; the eager implementation it would run is the device-independent one that eager
        # CUDA runs too, so the kernel's math (score_mod, block mask, bias gradients) is held
        # to the reference here. The compiled GPU kernel: the CUDA test below.
        monkeypatch.setattr(flex_attention_module, "_validate_device", lambda *_: None)
    layer = make(CEMAttention, seed=5, attention="cem", n_head=2, kq_diag=diag, attn_steps=2,
                 energy_exact=exact, attn_preconditioner="diag_lowrank").to(dtype)
    h = torch.randn(2, 7, layer.cfg.d_model, dtype=dtype)
    fused = _outputs_and_gradients(layer, h, kernel, monkeypatch)
    explicit = _outputs_and_gradients(layer, h, "explicit", monkeypatch)
    for a, b in zip(fused, explicit, strict=True):
        # fp32: to 1e-5 of the tensor's largest entry (gradients reach ~1e3 here, and a small
        # entry of a large gradient carries the large one's rounding)
        tol = ({} if dtype == torch.float64
               else {"rtol": 1e-5, "atol": 1e-5 * b.abs().max().item()})
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batched_mask", [False, True])
def test_written_out_math_kernel_is_sdpa_bit_for_bit(dtype, batched_mask):
    """Training on a CPU, CEM attention runs SDPA's math kernel written out (``sdpa_math``,
    without its guard for rows that see no key): the same outputs and gradients as
    ``F.scaled_dot_product_attention`` with a causal float mask that needs a gradient, to the
    bit, for a (K, T, T) mask and a (B, K, T, T) one (the shared diagonal's scores)."""
    gen = torch.Generator().manual_seed(0)
    b, k, t, e = 2, 3, 16, 8
    q, key, v = (torch.randn(b, k, t, e, generator=gen).to(dtype).requires_grad_()
                 for _ in range(3))
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    mask = torch.randn(*((b,) if batched_mask else ()), k, t, t, generator=gen)
    mask = mask.masked_fill(causal, float("-inf")).to(dtype).requires_grad_()
    grad = torch.randn(b, k, t, e, generator=gen).to(dtype)
    results = []
    for attend in (lambda: F.scaled_dot_product_attention(q, key, v, attn_mask=sdpa_mask(mask),
                                                          scale=0.3),
                   lambda: sdpa_math(q, key, v, mask, 0.3)):
        out = attend()
        results.append([out, *torch.autograd.grad(out, (q, key, v, mask), grad)])
    for written_out, sdpa in zip(results[1], results[0], strict=True):
        assert torch.equal(written_out, sdpa)


@pytest.mark.parametrize("attention", ["cem", "llama"])
def test_without_gradients_the_alibi_bias_takes_the_fused_cpu_kernel(attention, monkeypatch):
    """Evaluation: the (K, T, T) ALiBi + self/cross bias reaches SDPA as a 4-D mask, which
    torch's CPU flash kernel takes (given a 3-D one, torch ran the math kernel: CEM attention's
    evaluation took 2x Llama's at ``micro``), and the result equals scores-softmax-sum in fp32."""
    cls = CEMAttention if attention == "cem" else LlamaAttention
    layer = make(cls, seed=5, attention=attention, position="alibi", n_head=2).float()
    h = torch.randn(2, 7, 8)  # d_model 8: make's 4 per head
    with torch.no_grad(), torch.profiler.profile() as prof:
        fused = layer(h)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, sorted(ops)
    assert "aten::_softmax" not in ops  # the math kernel's softmax
    with torch.no_grad():
        bias = alibi_bias(layer.alibi_slopes, 7, layer.self_bias, layer.cross_bias)
        if attention == "cem":
            monkeypatch.setattr(CEMAttention, "kernel", "explicit")
            reference = layer(h)
        else:  # Llama's attention written out: scores, softmax, weighted sum, o_proj
            x = layer.norm(h)
            q, k, v = (layer._heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
            p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(layer.d_head) + bias, dim=-1)
            reference = h + layer.o_proj((p @ v).transpose(1, 2).reshape(h.shape))
    torch.testing.assert_close(fused, reference, rtol=1e-5,
                               atol=1e-5 * reference.abs().max().item())


def test_flexattention_is_taken_only_where_it_can_train(monkeypatch):
    layer = make(CEMAttention, seed=1, attention="cem")
    h = torch.randn(1, 4, layer.cfg.d_model, dtype=torch.float64)
    assert not layer.uses_flex(h)  # auto on a CPU: SDPA (FlexAttention has no CPU backward)
    monkeypatch.setattr(CEMAttention, "kernel", "flex")
    assert layer.uses_flex(h)
    newton = make(CEMAttention, seed=1, attention="cem", update="newton", energy_exact=True)
    assert not newton.uses_flex(h)  # the Newton step needs the probabilities


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("diag", ["none", "shared"])
def test_compiled_flex_attention_on_a_gpu_matches_the_reference(diag, monkeypatch):
    """``kernel = "auto"`` trains with compiled FlexAttention on CUDA: in fp32 it equals the
    explicit path to 1e-4 of each tensor's scale (outputs and every gradient; the shared
    diagonal's scores get theirs as atomic adds from every head, in no fixed order), and it
    runs in bf16. (In bf16 this random layer is ill-conditioned: SDPA and FlexAttention both
    sit 13-17 % of the scale from fp32, measured with the eager kernels on a CPU.)"""
    layer = make(CEMAttention, seed=5, attention="cem", n_head=4, d_model=64,
                 context_length=128, kq_diag=diag, attn_steps=2,
                 attn_preconditioner="diag_lowrank").cuda().float()
    h = torch.randn(2, 128, 64, device="cuda")
    assert layer.uses_flex(h)
    with torch.no_grad():
        assert not layer.uses_flex(h)  # evaluation and generation keep SDPA
    reference = [t.detach().clone() for t in
                 _outputs_and_gradients(layer, h, "explicit", monkeypatch)]
    flex = _outputs_and_gradients(layer, h, "auto", monkeypatch)
    for a, b in zip(flex, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    bf16 = _outputs_and_gradients(layer.bfloat16(), h.bfloat16(), "auto", monkeypatch)
    assert all(torch.isfinite(t).all() for t in bf16)
    for wide in ({"kq_diag": "per_head"}, {"kq_diag": "shared", "energy_exact": True}):
        # d_model extra columns in q, k or v: SDPA (they overflow the kernel's shared memory)
        assert not make(CEMAttention, seed=5, attention="cem", **wide).cuda().uses_flex(h)


def _bf16_flex_and_fp32_reference(device: str) -> tuple[list, list]:
    """Outputs and every gradient of ``alibi_flex_attention`` on bf16 inputs, the shared scores
    c_ij among them, and of the explicit path (scores, softmax, weighted sum) computed in fp32
    from the same bf16 values. Batch 2, 4 heads of 64 over 256 tokens."""
    gen = torch.Generator(device=device).manual_seed(0)
    b, k, t, e = 2, 4, 256, 64

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen).bfloat16()

    inputs = [rand(*s).requires_grad_() for s in [(b, k, t, e)] * 3 + [(b, t, t)]]
    inputs += [torch.tensor([x], device=device).bfloat16().requires_grad_() for x in (0.5, -0.25)]
    slopes, grad = alibi_slopes(k).to(device), rand(b, k, t, e)
    out = alibi_flex_attention(*inputs[:3], slopes, *inputs[4:], e**-0.5, inputs[3])
    flex = [out, *torch.autograd.grad(out, inputs, grad)]
    q, key, v, shared, self_bias, cross_bias = fp32 = [
        x.detach().float().requires_grad_() for x in inputs]
    scores = (q @ key.transpose(-1, -2) * e**-0.5 + shared[:, None]
              + alibi_bias(slopes, t, self_bias, cross_bias))
    out = torch.softmax(scores, dim=-1) @ v
    return flex, [out, *torch.autograd.grad(out, fp32, grad.float())]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU")
def test_compiled_flex_reads_bf16_shared_scores_to_bf16_accuracy():
    """Training in bf16, the compiled kernel reads the shared diagonal's scores c_ij in bf16, as
    the bf16 product computed them, and adds up their gradient from the heads in fp32: its
    outputs and every gradient are the fp32 explicit path's on the same bf16 values, to 2 % of
    each tensor's scale (bf16 keeps 8 bits: 0.4 % per rounding)."""
    for a, b in zip(*_bf16_flex_and_fp32_reference("cuda"), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@pytest.mark.parametrize("diag", ["none", "shared"])
def test_newton_step_is_the_first_neumann_term(diag):
    eta = 0.3
    layer = make(CEMAttention, seed=9, attention="cem", n_head=2, kq_diag=diag,
                 energy_exact=True, update="newton", attn_step_size=eta)
    h = torch.randn(1, 4, layer.cfg.d_model, dtype=torch.float64)
    h_norm, bias = layer.norm(h), layer.score_bias(4, h.dtype)

    def energy(u):
        return interaction_energy(u, h_norm, layer._w(layer.q_proj), layer._w(layer.k_proj),
                                  layer._diag(), bias).sum()

    u = layer.norm(h).detach()
    g = -torch.autograd.functional.jacobian(energy, u)
    hess = torch.autograd.functional.hessian(energy, u).reshape(u.numel(), u.numel())
    expected = h + eta * (g - eta * (hess @ g.reshape(-1)).view_as(g))  # eta (I - eta H) g
    torch.testing.assert_close(layer(h), expected, rtol=1e-6, atol=1e-9)


def test_momentum_and_nesterov_follow_their_recurrences():
    mu, eta = 0.8, 0.5
    gd = make(CEMAttention, seed=4, attention="cem", n_head=2, attn_steps=2, attn_step_size=eta)
    h = torch.randn(2, 5, gd.cfg.d_model, dtype=torch.float64)
    h_norm, k = gd.fixed_side(h)
    bias = gd.score_bias(5, h.dtype)

    def d(x):
        return gd.direction(x, h_norm, k, bias)

    for rule in ("momentum", "nesterov"):
        layer = make(CEMAttention, seed=4, attention="cem", n_head=2, attn_steps=2,
                     attn_step_size=eta, update=rule, momentum=mu)
        v1 = d(h)
        x1 = h + eta * v1
        v2 = mu * v1 + (d(x1 + eta * mu * v1) if rule == "nesterov" else d(x1))
        torch.testing.assert_close(layer(h), x1 + eta * v2)
    # T = 1 within a layer would be plain descent, silently: refused.
    with pytest.raises(ValueError, match="keeps no velocity"):
        make(CEMAttention, seed=4, attention="cem", n_head=2, update="momentum")


def test_layer_scope_momentum_carries_the_velocity_to_the_next_layer():
    mu = 0.5
    layer = make(CEMAttention, seed=2, attention="cem", n_head=2, update="momentum",
                 momentum=mu, momentum_scope="layer")
    h = torch.randn(1, 4, layer.cfg.d_model, dtype=torch.float64)
    carry: dict = {}
    x1 = layer(h, carry)
    v1 = carry["attn_velocity"]
    x2 = layer(x1, carry)
    h_norm, k = layer.fixed_side(x1)
    expected_v2 = mu * v1 + layer.direction(x1, h_norm, k, layer.score_bias(4, h.dtype))
    torch.testing.assert_close(x2, x1 + expected_v2)
    torch.testing.assert_close(layer(h), x1)  # without a carry: per-layer velocity from zero


@pytest.mark.parametrize(("cls", "kind"), [(CEMAttention, "attention"), (CEMMLP, "mlp"),
                                           (LlamaAttention, "attention"), (LlamaMLP, "mlp")])
def test_plain_layer_reuse_applies_the_whole_sublayer_again(cls, kind):
    cem = cls in (CEMAttention, CEMMLP)
    overrides = {kind: "cem"} if cem else {}
    steps_key = "attn_steps" if kind == "attention" else "mlp_steps"
    once = make(cls, seed=6, n_head=2, **overrides)
    twice = make(cls, seed=6, n_head=2, **overrides, **{steps_key: 2}, layer_reuse=cem)
    h = torch.randn(2, 5, 8, dtype=torch.float64)  # d_model = 4 * n_head
    torch.testing.assert_close(twice(h), once(once(h)))
    if cem:  # and differs from within-layer recursion, whose fixed side stays that of h
        recursion = make(cls, seed=6, n_head=2, **overrides, **{steps_key: 2})
        assert not torch.allclose(recursion(h), twice(h))


def test_silu_integral_against_numerical_integration():
    # phi(x) = int_0^x z sigmoid(z) dz, by adaptive quadrature: independent of the closed form.
    x = np.concatenate([np.linspace(-40, 40, 161), [-0.49, -1e-3, 1e-4, 0.49, 0.51]])
    ref = np.array([quad(lambda z: z / (1 + math.exp(-z)), 0, v, epsabs=1e-13, limit=200)[0]
                    for v in x])
    for dtype, rtol in ((torch.float64, 1e-8), (torch.float32, 3e-6)):
        got = silu_integral(torch.tensor(x, dtype=dtype)).double().numpy()
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-12)


def test_silu_integral_forward_differentiates_to_silu_and_backward_agrees():
    # The forward's own central differences (not the hand-written backward) give SiLU ...
    x = torch.linspace(-8, 8, 101, dtype=torch.float64)
    h = 1e-5
    numeric = (silu_integral(x + h) - silu_integral(x - h)) / (2 * h)
    torch.testing.assert_close(numeric, x * torch.sigmoid(x), rtol=1e-7, atol=1e-9)
    # ... and the backward agrees with the forward's numerical derivative.
    assert torch.autograd.gradcheck(silu_integral, (x[::10].clone().requires_grad_(),))


def test_preconditioner_init_and_definiteness():
    p = Preconditioner("diag_lowrank", dim=8, rank=4, groups=3).double()
    torch.testing.assert_close(p.diagonal(), torch.full((3, 8), math.log1p(math.e),
                                                        dtype=torch.float64))
    assert (p.lowrank_v == 0).all() and abs(p.lowrank_u.std().item() - 0.02) < 0.01
    with torch.no_grad():
        p.lowrank_u.normal_(0, 2.0)
        p.lowrank_v.normal_(0, 2.0)
    assert (p.min_eigenvalue() < 0).any()  # UVᵀ + VUᵀ is indefinite once V moves
    psd = Preconditioner("diag_lowrank", dim=8, rank=4, groups=3, psd=True).double()
    with torch.no_grad():
        psd.lowrank_u.normal_(0, 2.0)
    assert (psd.min_eigenvalue() > 0).all()
    g = torch.randn(5, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(psd(g), torch.einsum("gij,bgj->bgi", psd.matrix(), g))


@pytest.mark.parametrize("psd", [False, True])
def test_preconditioner_against_its_dense_formula(psd):
    # diag(softplus(sqrt(D) p)) + U Vᵀ + V Uᵀ (or + U Uᵀ), written out per group by hand.
    torch.manual_seed(0)
    pre = Preconditioner("diag_lowrank", dim=6, rank=2, groups=3, psd=psd).double()
    with torch.no_grad():
        pre.p.normal_(0, 1.0)
        pre.lowrank_u.normal_(0, 1.0)
        if not psd:
            pre.lowrank_v.normal_(0, 1.0)
    g = torch.randn(4, 3, 6, dtype=torch.float64)
    for k in range(3):
        u = pre.lowrank_u[k]
        v = u if psd else pre.lowrank_v[k]
        low = u @ u.T if psd else u @ v.T + v @ u.T
        dense = torch.diag(torch.log1p(torch.exp(math.sqrt(6) * pre.p[k]))) + low
        torch.testing.assert_close(pre(g)[:, k], g[:, k] @ dense.T)


def test_learnable_step_size_is_trained():
    layer = make(CEMMLP, seed=1, mlp="cem", learn_step_size=True, mlp_steps=2)
    assert isinstance(layer.step_size, torch.nn.Parameter)
    layer(torch.randn(1, 3, layer.cfg.d_model, dtype=torch.float64)).sum().backward()
    assert layer.step_size.grad is not None and layer.step_size.grad.abs().item() > 0


@pytest.mark.parametrize("cls", [CEMAttention, CEMMLP])
def test_the_recursion_can_start_at_the_normalised_input(cls):
    # Algorithm 1 read literally: h <- RMSNorm(h); x <- h; keys (gamma) from the same RMSNorm(h).
    kind = {"attention": "cem"} if cls is CEMAttention else {"mlp": "cem"}
    steps = {"attn_steps": 2} if cls is CEMAttention else {"mlp_steps": 2}
    layer = make(cls, seed=8, positive_norm=True, recursion_start="norm_h", **kind, **steps)
    h = 3.0 * torch.randn(2, 5, layer.cfg.d_model, dtype=torch.float64)
    xs = layer.iterates(h)
    torch.testing.assert_close(xs[0], layer.norm(h))
    for t in range(2):  # still descent on the energy given h
        torch.testing.assert_close(xs[t + 1], descent_step(layer, xs[t], h, 1.0),
                                   rtol=1e-6, atol=1e-9)
    start_at_h = make(cls, seed=8, positive_norm=True, **kind, **steps)
    assert not torch.allclose(start_at_h(h), layer(h))


@pytest.mark.parametrize("cls", [CEMAttention, CEMMLP])
def test_the_fixed_side_can_take_the_residual_stream_unnormalised(cls):
    # Keys (= values) and gamma from h itself: still descent on the energy given h.
    kind = ({"attention": "cem", "attn_steps": 2, "kq_diag": "shared", "energy_exact": True}
            if cls is CEMAttention else {"mlp": "cem", "mlp_steps": 2})
    layer = make(cls, seed=9, positive_norm=True, fixed_input="h", **kind)
    h = 3.0 * torch.randn(2, 5, layer.cfg.d_model, dtype=torch.float64)
    xs = layer.iterates(h)
    for t in range(2):
        torch.testing.assert_close(xs[t + 1], descent_step(layer, xs[t], h, 1.0),
                                   rtol=1e-6, atol=1e-9)
    normalised = make(cls, seed=9, positive_norm=True, **kind)
    assert not torch.allclose(normalised(h), layer(h))


def test_a_unit_preconditioner_init_is_the_identity():
    unit = Preconditioner("diag_lowrank", dim=8, rank=2, groups=2, init="unit").double()
    torch.testing.assert_close(unit.diagonal(), torch.ones(2, 8, dtype=torch.float64))
    paper = Preconditioner("diag", dim=8, rank=2)
    assert math.isclose(paper.diagonal()[0, 0].item(), math.log1p(math.e), rel_tol=1e-6)
