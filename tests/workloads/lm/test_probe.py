"""The content probe: KL(p || position prior) against a numpy computation from the definition,
0 for attention whose scores ignore the tokens, one row per recursion step."""

import numpy as np
import pytest
import torch

from workloads.lm.probe import position_prior_kl
from workloads.models import ModelConfig, build_model
from workloads.models.position import alibi_bias


def _model(**overrides):
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("nano", **overrides)).eval()
    with torch.no_grad():  # content scores large enough to matter (init std 0.02 is small)
        for block in model.blocks:
            block.attn.q_proj.weight.mul_(20)
            block.attn.k_proj.weight.mul_(20)
    return model


def _idx(model, batch=2, seq=24):
    return torch.randint(0, model.cfg.vocab_size, (batch, seq),
                         generator=torch.Generator().manual_seed(1))


def test_kl_and_entropies_follow_their_definitions():
    model = _model(attention="cem", attn_steps=2)
    idx = _idx(model)
    rows = position_prior_kl(model, idx)
    assert [(r["layer"], r["step"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    attn = model.blocks[0].attn
    with torch.no_grad():
        h = model.embed_tokens(idx)
        p = attn.attention_probs(h, h).double().numpy()  # step 1: queries at x(0) = h
        b = alibi_bias(attn.alibi_slopes, idx.shape[1], attn.self_bias, attn.cross_bias)
    b = b.double().numpy()
    p0 = np.exp(b - b.max(-1, keepdims=True))
    p0 /= p0.sum(-1, keepdims=True)
    p0 = np.broadcast_to(p0, p.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(p > 0, p * np.log(p / p0), 0.0).sum(-1).mean()
        ent = np.where(p > 0, -p * np.log(p), 0.0).sum(-1).mean()
        ent0 = np.where(p0 > 0, -p0 * np.log(p0), 0.0).sum(-1).mean()
    assert rows[0]["kl_to_prior"] == pytest.approx(kl, rel=1e-5)
    assert rows[0]["entropy"] == pytest.approx(ent, rel=1e-6)
    assert rows[0]["prior_entropy"] == pytest.approx(ent0, rel=1e-6)
    assert rows[0]["kl_to_prior"] > 1e-2  # these scores do read the tokens


def test_attention_that_ignores_the_tokens_has_zero_kl():
    model = _model(attention="cem")
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_proj.weight.zero_()  # no content score (and no diagonal: none)
    for row in position_prior_kl(model, _idx(model)):
        assert row["kl_to_prior"] == pytest.approx(0.0, abs=1e-12)
        assert row["entropy"] == pytest.approx(row["prior_entropy"], rel=1e-9)


def test_llama_with_alibi_is_probed_and_llama_with_rope_is_not():
    alibi = _model(position="alibi")
    rows = position_prior_kl(alibi, _idx(alibi))
    assert [(r["layer"], r["step"]) for r in rows] == [(0, 1), (1, 1)]
    assert all(r["kl_to_prior"] > 0 for r in rows)
    rope = _model()
    assert position_prior_kl(rope, _idx(rope)) == []

