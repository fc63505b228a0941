"""Test-time recursion: a trained model evaluated at another number of recursion steps than it
was trained with: the "new dimension for test-time scaling" the CEM paper leaves for future
work (Sec. 2.3 and its conclusion).

A CEM sublayer's weights do not depend on its number of steps T (Algorithm 1 repeats the same
update), so a model trained at T_train runs at any T_eval with the same weights. Its step size
eta per step is kept as trained, or scaled: ``step_size_scale = T_train / T_eval`` keeps the
total step T * eta of training.
"""

from __future__ import annotations

import dataclasses

import torch

from workloads.models.decoder import DecoderLM, build_model


@dataclasses.dataclass(frozen=True)
class Steps:
    """Recursion at evaluation: ``attn_steps`` and ``mlp_steps`` (None: as trained) and the
    factor on every CEM step size (``step_size_scale``, 1: as trained)."""

    attn_steps: int | None = None
    mlp_steps: int | None = None
    step_size_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("attn_steps", "mlp_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.step_size_scale > 0:
            raise ValueError(f"step_size_scale must be > 0, got {self.step_size_scale}")

    def describe(self, trained: DecoderLM) -> str:
        """e.g. ``T_attn 4, T_mlp 4, eta x 0.5``."""
        cfg = self.config(trained.cfg)
        return (f"T_attn {cfg.attn_steps}, T_mlp {cfg.mlp_steps}, "
                f"eta x {self.step_size_scale:g}")

    def config(self, cfg):
        """``cfg`` at these steps and step sizes.

        Raises:
            ValueError: a setting the model config refuses (e.g. step-scope momentum at T=1).
        """
        return dataclasses.replace(
            cfg, attn_steps=self.attn_steps or cfg.attn_steps,
            mlp_steps=self.mlp_steps or cfg.mlp_steps,
            attn_step_size=cfg.attn_step_size * self.step_size_scale,
            mlp_step_size=cfg.mlp_step_size * self.step_size_scale)


def at_steps(model: DecoderLM, steps: Steps) -> DecoderLM:
    """``model`` run at ``steps``: a new ``DecoderLM`` with the same weights (copied; learnable
    step sizes scaled by ``steps.step_size_scale``), on its device and in its dtype, in eval
    mode. ``model`` itself is unchanged.

    Raises:
        ValueError: a setting the model config refuses.
    """
    weight = next(model.parameters())
    changed = build_model(steps.config(model.cfg)).to(weight.device, weight.dtype)
    changed.load_state_dict(model.state_dict())
    if model.cfg.learn_step_size and steps.step_size_scale != 1.0:
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if name.endswith(".step_size"):
                    p.mul_(steps.step_size_scale)
    return changed.eval()
