"""Causality of every model option: a position's logits depend on the tokens up to it and on no
later one.

``assert_causal`` changes one token of each sequence, at a different position ``p`` per sequence,
and checks that

* the logits of every position before ``p`` stay bit-identical (the same shapes run the same
  kernels in the same order, and a masked attention weight is exactly 0, so the equality is
  exact in fp32 and bf16 alike: a tolerance could only hide a small leak, which in bf16 may well
  be below any tolerance loose enough for rounding);
* the logits of ``p`` and of every later position do change (a model that ignored its input, or
  whose attention carried nothing forward, would otherwise pass);
* with gradients, the backward pass is causal too: the gradient of the logits before ``p`` with
  respect to the embeddings from ``p`` on is exactly zero, and nonzero before ``p``.

The configs of ``CONFIGS`` (on the ``nano`` preset) together take every value of every option of
``ModelConfig`` where it changes the computation; ``test_the_configs_cover_every_option``
fails when a new option, or a new value of one, is left out. Each config runs with each CEM
attention kernel that applies to it (``sdpa``, whose CPU path is torch's fused SDPA without
gradients and its math kernel written out with them; ``explicit``; ``flex``, FlexAttention,
which on a CPU runs forward only, so its gradient cases need a GPU), with and without gradients,
in fp32 and bf16: a covering design (the ``MODES_*`` lists), not the full product. The two
``*-long`` configs run 200 positions, more than one 128-wide block of FlexAttention's mask.
Last, deliberately leaky models (a position reading the mean of all positions, attention that
sees the next token, a backward pass that leaks) must fail the same check.
"""

from __future__ import annotations

import contextlib
import typing
from typing import NamedTuple

import pytest
import torch
from torch import nn

from workloads.core import architecture
from workloads.core.architecture import CEM_BEST
from workloads.models import ModelConfig, build_model
from workloads.models.cem import CEMAttention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SEQ_LEN = 16  # positions per sequence; a config that sets context_length runs that many
CEM = {"attention": "cem", "mlp": "cem"}
CONFIGS: dict[str, dict[str, typing.Any]] = {
    # Llama attention: RoPE, ALiBi, plain reuse; with the CEM MLP.
    "llama": {},
    "llama-alibi": {"position": "alibi"},
    "llama-reuse": {"attn_steps": 2, "mlp_steps": 3},
    "llama-alibi-cem-mlp": {"position": "alibi", "mlp": "cem", "mlp_steps": 2,
                            "mlp_preconditioner": "diag", "mlp_step_size": 0.7},
    "llama-long": {"context_length": 200},
    # CEM attention with the Llama MLP, and both sublayers CEM.
    "cem-attn": {"attention": "cem"},
    "cem": CEM,
    "cem-best": CEM_BEST,
    "cem-long": {**CEM, "context_length": 200, "kq_diag": "shared"},
    # Within-layer recursion and its step sizes.
    "cem-T3": {**CEM, "attn_steps": 3, "mlp_steps": 2, "attn_step_size": 0.5,
               "mlp_step_size": 1.5},
    "cem-layer-reuse": {**CEM, "attn_steps": 2, "mlp_steps": 2, "layer_reuse": True,
                        "kq_diag": "shared"},
    "recursion-from-norm": {**CEM, "attn_steps": 2, "mlp_steps": 2,
                            "recursion_start": "norm_h"},
    "fixed-input-h": {**CEM, "attn_steps": 2, "fixed_input": "h", "kq_diag": "shared"},
    "learned-step-sizes": {**CEM, "attn_steps": 2, "learn_step_size": True},
    # The KQ diagonal and the exact energy gradient.
    "kq-diag-per-head": {**CEM, "kq_diag": "per_head"},
    "energy-exact-shared": {**CEM, "kq_diag": "shared", "energy_exact": True},
    "energy-exact-per-head": {**CEM, "attn_steps": 2, "kq_diag": "per_head",
                              "energy_exact": True},
    # Preconditioners: kinds, placement, positive definite form, initialisation, ranks.
    "precond-diag": {**CEM, "attn_preconditioner": "diag", "mlp_preconditioner": "diag"},
    "precond-diag-lowrank": {**CEM, "attn_preconditioner": "diag_lowrank",
                             "mlp_preconditioner": "diag_lowrank", "attn_precond_rank": 2,
                             "mlp_precond_rank": 3},
    "precond-shared-psd-unit": {**CEM, "attn_steps": 2, "attn_preconditioner": "diag_lowrank",
                                "attn_precond_placement": "shared", "preconditioner_psd": True,
                                "precond_init": "unit", "mlp_preconditioner": "diag_lowrank"},
    "precond-shared-diag": {**CEM, "attn_preconditioner": "diag",
                            "attn_precond_placement": "shared", "precond_init": "unit"},
    # Update rules.
    "momentum": {**CEM, "attn_steps": 2, "update": "momentum"},
    "nesterov": {**CEM, "attn_steps": 3, "update": "nesterov", "momentum": 0.5},
    "momentum-across-layers": {**CEM, "update": "momentum", "momentum_scope": "layer"},
    "nesterov-across-layers": {**CEM, "attn_steps": 2, "update": "nesterov",
                               "momentum_scope": "layer", "kq_diag": "shared"},
    "newton": {**CEM, "kq_diag": "shared", "energy_exact": True, "update": "newton"},
    "newton-per-head": {**CEM, "attn_steps": 2, "kq_diag": "per_head", "energy_exact": True,
                        "update": "newton", "attn_preconditioner": "diag"},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Run the module on one CPU thread: at these sizes threads cost more than they save (many
    times more on a busy machine), and no element's value depends on how work is split."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Fields that only scale the computation or its numbers, not what is computed.
SIZES = {"vocab_size", "d_model", "n_layer", "n_head", "d_mlp", "context_length"}
NUMERICS = {"rope_theta", "norm_eps", "init_std"}


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_preset("nano", **CONFIGS[name])


def _matters(cfg: ModelConfig, field: str) -> bool:
    """Whether ``field`` changes what ``cfg``'s model computes (a CEM attention option does not
    in a Llama attention layer, a preconditioner's rank does not without a low-rank part)."""
    cem_attn, cem_mlp = cfg.attention == "cem", cfg.mlp == "cem"
    preconds = ({cfg.attn_preconditioner} if cem_attn else set()) | (
        {cfg.mlp_preconditioner} if cem_mlp else set())
    velocity = cem_attn and cfg.update in ("momentum", "nesterov")
    rules = {
        "position": not cem_attn,  # CEM attention is always ALiBi
        "kq_diag": cem_attn, "attn_preconditioner": cem_attn, "update": cem_attn,
        "attn_step_size": cem_attn,
        "attn_precond_placement": cem_attn and cfg.attn_preconditioner != "identity",
        "attn_precond_rank": cem_attn and cfg.attn_preconditioner == "diag_lowrank",
        "energy_exact": cem_attn and cfg.kq_diag != "none",
        "momentum": velocity, "momentum_scope": velocity,
        "mlp_preconditioner": cem_mlp, "mlp_step_size": cem_mlp,
        "mlp_precond_rank": cem_mlp and cfg.mlp_preconditioner == "diag_lowrank",
        "precond_init": bool(preconds - {"identity"}),
        "preconditioner_psd": "diag_lowrank" in preconds,
        "learn_step_size": cem_attn or cem_mlp,
        "recursion_start": cem_attn or cem_mlp, "fixed_input": cem_attn or cem_mlp,
        "layer_reuse": (cem_attn and cfg.attn_steps > 1) or (cem_mlp and cfg.mlp_steps > 1),
    }
    return rules.get(field, True)


def _kernels_matter(cfg: ModelConfig) -> bool:
    """CEM attention's ``kernel`` only picks the path of CEM attention, and the Newton step
    takes the explicit one whatever is set."""
    return cfg.attention == "cem" and cfg.update != "newton"


class Mode(NamedTuple):
    """How one case runs a model: CEM attention kernel (None: the default, for models where
    it does not matter), gradients on, dtype, device."""

    kernel: str | None
    grad: bool
    dtype: torch.dtype
    device: str = "cpu"

    @property
    def id(self) -> str:
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]
        parts = [self.kernel or "", "grad" if self.grad else "no-grad", dtype, self.device]
        return "-".join(p for p in parts if p)


FP32, BF16 = torch.float32, torch.bfloat16
# Covering design. With CEM attention (its kernel matters) each config runs sdpa and explicit
# each with and without gradients and each in fp32 and bf16 (four runs, a pairwise cover of
# kernel x grad x dtype), FlexAttention forward on a CPU (fp32 or bf16, alternating over the
# configs: it is the slowest CPU case), and on a GPU FlexAttention with gradients plus the
# default ``auto`` kernel of training (FlexAttention, or SDPA for the wide layers) and of
# evaluation (SDPA's fused GPU kernels).
MODES_CEM = [Mode("sdpa", True, FP32), Mode("sdpa", False, BF16), Mode("explicit", True, BF16),
             Mode("explicit", False, FP32)]
MODES_FLEX_CPU = [Mode("flex", False, FP32), Mode("flex", False, BF16)]
MODES_CEM_GPU = [Mode("flex", True, FP32, "cuda"), Mode("auto", True, BF16, "cuda"),
                 Mode("auto", False, BF16, "cuda")]
# Without CEM attention (or with the Newton step), every grad/dtype pair.
MODES_OTHER = [Mode(None, True, FP32), Mode(None, False, FP32), Mode(None, True, BF16),
               Mode(None, False, BF16), Mode(None, True, BF16, "cuda"),
               Mode(None, False, BF16, "cuda")]
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                            reason="needs a GPU: FlexAttention has no backward on a CPU, and "
                            "the GPU's own SDPA and compiled FlexAttention kernels run there only")


def _modes(name: str) -> list[Mode]:
    if not _kernels_matter(_config(name)):
        return MODES_OTHER
    flex = MODES_FLEX_CPU[list(CONFIGS).index(name) % 2]
    return [*MODES_CEM, flex, *MODES_CEM_GPU]


CASES = [(name, mode) for name in CONFIGS for mode in _modes(name)]


def _model(cfg: ModelConfig, dtype: torch.dtype, device: str) -> nn.Module:
    """``cfg``'s model with every parameter moved away from its initialisation (KQ diagonals,
    self/cross biases and the low-rank V start at zero, which would leave their paths idle)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    return model.to(device, dtype)


def _perturbation_points(seq_len: int) -> list[int]:
    """Positions of the changed token, one per sequence: near the start, at a third, two
    thirds and the last position."""
    return [1, seq_len // 3, 2 * seq_len // 3, seq_len - 1]


def assert_causal(model: nn.Module, grad: bool, seq_len: int = SEQ_LEN) -> None:
    """Assert that ``model`` (a ``DecoderLM``: ``cfg``, ``embed_tokens``, ``model(idx)`` ->
    logits) is causal, as the module docstring describes.

    Sequence r of a batch of random tokens has its token at ``points[r]`` replaced by another.
    ``grad``: run in train mode with gradients and check the backward pass too; else in eval
    mode under ``torch.no_grad()`` (each takes its own kernels). Raises AssertionError naming
    the sequence, the position and the size of the violation.
    """
    points = _perturbation_points(seq_len)
    vocab = model.cfg.vocab_size
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (len(points), seq_len), generator=gen)
    changed = idx.clone()
    rows = torch.arange(len(points))
    cols = torch.tensor(points)
    shift = torch.randint(1, vocab, (len(points),), generator=gen)  # never 0: a new token
    changed[rows, cols] = (idx[rows, cols] + shift) % vocab
    idx, changed = idx.to(device), changed.to(device)

    embeddings: list[torch.Tensor] = []

    def keep_embeddings(module, inputs, output):
        output.retain_grad()
        embeddings.append(output)

    model.train(grad)
    hook = model.embed_tokens.register_forward_hook(keep_embeddings) if grad else None
    try:
        with contextlib.nullcontext() if grad else torch.no_grad():
            before, after = model(idx), model(changed)
    finally:
        if hook is not None:
            hook.remove()

    for r, p in enumerate(points):
        early = (after[r, :p] - before[r, :p]).float().abs()
        if not torch.equal(after[r, :p], before[r, :p]):
            first = int(early.amax(-1).nonzero()[0])
            raise AssertionError(
                f"causality: the logits of sequence {r} before position {p} moved when its "
                f"token {p} changed: first at position {first}, max |diff| "
                f"{early.max().item():.3g}")
        for q in range(p, seq_len):
            if torch.equal(after[r, q], before[r, q]):
                raise AssertionError(f"the logits of sequence {r} at position {q} did not move "
                                     f"when its token {p} changed")

    if grad:  # d(logits before p) / d(embedding at or after p) must be exactly zero
        weights = torch.randn(before.shape, generator=gen).to(before.device, before.dtype)
        mask = (torch.arange(seq_len)[None, :] < cols[:, None]).to(device)
        (before * weights * mask[..., None]).sum().backward()
        emb_grad = embeddings[0].grad
        for r, p in enumerate(points):
            late = emb_grad[r, p:].float().abs()
            if late.any():
                raise AssertionError(
                    f"causality of the backward pass: the logits of sequence {r} before position "
                    f"{p} have a gradient with respect to the embeddings from {p} on, max "
                    f"{late.max().item():.3g} at position {p + int(late.amax(-1).nonzero()[0])}")
            if not emb_grad[r, :p].any():
                raise AssertionError(f"no gradient reaches the embeddings of sequence {r} "
                                     f"before position {p}")
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("name", "mode"),
    [pytest.param(name, mode, id=f"{name}-{mode.id}",
                  marks=[NO_GPU] if mode.device == "cuda" else [])
     for name, mode in CASES])
def test_earlier_logits_ignore_later_tokens(name, mode, monkeypatch):
    cfg = _config(name)
    if mode.kernel is not None:
        monkeypatch.setattr(CEMAttention, "kernel", mode.kernel)
    seq_len = cfg.context_length if "context_length" in CONFIGS[name] else SEQ_LEN
    assert_causal(_model(cfg, mode.dtype, mode.device), mode.grad, seq_len)


def _option_values() -> dict[str, tuple]:
    """Every field of ``ModelConfig`` that takes a fixed set of values: the ``Literal`` fields
    (their values from the annotations) and the ``bool`` ones."""
    hints = typing.get_type_hints(ModelConfig)
    values = {}
    for name, hint in hints.items():
        if typing.get_origin(hint) is typing.Literal:
            values[name] = typing.get_args(hint)
        elif hint is bool:
            values[name] = (False, True)
    return values


def test_the_configs_cover_every_option():
    """Every value of every Literal or bool option, and a non-default value of every other
    field (sizes and numerics aside), occurs in some config where it matters; and each such
    value runs with each kernel, with and without gradients, and in both dtypes."""
    values = _option_values()
    literal = {name for name, v in values.items() if not isinstance(v[0], bool)}
    assert literal == set(architecture._CHOICES)  # each Literal option is validated
    for name, kind in architecture._CHOICES.items():
        assert values[name] == typing.get_args(kind)

    seen: dict[tuple[str, typing.Any], set] = {}
    nano = ModelConfig.from_preset("nano")
    changed = set()
    for name, mode in CASES:
        cfg = _config(name)
        for field in ModelConfig.field_names():
            if not _matters(cfg, field):
                continue
            value = getattr(cfg, field)
            levels = seen.setdefault((field, value), set())
            levels |= {("grad", mode.grad), ("dtype", mode.dtype)}
            if mode.kernel is not None:
                levels.add(("kernel", mode.kernel))
            if value != getattr(nano, field):
                changed.add(field)

    missing = [(f, v) for f, vs in values.items() for v in vs if (f, v) not in seen]
    assert missing == [], f"option values that no config exercises: {missing}"
    assert ModelConfig.field_names() - SIZES - NUMERICS - changed == set()
    kernels = {("kernel", k) for k in ("sdpa", "explicit", "flex")}
    every_mode = {("grad", True), ("grad", False), ("dtype", FP32), ("dtype", BF16)}
    for (field, value), levels in seen.items():
        if field not in SIZES | NUMERICS:
            assert every_mode <= levels, (field, value)
            if any(_kernels_matter(_config(n)) and getattr(_config(n), field) == value
                   and _matters(_config(n), field) for n in CONFIGS):
                assert kernels <= levels, (field, value)


# -- deliberately leaky models: the same check must fail on each -------------------------------

class MeanMixingBlock(nn.Module):
    """A block that adds ``scale`` times the mean over all positions of its output to every
    position: each position then reads every later one, by a small amount."""

    def __init__(self, block: nn.Module, scale: float) -> None:
        super().__init__()
        self.block, self.scale = block, scale

    def forward(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        out = self.block(h, carry)
        return out + self.scale * out.mean(dim=1, keepdim=True)


class PeekingAttention(CEMAttention):
    """CEM attention whose score bias lets position i also see position i + 1."""

    def score_bias(self, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        bias = super().score_bias(seq_len, dtype).clone()
        i = torch.arange(seq_len - 1)
        bias[:, i, i + 1] = bias[:, i, i]
        return bias


class _BackwardLeak(torch.autograd.Function):
    """The identity forward; backward adds the mean over positions of the incoming gradient to
    every position's, so the gradient of an early position reaches later inputs."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        return h.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad + 1e-3 * grad.mean(dim=1, keepdim=True)


class BackwardLeakingBlock(nn.Module):
    """A block whose forward pass is causal but whose backward pass is not (``_BackwardLeak``
    on its input)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor, carry: dict | None = None) -> torch.Tensor:
        return self.block(_BackwardLeak.apply(h), carry)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize(("overrides", "dtype", "scale"),
                         [({}, FP32, 1e-6), (CEM, FP32, 1e-6), (CEM, BF16, 1e-2)],
                         ids=["llama-fp32", "cem-fp32", "cem-bf16"])
def test_a_model_that_mixes_in_later_positions_fails_the_check(overrides, dtype, scale, grad):
    """A leak of a millionth of the mean hidden state into the first layer's output is caught
    in fp32; in bf16, whose rounding swallows so small a change, a hundredth is."""
    model = _model(ModelConfig.from_preset("nano", **overrides), dtype, "cpu")
    model.blocks[0] = MeanMixingBlock(model.blocks[0], scale)
    with pytest.raises(AssertionError, match="causality: .* moved"):
        assert_causal(model, grad)


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_attention_that_sees_the_next_token_fails_the_check(kernel, grad, monkeypatch):
    monkeypatch.setattr(CEMAttention, "kernel", kernel)
    model = _model(ModelConfig.from_preset("nano", **CEM), FP32, "cpu")
    model.blocks[1].attn.__class__ = PeekingAttention  # the last layer only
    with pytest.raises(AssertionError, match="causality: .* moved"):
        assert_causal(model, grad)


def test_a_backward_pass_that_leaks_fails_the_check():
    """The forward check alone passes this model: only the gradient check catches it."""
    model = _model(ModelConfig.from_preset("nano", **CEM), FP32, "cpu")
    model.blocks[1] = BackwardLeakingBlock(model.blocks[1])
    assert_causal(model, grad=False)
    with pytest.raises(AssertionError, match="causality of the backward pass"):
        assert_causal(model, grad=True)
