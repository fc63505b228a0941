"""Export a registered Llama baseline as a Hugging Face ``LlamaForCausalLM`` directory.

Only plain Llama baselines export: Llama attention and MLP, RoPE, one step per sublayer. CEM
variants (and Llama with ALiBi or layer reuse) have no Hugging Face architecture; use their
pyfunc (``mlflow.pyfunc.load_model``), which ships our modelling code.

The mapping is one rename per tensor, with one swap: our SwiGLU is
``down_proj(gate_proj(x) * SiLU(up_proj(x)))`` (the paper's Eq. 6, SiLU on ``up_proj``), Hugging
Face's is ``down_proj(SiLU(gate_proj(x)) * up_proj(x))``, so our ``up_proj`` becomes its
``gate_proj`` and our ``gate_proj`` its ``up_proj``. RoPE is in the half-split layout on both
sides, so q and k need no permutation. Writing the directory needs no ``transformers``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from workloads.lm.package import EOT, TOKENIZER, WEIGHTS, load_config
from workloads.models import ModelConfig

_RENAMES = [  # (ours, Hugging Face's), regular expressions over tensor names
    (r"embed_tokens\.weight", "model.embed_tokens.weight"),
    (r"blocks\.(\d+)\.attn\.norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blocks\.(\d+)\.attn\.([qkvo])_proj\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"blocks\.(\d+)\.mlp\.norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blocks\.(\d+)\.mlp\.up_proj\.weight", r"model.layers.\1.mlp.gate_proj.weight"),  # SiLU
    (r"blocks\.(\d+)\.mlp\.gate_proj\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blocks\.(\d+)\.mlp\.down_proj\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]


_LLAMA = {"attention": "llama", "mlp": "llama", "position": "rope", "attn_steps": 1,
          "mlp_steps": 1}  # the ModelConfig fields of a plain Llama baseline


def check_exportable(cfg: ModelConfig) -> None:
    """Raises ValueError (one line) unless ``cfg`` is a plain Llama baseline."""
    wrong = {k: getattr(cfg, k) for k, v in _LLAMA.items() if getattr(cfg, k) != v}
    if wrong:
        raise ValueError("only Llama baselines (attention llama, mlp llama, position rope, one "
                         "step per sublayer) export to Hugging Face; this model has "
                         + ", ".join(f"{k} {v}" for k, v in wrong.items())
                         + ": load it with mlflow.pyfunc.load_model instead")


def hf_name(name: str) -> str:
    """The Hugging Face Llama name of our tensor ``name``.

    Raises:
        KeyError: a tensor with no Llama counterpart.
    """
    for pattern, replacement in _RENAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    raise KeyError(f"tensor {name!r} has no Hugging Face Llama counterpart")


def llama_config(cfg: ModelConfig, dtype: str, eot_id: int) -> dict:
    """``config.json`` of ``LlamaForCausalLM`` for ``cfg``."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head,
            "head_dim": cfg.d_head, "hidden_act": "silu",
            "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "initializer_range": cfg.init_std, "bos_token_id": eot_id, "eos_token_id": eot_id,
            "torch_dtype": dtype, "dtype": dtype}


def export_hf(package: str | Path, directory: str | Path) -> Path:
    """Write the Llama model of ``package`` (a ``workloads.lm.serving`` package directory) as a
    Hugging Face directory: ``config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json``. ``directory`` is created; existing files are replaced.

    Raises:
        ValueError: not a plain Llama baseline (``check_exportable``).
    """
    package, out = Path(package), Path(directory)
    cfg = load_config(package)
    check_exportable(cfg)
    state = load_file(str(package / WEIGHTS))
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    tokenizer = json.loads((package / TOKENIZER).read_text())
    eot_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == EOT)
    out.mkdir(parents=True, exist_ok=True)
    save_file({hf_name(k): v.contiguous() for k, v in state.items()}, str(out / WEIGHTS),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(llama_config(cfg, dtype, eot_id), indent=2))
    shutil.copyfile(package / TOKENIZER, out / TOKENIZER)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
        "unk_token": EOT, "model_max_length": cfg.context_length, "add_bos_token": False,
        "add_prefix_space": False}, indent=2))
    return out
