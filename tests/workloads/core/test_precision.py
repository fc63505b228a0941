"""``precision: auto`` on a CPU: bf16 only where the cores have bf16 instructions."""

from pathlib import Path

import pytest
import torch

from workloads.core.precision import bf16_supported, resolve_precision

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(torch.cuda.is_available() or not CPUINFO.exists(),
                    reason="reads the CPU's flags from Linux's /proc/cpuinfo")
def test_auto_is_bf16_exactly_where_the_cpu_has_bf16_instructions():
    # Independently of torch: the kernel's flag names for AVX512-BF16 and AMX-BF16. An AVX-512
    # core without them runs bf16 by conversion, slower than fp32: auto must not choose it.
    flags = {f for line in CPUINFO.read_text().splitlines() if line.startswith("flags")
             for f in line.split(":", 1)[1].split()}
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert bf16_supported() is native
    assert resolve_precision("auto") == ("bf16" if native else "fp32")
