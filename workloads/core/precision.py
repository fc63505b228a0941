"""The precision a trial trains in: ``auto`` resolved for a machine, and fixed when planned."""

from __future__ import annotations

import functools
from typing import Literal


@functools.cache
def bf16_supported() -> bool:
    """Whether this machine's accelerator (CUDA) or CPU (AVX512-BF16 or AMX-BF16 instructions)
    computes in bf16 (asked once per process: every planned trial, memory estimate and session
    needs it). oneDNN also runs bf16 on AVX-512 cores without them, by conversion: a `tiny`
    step 3.7x slower than fp32 on such a core, so those count as not supporting it."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


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
