"""``workloads.lm.memory``: ZeRO's model-state arithmetic and an activation bound that holds."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from orchestrator.planning.spec import SpecError, load_spec, parse_spec
from workloads.core.architecture import CEM_BEST
from workloads.lm.memory import activation_bytes, estimate_memory, kernel_bytes
from workloads.models import ModelConfig, build_model
from workloads.models.cem import CEMAttention

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_follow_the_zero_paper(stage):
    cfg = ModelConfig.from_preset("nano")
    psi = sum(p.numel() for p in build_model(cfg).parameters())
    n = 4
    mixed = estimate_memory(cfg, 8, stage, n, "bf16")
    # ZeRO paper Sec. 5: (2 + 2 + 12) psi unsharded; P_os, P_os+g, P_os+g+p shard more.
    assert mixed.optimizer == 12 * psi / (n if stage >= 1 else 1)
    assert mixed.gradients == 2 * psi / (n if stage >= 2 else 1)
    assert mixed.parameters == 2 * psi / (n if stage >= 3 else 1)
    full = estimate_memory(cfg, 8, stage, n, "fp32")
    assert full.parameters + full.gradients + full.optimizer == pytest.approx(
        (4 + 4 + 8) * psi / n if stage == 3 else
        {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n}[stage])
    assert full.total == pytest.approx(full.parameters + full.gradients + full.optimizer
                                       + activation_bytes(cfg, 8, "fp32"))


def saved_for_backward(model: torch.nn.Module, idx: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for one forward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("variant", [{}, {"attention": "cem", "mlp": "cem"}, CEM_BEST])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_activation_estimate_bounds_what_autograd_keeps(variant, precision):
    cfg = ModelConfig.from_preset("micro", **variant)
    torch.manual_seed(0)
    model = build_model(cfg).to({"fp32": torch.float32, "bf16": torch.bfloat16}[precision])
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context_length + 1))
    kept = saved_for_backward(model, idx)
    estimate = activation_bytes(cfg, 2, precision, fused_attention=False)  # as on this CPU
    assert kept <= estimate <= 3 * kept


def test_a_trial_that_cannot_fit_its_gpus_is_refused_in_one_line():
    spec = {"name": "big", "data": {"source": "shakespeare"}, "sizes": ["llama-162m"],
            "variants": {"cem": {"attention": "cem", "mlp": "cem", "attn_steps": 2}},
            "learning_rates": [0.002], "training": {"micro_batch_size": 64, "batch_size": 128},
            "resources": {"num_workers": 2, "use_gpu": True, "gpu_memory_gb": 40}}
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    message = str(e.value)
    assert "\n" not in message and "resources.gpu_memory_gb" in message
    assert "cem@llama-162m needs about" in message and "more than the 40 GiB" in message
    fits = {**spec, "training": {"micro_batch_size": 2, "batch_size": 128}}
    assert parse_spec(fits).resources.gpu_memory_gb == 40
    # Without a GPU memory to check against, nothing is refused.
    assert parse_spec({**spec, "resources": {"use_gpu": True}})


@pytest.mark.parametrize("name", ["fig2a", "fig2c", "fig3a", "fig4", "appendix-256m"])
def test_the_paper_specs_fit_80_gib_gpus(name):
    assert load_spec(ROOT / "experiments" / "paper" / f"{name}.yaml").resources.gpu_memory_gb == 80


@pytest.mark.parametrize("overrides", [{}, {"kq_diag": "shared"}, {"kq_diag": "per_head"},
                                       {"energy_exact": True},
                                       {"energy_exact": True, "update": "newton"}])
def test_the_gpu_estimate_follows_the_kernel_cem_attention_takes(overrides):
    """On a GPU CEM attention keeps per-head scores only where it leaves FlexAttention
    (``uses_flex``, asked about a CUDA input): then at least one (b, K, s, s) bias, else
    at most a shared diagonal's (b, s, s) scores, in the compute dtype (bf16 here), and the
    merge's fp32 q and k."""
    cfg = ModelConfig.from_preset("llama-134m", attention="cem", **overrides)
    b, s, k = 2, cfg.context_length, cfg.n_head
    flex = CEMAttention(cfg).uses_flex(SimpleNamespace(is_cuda=True))
    kept = kernel_bytes(cfg, b, 2, fused_attention=True)
    shared = 2 * b * s * s if cfg.kq_diag == "shared" else 0
    assert kept == (8 * b * s * cfg.d_model + shared if flex else
                    (3 if cfg.update == "newton" else 1) * b * k * s * s * 2)
    assert flex == (overrides in ({}, {"kq_diag": "shared"}, {"energy_exact": True}))
