"""Llama baselines and CEM variants: ``ModelConfig`` -> ``build_model`` -> ``DecoderLM``."""

from workloads.core.architecture import PRESETS, ModelConfig
from workloads.models.cem import CEMMLP, CEMAttention
from workloads.models.decoder import (
    DecoderLM,
    build_model,
    count_parameters,
    next_token_loss,
    parameter_counts,
)
from workloads.models.flops import flops_per_token
from workloads.models.llama import LlamaAttention, LlamaMLP

__all__ = [
    "PRESETS", "CEMAttention", "CEMMLP", "DecoderLM", "LlamaAttention", "LlamaMLP", "ModelConfig",
    "build_model", "count_parameters", "flops_per_token", "next_token_loss", "parameter_counts",
]
