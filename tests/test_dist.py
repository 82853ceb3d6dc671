"""The process group as on a GPU machine (NCCL, which has no CPU collectives), run on a CPU: Dist.sum/max reduce CPU
tensors and must still work; the per-step timeout is bounded while the long wait is not (tests/dist_worker.py)."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def run_workers(mode, tmp_path, **env):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", **env)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "dist_worker.py"), mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_cpu_collectives_work_when_the_accelerator_backend_refuses_cpu_tensors(tmp_path):
    ranks = run_workers("collectives", tmp_path)
    for rank, seen in enumerate(ranks):
        assert "error" not in seen, seen["error"]
        assert seen["device"] == f"cuda:{rank}"  # the GPU path of init_dist ran
        assert seen["sum"] == [2.0, 1.0] and seen["max"] == 1.5 and seen["ok"]


def test_per_step_collectives_time_out_but_the_long_wait_does_not(tmp_path, drill):
    drill("hung-rank", "a rank that stops answering")
    # per-step timeout 3 s, long wait 60 s
    ranks = run_workers("timeouts", tmp_path, DRAFTSMITH_DIST_TIMEOUT_MIN="0.05",
                        DRAFTSMITH_DIST_WAIT_TIMEOUT_MIN="1")
    assert all("error" not in seen for seen in ranks), ranks
    assert ranks[0]["wait_s"] > 4  # waited for rank 1's 6 s of "work" past the 3 s per-step timeout
    assert ranks[0]["sum"] != "completed" and ranks[0]["sum_s"] < 7.5, ranks[0]  # gave up instead of waiting 8 s


def test_a_rank_working_alone_uses_every_core_then_gives_them_back():
    """torchrun gives each rank one thread; rank 0's eval, while the others wait, takes all this process's cores."""
    import torch

    from core.dist import Dist

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Dist().every_core():
            assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
