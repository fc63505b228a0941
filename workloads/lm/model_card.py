"""The model card (``README.md``) of a registered CEM Lab model: what it is, how it was trained,
how well it does, and how to use it."""

from __future__ import annotations

from workloads.core.trial import Trial
from workloads.models import flops_per_token


def model_card(name: str, experiment: str, trial: Trial, val: float, test: float,
               commit: str | None, code: str | None) -> str:
    """Markdown card of registered model ``name`` for the trial ``trial`` of ``experiment``,
    with its validation and test perplexity, the git commit and code fingerprint it ran."""
    cfg, params = trial.model, trial.params
    flops = flops_per_token(cfg, cfg.context_length)
    data = trial.config.model_dump(exclude_none=True)
    rows = [
        ("experiment", f"`{experiment}`, trial `{trial.trial_id}` ({trial.label})"),
        ("architecture", f"attention `{cfg.attention}`, MLP `{cfg.mlp}`; d_model {cfg.d_model}, "
                         f"n_layer {cfg.n_layer}, n_head {cfg.n_head}, d_mlp {cfg.d_mlp}, "
                         f"attn_steps {cfg.attn_steps}, mlp_steps {cfg.mlp_steps} "
                         "(all fields: `config.json`)"),
        ("data", ", ".join(f"{k} `{v}`" for k, v in data.items())),
        ("tokens", f"{trial.tokens:,} ({trial.tokens / params['total']:.2f} per parameter), "
                   f"context {cfg.context_length}"),
        ("learning rate", f"{trial.lr:g} (peak; AdamW, warmup and cosine decay)"),
        ("seed", str(trial.seed)),
        ("validation perplexity", f"{val:.4f} (chosen on it)"),
        ("test perplexity", f"{test:.4f}"),
        ("parameters", f"{params['total']:,} total, {params['non_embedding']:,} non-embedding"),
        ("FLOPs", f"{flops:,.0f} per token (forward and backward), "
                  f"{flops * trial.tokens:.3e} for training"),
        ("git commit", f"`{commit or 'unknown'}`"),
        ("code fingerprint", f"`{code or 'unknown'}`"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""# {name}

A CEM Lab language model: the best trial of its (variant, size) in experiment `{experiment}`,
chosen on validation perplexity.

| | |
|---|---|
{table}

## Files

- `artifacts/package/model.safetensors`: the weights, in their training dtype (no pickle).
- `artifacts/package/config.json`: the `ModelConfig`.
- `artifacts/package/tokenizer.json`: the corpus's byte-level BPE (Hugging Face `tokenizers`).
- `code/workloads/`: the modelling code the pyfunc runs; no checkout of CEM Lab is needed.

## Use

```python
import mlflow, pandas as pd
model = mlflow.pyfunc.load_model("models:/{name}@best")
model.predict(pd.DataFrame({{"text": ["To be, or not to be"]}}))  # token_count, nll, perplexity
model.predict(pd.DataFrame({{"text": ["To be, or not"]}}),
              params={{"task": "generate", "max_new_tokens": 40, "temperature": 0.8,
                      "top_k": 50, "seed": 0}})  # continuation
```

or `cemlab models generate {name}@best "To be, or not"`.
"""
