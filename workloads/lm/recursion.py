"""Test-time recursion at the end of a trial (``training.eval_steps``): the trained model on the
test split again with every CEM sublayer at T_eval steps, eta per step kept as trained
(``kept``) and scaled by T_train / T_eval (``scaled``: the total step T * eta of training), and
the sublayers' energy at every step of the recursion (``workloads.models.test_time``,
``workloads.models.diagnostics``)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable

import torch

from workloads.core.architecture import ModelConfig
from workloads.models.decoder import DecoderLM
from workloads.models.diagnostics import energy_diagnostics
from workloads.models.test_time import Steps, at_steps


def settings(cfg: ModelConfig, eval_steps: list[int]) -> dict[str, Steps]:
    """``{"T<t>_kept": Steps, "T<t>_scaled": Steps}`` for each T_eval ``t`` of ``eval_steps``,
    every CEM sublayer of ``cfg`` at ``t`` steps; none for a model without one. ``scaled``
    multiplies every CEM step size by T_train / t, and exists only where the CEM sublayers train
    at one T_train (the CEM attention's and MLP's steps are equal, or only one is CEM)."""
    attn, mlp = cfg.attention == "cem", cfg.mlp == "cem"
    trained = {t for t, cem in ((cfg.attn_steps, attn), (cfg.mlp_steps, mlp)) if cem}
    out = {}
    for t in eval_steps if trained else ():
        at = {"attn_steps": t if attn else None, "mlp_steps": t if mlp else None}
        out[f"T{t}_kept"] = Steps(**at)
        if len(trained) == 1:
            out[f"T{t}_scaled"] = Steps(**at, step_size_scale=next(iter(trained)) / t)
    return out


def test_time_metrics(model: DecoderLM, eval_steps: list[int], x: torch.Tensor,
                      nll: Callable[[DecoderLM], tuple[float, int]]) -> dict[str, float]:
    """Per setting of ``settings(model.cfg, eval_steps)``:

    - ``test_time/<setting>/perplexity``: exp of the mean next-token NLL that ``nll`` (summed
      nats and token count of a model over the test split) gives the model at the setting
      (infinite past 700 nats a token);
    - ``test_time/<setting>/energy/<attn|mlp>/step<t>`` for t = 0..T_eval: the sublayers'
      energy at iterate x^(t) (Eq. 1 attention, Eq. 7 MLP), the mean over layers and over the
      tokens of ``x`` (B, T) (``energy_diagnostics``).
    """
    out: dict[str, float] = {}
    for name, steps in settings(model.cfg, eval_steps).items():
        changed = at_steps(model, steps)
        total, n = nll(changed)
        nats = total / n  # a diverging recursion can pass exp's range: infinite perplexity
        out[f"test_time/{name}/perplexity"] = math.exp(nats) if nats < 700 else math.inf
        energies: dict[str, list[float]] = defaultdict(list)
        for key, value in energy_diagnostics(changed, x).items():
            if key.startswith("energy/"):  # energy/<kind>/layer<l>/step<t>
                _, kind, _, step = key.split("/")
                energies[f"test_time/{name}/energy/{kind}/{step}"].append(value)
        out.update({k: statistics.fmean(v) for k, v in energies.items()})
    return out
