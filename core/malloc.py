"""glibc's malloc for a CPU-bound torch process: keep freed memory for the next allocation instead of handing it back
to the kernel and faulting it in again.

Why: torch's CPU tensors come straight from malloc (no caching allocator as on a GPU), and decoding with a growing KV
cache frees and allocates megabytes per layer per token (`torch.cat` of the cache). glibc returns such blocks to the
kernel (mmap above its threshold, heap trimming below), so the next ones page-fault in again. Measured on the
regenerate stage (SmolLM2, HF backend, 8 prompts, 1 thread, 2-core AMD EPYC): 14.9M page faults and 48.1 s of stage
time as glibc ships, 0.36M faults and 23.2 s with both thresholds raised. Only trimming raised made it worse (25.7M
faults, 69.7 s): fixing any threshold turns off glibc's own adjustment of the mmap one. The cost: the process keeps
its peak heap (the regenerate stage's resident peak rose 2.11 -> 2.24 GB). Allocations of 1 GiB or more still get
their own mapping. `DRAFTSMITH_MALLOC=0` leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>
KEEP_BELOW = 1 << 30  # bytes: blocks smaller than this come from (and go back to) the heap, which is never trimmed


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds in this process (children started after inherit nothing: each entry
    point calls this). Returns whether it did; False off Linux/glibc or with DRAFTSMITH_MALLOC=0."""
    if os.environ.get("DRAFTSMITH_MALLOC", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other C libraries: nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
