"""Host memory reuse for training processes: freed large blocks stay in the process.

glibc's malloc serves each large allocation (from 128 KiB, a threshold it raises as blocks are
freed, up to 32 MiB) with its own ``mmap`` and unmaps it when freed, so the next train step's
tensor of that size faults in every one of its pages again. A ``micro`` step allocates such
blocks many times over: its fp32 logits alone are 8 x 256 x 4096 x 4 B = 32 MiB. Kept in the
heap, they are reused by the next step (the time each saves: docs/benchmarks.md). PyTorch's CPU
performance guide gets the same by preloading jemalloc or tcmalloc; this needs no library beside
glibc.

The cost is resident memory: the heap settles over the first tens of steps (small objects split
its free blocks, so it grows a few times before they fit) and then stays at its high-water mark.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt(3) parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Blocks under this size come from the heap and stay there when freed; the heap is returned to
# the OS only when its free top exceeds this size.
REUSE_BELOW_BYTES = 1 << 30


def reuse_freed_memory() -> bool:
    """Have glibc's malloc in this process serve blocks under ``REUSE_BELOW_BYTES`` from its heap
    and keep them there when freed (``mallopt`` ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``),
    so that a train step reuses the pages of the step before. The process's resident memory
    then stays at its high-water mark. Call it once, before training, in every process that
    trains; later calls change nothing.

    Returns whether it applied: False where the C library is not glibc (macOS, musl).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, REUSE_BELOW_BYTES)
                and mallopt(M_TRIM_THRESHOLD, REUSE_BELOW_BYTES))
