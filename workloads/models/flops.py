"""Analytic training FLOPs of every model variant."""

from __future__ import annotations

from workloads.core.architecture import ModelConfig


def _precond_flops(kind: str, psd: bool, dim: int, rank: int) -> int:
    """Matmul FLOPs of one P g (one group): Uᵀg, Vᵀg, U(Vᵀg), V(Uᵀg); half with psd."""
    if kind != "diag_lowrank":
        return 0  # identity, or diag (element-wise)
    return (4 if psd else 8) * dim * rank


def _attention_forward(cfg: ModelConfig, seq_len: int) -> int:
    d, t, k, dh = cfg.d_model, seq_len, cfg.n_head, cfg.d_head
    if cfg.attention == "llama":
        return cfg.attn_steps * (8 * d * d + 4 * t * d)  # q, k, v, o; QKᵀ and PV over T keys
    diag = cfg.kq_diag != "none"
    # Scores q.k over all heads, plus h~ᵀ D u: once when shared, folded into each head otherwise.
    qk_width = k * dh + {"none": 0, "shared": d, "per_head": k * d}[cfg.kq_diag]
    v_width = k * (dh + (d if diag and cfg.energy_exact else 0))
    # P_k folds into the output weights (a weight-only product, not per token) unless the
    # directions are formed per head in model space (exact value path with a diagonal, Newton).
    per_head = cfg.update == "newton" or (diag and cfg.energy_exact)
    step = (2 * d * d  # q_proj
            + 2 * t * qk_width + 2 * t * v_width  # scores and weighted values
            + 2 * d * d  # W^Qᵀ back to the residual stream
            + ((1 if cfg.attn_precond_placement == "shared" else k)
               * _precond_flops(cfg.attn_preconditioner, cfg.preconditioner_psd, d,
                                cfg.attn_precond_rank) if per_head else 0))
    if cfg.update == "newton":  # c = (W g) kᵀ [+ (D g) h~ᵀ], r k, p k, W^Qᵀ back [, r h~, p h~]
        step += 2 * d * d + 2 * t * d + 4 * t * d + 2 * d * d + (6 * t * d * k if diag else 0)
    keys = 2 * d * d  # k_proj, once (every step with plain reuse)
    return cfg.attn_steps * (step + (keys if cfg.layer_reuse else 0)) + (
        0 if cfg.layer_reuse else keys)


def _mlp_forward(cfg: ModelConfig) -> int:
    d, f = cfg.d_model, cfg.d_mlp
    if cfg.mlp == "llama":
        return cfg.mlp_steps * 6 * d * f  # gate, up, down
    step = 4 * d * f  # V u and (V P)ᵀ a: P folds into V, not per token
    gamma = 2 * d * f  # gamma = W h~, once (every step with plain reuse)
    return cfg.mlp_steps * (step + (gamma if cfg.layer_reuse else 0)) + (
        0 if cfg.layer_reuse else gamma)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of training ``cfg`` on sequences of ``seq_len``.

    Counts every matrix product (2 m n k FLOPs each) of the forward pass, including attention
    over all T key positions as the kernels compute it, recursion steps, KQ diagonals,
    preconditioners and the Newton term, and triples it for the backward pass (gradients of
    both operands). Element-wise work (norms, softmax, SiLU, diagonal scalings) is not counted,
    as in ``torch.utils.flop_counter``. Products of weights alone (preconditioners folded into
    the output maps) do not grow with the tokens and are left out.
    """
    per_layer = _attention_forward(cfg, seq_len) + _mlp_forward(cfg)
    forward = cfg.n_layer * per_layer + 2 * cfg.d_model * cfg.vocab_size  # + the LM head
    return 3.0 * forward
