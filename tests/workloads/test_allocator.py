"""A training process reuses the pages of freed large tensors instead of faulting in new ones."""

import json
import platform
import subprocess
import sys

import pytest

# Allocate, touch and free a 64 MiB tensor twelve times, before and after reuse_freed_memory;
# the minor page faults of each round (getrusage) tell whether its pages were new.
SCRIPT = """
import json, resource, sys, torch
torch.set_num_threads(1)
from workloads.allocator import reuse_freed_memory

def faults_per_round():
    out = []
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 * 2**20)  # 64 MiB of fp32, freed at once
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out

default = faults_per_round()
applied = reuse_freed_memory()
print(json.dumps({"default": default, "applied": applied, "reused": faults_per_round()}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_tensors_pages_are_reused_not_faulted_in_again():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, check=True)
    out = json.loads(proc.stdout)
    pages = 64 * 2**20 // 4096
    # glibc's default: every round maps fresh pages, each faulted in once.
    assert all(n >= pages // 2 for n in out["default"]), out
    assert out["applied"]
    # after: the heap grows to hold the tensor, and from then on its pages are reused
    assert out["reused"][0] >= pages // 2 and sum(out["reused"][6:]) < pages // 10, out
