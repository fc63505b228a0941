"""A training process reuses the pages of freed large tensors instead of faulting in new ones."""

import json
import platform
import subprocess
import sys

import pytest

# The loss of a `micro` train step, argv[2] times: a micro-batch's bf16 logits (8 x 256 tokens,
# a 4096 vocabulary) cast to fp32 (one 32 MiB block), the cross-entropy and its backward; the
# minor page faults of each step (getrusage) count the pages it had to map anew.
SCRIPT = """
import json, resource, sys, torch
import torch.nn.functional as F
from workloads.runtime.allocator import reuse_freed_memory

torch.set_num_threads(1)
applied = reuse_freed_memory() if sys.argv[1] == "reuse" else None
logits = torch.randn(2048, 4096).bfloat16().requires_grad_()
targets = torch.randint(0, 4096, (2048,))
faults = []
for _ in range(int(sys.argv[2])):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    F.cross_entropy(logits.float(), targets).backward()
    logits.grad = None
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""
BLOCK_PAGES = 2048 * 4096 * 4 // 4096  # the fp32 logits, in 4 KiB pages


def _steps(*runs: tuple[str, int]) -> list[dict]:
    """The page faults of each (mode, steps) run, in its own process; the processes run at once
    (each counts its own faults)."""
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(steps)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode, steps in runs]
    outs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-2000:]
    return [json.loads(out) for out, _ in outs]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_train_steps_freed_blocks_are_reused_not_faulted_in_again():
    # the default's steps are all alike, so a few of them do
    default, reused = _steps(("default", 8), ("reuse", 60))
    # glibc's default: every step maps its large blocks afresh and faults in each page
    assert min(default["faults"]) >= BLOCK_PAGES, default
    assert reused["applied"]
    # reused: the heap grows over the first steps (small objects split its free blocks, so it
    # settles over tens of steps), then the steps run in its pages: 0 faults a step from the
    # 100th on over 400 steps, where the default faulted 32,000 pages each
    settled = reused["faults"][30:]
    assert sum(settled) * 10 <= len(settled) * min(default["faults"]), reused
