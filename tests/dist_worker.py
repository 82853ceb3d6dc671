"""Run by tests/test_dist.py under torchrun (2 ranks): init_dist as on a GPU machine, with NCCL replaced by a backend
that serves CUDA tensors only, then the collectives every stage uses. Writes what it saw to $OUT/rank<k>.json.

NCCL registers for CUDA tensors only: a collective on a CPU tensor in an NCCL-only group fails with "No backend type
associated with device type cpu". A CPU-only machine has no NCCL, so this stand-in (a gloo backend registered for
"cuda" only) reproduces exactly that dispatch; the process believes it has a GPU (is_available/set_device patched)
so that init_dist takes its GPU path.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _cuda_only_backend(store, rank, size, timeout):
    return tdist.ProcessGroupGloo(store, rank, size, timeout)


tdist.Backend.register_backend("fakenccl", _cuda_only_backend, devices=["cuda"])
_init = tdist.init_process_group


def _init_with_stand_in(backend=None, **kwargs):
    # "nccl" alone means NCCL for the devices it serves (CUDA); "cpu:gloo,cuda:nccl" keeps its CPU part.
    backend = "cuda:fakenccl" if backend == "nccl" else backend.replace(":nccl", ":fakenccl")
    return _init(backend=backend, **kwargs)


tdist.init_process_group = _init_with_stand_in
torch.cuda.is_available = lambda: True
torch.cuda.set_device = lambda device: None

from core.dist import init_dist  # noqa: E402

mode, out = sys.argv[1], Path(os.environ["OUT"])
result = {}
dist = init_dist()
try:
    if mode == "collectives":
        result["device"] = str(dist.device)
        result["sum"] = dist.sum(1.0, float(dist.rank))
        result["max"] = dist.max(float(dist.rank) + 0.5)
        dist.wait()
        result["ok"] = True
    elif mode == "timeouts":
        # rank 1 is busy longer than the per-step timeout: the long wait still succeeds ...
        if dist.rank == 1:
            time.sleep(6)
        start = time.monotonic()
        dist.wait()
        result["wait_s"] = time.monotonic() - start
        # ... but a per-step collective with a rank that does not come fails after the per-step timeout
        if dist.rank == 1:
            time.sleep(8)
        start = time.monotonic()
        try:
            dist.sum(1.0)
            result["sum"] = "completed"
        except Exception as exc:  # noqa: BLE001 - the test reads what happened
            result["sum"] = f"{type(exc).__name__}: {exc}"[:300]
        result["sum_s"] = time.monotonic() - start
except Exception as exc:  # noqa: BLE001
    result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
(out / f"rank{dist.rank}.json").write_text(json.dumps(result))
sys.stdout.flush()
os._exit(0)  # no destroy_process_group after a timed-out collective (it may wait for the peer)
