"""Llama baselines and CEM variants: ``ModelConfig`` -> ``build_model`` -> ``DecoderLM``."""

from workloads.models.cem import CEMMLP, CEMAttention
from workloads.models.config import PRESETS, ModelConfig
from workloads.models.flops import flops_per_token
from workloads.models.llama import LlamaAttention, LlamaMLP
from workloads.models.model import (
    DecoderLM,
    build_model,
    count_parameters,
    next_token_loss,
    parameter_counts,
)

__all__ = [
    "PRESETS", "CEMAttention", "CEMMLP", "DecoderLM", "LlamaAttention", "LlamaMLP", "ModelConfig",
    "build_model", "count_parameters", "flops_per_token", "next_token_loss", "parameter_counts",
]
