"""GP-regression data and the stacked recursive CEM MLP (paper App. D)."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from workloads.gp import GPRegressor, gp_flops_per_sample, sample_gp_regression
from workloads.gp.data import gibbs_kernel, rbf_kernel
from workloads.models import ModelConfig


def test_rbf_kernel_matches_its_formula_and_gibbs_is_positive_semidefinite():
    x = torch.randn(50, 10, dtype=torch.float64)
    k = rbf_kernel(x, 3.0)
    i, j = 3, 17
    assert k[i, j] == pytest.approx(math.exp(-((x[i] - x[j]) ** 2).sum().item() / 18.0))
    g = gibbs_kernel(x, 3.0)
    assert torch.allclose(g, g.T) and torch.allclose(g.diagonal(), torch.ones(50,
                                                                               dtype=g.dtype))
    assert torch.linalg.eigvalsh(g).min() > -1e-10
    # Constant length scale (inputs with zero mean) reduces Gibbs to the RBF kernel.
    z = x - x.mean(dim=1, keepdim=True)
    assert torch.allclose(gibbs_kernel(z, 3.0), rbf_kernel(z, 3.0))


@pytest.mark.parametrize("kernel", ["rbf", "nonstationary"])
def test_samples_are_deterministic_split_and_carry_signal(kernel):
    a = sample_gp_regression(kernel, 10, 300, 50, 100, 0.05, seed=1)
    b = sample_gp_regression(kernel, 10, 300, 50, 100, 0.05, seed=1)
    c = sample_gp_regression(kernel, 10, 300, 50, 100, 0.05, seed=2)
    assert torch.equal(a.y["test"], b.y["test"]) and not torch.equal(a.y["test"], c.y["test"])
    assert {s: a.x[s].shape for s in a.x} == {"train": (300, 10), "validation": (50, 10),
                                              "test": (100, 10)}
    assert 0.2 < a.y["train"].var().item() < 3.0  # unit prior variance, plus a little noise
    with pytest.raises(ValueError, match="kernel must be"):
        sample_gp_regression("matern", 10, 3, 1, 1, 0.0, 0)


@pytest.mark.parametrize("steps", [1, 4])
def test_regressor_shapes_parameters_and_analytic_flops(steps):
    cfg = ModelConfig.from_preset("gp-small", mlp_steps=steps)
    model = GPRegressor(cfg, 10)
    x = torch.randn(32, 10)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert model(x).shape == (32,)
    d, f = cfg.d_model, cfg.d_mlp
    per_layer = 2 * d * f + d  # gate_proj, up_proj and the norm: recursion adds none
    expected = (10 * d + d) + cfg.n_layer * per_layer + d + (d + 1)  # in_proj, norm, head
    assert sum(p.numel() for p in model.parameters()) == expected
    assert counter.get_total_flops() == pytest.approx(gp_flops_per_sample(cfg, 10) * 32,
                                                      rel=0.05)


def test_recursion_steps_change_the_function_not_the_parameters():
    torch.manual_seed(0)
    t1 = GPRegressor(ModelConfig.from_preset("gp-small", mlp_steps=1), 10)
    t2 = GPRegressor(ModelConfig.from_preset("gp-small", mlp_steps=2), 10)
    t2.load_state_dict(t1.state_dict())
    x = torch.randn(8, 10)
    assert not torch.allclose(t1(x), t2(x))
