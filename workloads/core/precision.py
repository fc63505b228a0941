"""The precision a trial trains in: ``auto`` resolved for a machine, and fixed when planned."""

from __future__ import annotations

import functools
from typing import Literal


@functools.cache
def bf16_supported() -> bool:
    """Whether this machine's accelerator (CUDA) or CPU (AVX512-BF16/AMX) computes in bf16
    (asked once per process: every planned trial, memory estimate and session needs it)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(precision: Literal["auto", "bf16", "fp32"]) -> str:
    """``auto`` -> ``bf16`` where this machine supports it, else ``fp32``."""
    if precision == "auto":
        return "bf16" if bf16_supported() else "fp32"
    return precision


def planned_precision(precision: Literal["auto", "bf16", "fp32"], use_gpu: bool) -> str:
    """The precision a trial trains in, fixed when it is planned (it is part of the trial's
    identity: the same ``auto`` trains in bf16 on one machine and in fp32 on another).

    ``bf16``/``fp32`` as given; ``auto`` -> ``bf16`` for GPU workers (every GPU of
    ``workloads.runtime.hardware.PEAK_TFLOPS`` computes it; pin ``fp32`` for one that does not) and,
    for CPU workers, the planning machine's ``resolve_precision("auto")``.
    """
    return "bf16" if precision == "auto" and use_gpu else resolve_precision(precision)
