"""core/malloc.py: a process that frees and allocates megabyte tensors (a decode step's KV-cache concatenation) stops
faulting its memory in again once glibc keeps freed memory; DRAFTSMITH_MALLOC=0 leaves glibc as it ships."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

CHURN = """
import resource, sys, torch
from core.malloc import keep_freed_memory
tuned = keep_freed_memory()
block = torch.ones(1 << 20)  # 4 MB: one layer's keys, a batch of 16 at ~1,400 tokens (SmolLM2: 3 heads x 64)
step = torch.ones(3072)  # 12 KB: what one more token adds to them
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    block = torch.cat([block, step])  # a new, larger tensor each decode step, the old one freed
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def churn(env_extra: dict) -> tuple[bool, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    out = subprocess.run([sys.executable, "-c", CHURN], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    tuned, faults = out.stdout.split()
    return tuned == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_kept_instead_of_faulted_in_again():
    tuned, faults = churn({})
    shipped, shipped_faults = churn({"DRAFTSMITH_MALLOC": "0"})
    assert tuned and not shipped
    # as glibc ships, each block, larger than any freed one, is a fresh mapping: ~1000 page faults each, 200 blocks
    assert shipped_faults > 100_000, shipped_faults
    assert faults < shipped_faults / 8, (faults, shipped_faults)
