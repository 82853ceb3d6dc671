"""Process-group helpers shared by every stage: torchrun or plain python, gloo on CPU, NCCL (+ gloo) on GPU.

Stages split their work into fixed units (regeneration chunks, cache shards) and give unit k to rank k % world,
so the result never depends on how many ranks made it, and a resumed run redoes only the missing units.

Two timeouts: every collective of the default group (per-step sums, DDP's gradient all-reduce, checkpoint barriers)
fails after DRAFTSMITH_DIST_TIMEOUT_MIN (default 30) minutes, so a hung rank stops the job instead of stalling it;
only `Dist.wait` (the points where ranks legitimately wait for another rank's long work: the end of regeneration
and of the cache stage, rank 0's eval and export) uses a separate gloo group with DRAFTSMITH_DIST_WAIT_TIMEOUT_MIN
(default 360) minutes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    #: the long-timeout gloo group `wait` uses (None: the default group)
    wait_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, units) -> list:
        """The units (ints) this rank handles."""
        return [u for u in units if u % self.world_size == self.rank]

    def barrier(self) -> None:
        if self.world_size > 1:
            tdist.barrier()

    @contextlib.contextmanager
    def every_core(self):
        """While this rank works alone and the others block in `wait` (rank 0's eval): all the cores this process
        may run on, not the one-per-rank share torchrun sets (OMP_NUM_THREADS=1)."""
        before = torch.get_num_threads()
        torch.set_num_threads(max(before, usable_cores()))
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def wait(self) -> None:
        """A barrier where other ranks may still be busy with hours of work (regeneration, rank 0's eval): it has the
        long timeout, the per-step collectives after it do not."""
        if self.world_size > 1:
            tdist.barrier(group=self.wait_group)

    def sum(self, *values: float) -> list[float]:
        """Sum numbers over ranks (every rank gets the totals)."""
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        tdist.all_reduce(tensor)
        return tensor.tolist()

    def max(self, value: float) -> float:
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        tdist.all_reduce(tensor, op=tdist.ReduceOp.MAX)
        return tensor.item()

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        parts = [None] * self.world_size
        tdist.all_gather_object(parts, obj)
        return parts

    def print(self, *args) -> None:
        if self.is_main:
            print(*args, flush=True)


def _minutes(name: str, default: float) -> datetime.timedelta:
    value = os.environ.get(name, str(default))
    try:
        minutes = float(value)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0 or minutes == float("inf"):
        raise ValueError(f"{name}={value!r}: expected a positive number of minutes (default {default})")
    return datetime.timedelta(minutes=minutes)


def step_timeout() -> datetime.timedelta:
    """Timeout of every ordinary collective (DRAFTSMITH_DIST_TIMEOUT_MIN, default 30 minutes)."""
    return _minutes("DRAFTSMITH_DIST_TIMEOUT_MIN", 30)


def wait_timeout() -> datetime.timedelta:
    """Timeout of `Dist.wait` (DRAFTSMITH_DIST_WAIT_TIMEOUT_MIN, default 360 minutes)."""
    return _minutes("DRAFTSMITH_DIST_WAIT_TIMEOUT_MIN", 360)


def process_group_backend(device: torch.device) -> str:
    """gloo on CPU; on GPU NCCL for device tensors and gloo for CPU tensors: NCCL has no CPU collectives, and
    Dist.sum/max reduce CPU scalars."""
    return "gloo" if device.type == "cpu" else f"cpu:gloo,{device.type}:nccl"


def init_process_group(device: torch.device) -> None:
    """The default process group for `device`, with the per-step timeout (also DeepSpeed's one-process setup)."""
    tdist.init_process_group(backend=process_group_backend(device), timeout=step_timeout())


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_threads() -> int:
    """A GPU rank's share of the node's cores (cores / ranks on the node): its host work (tokenizing, collating, what
    the optimizer does on the host) runs on that many threads, not the one torchrun sets per rank."""
    return max(1, usable_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def init_dist() -> Dist:
    """Join the torchrun process group if there is one; pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # torchrun sets OMP_NUM_THREADS=1 for several ranks a node; a CPU rank computes on its thread, a GPU rank's
        # host work would crawl on one (a user's larger setting is kept)
        torch.set_num_threads(max(torch.get_num_threads(), host_threads()))
    wait_group = None
    if world_size > 1:
        if not tdist.is_initialized():
            init_process_group(device)
        # Collective call: every rank makes the same groups in the same order.
        wait_group = tdist.new_group(backend="gloo", timeout=wait_timeout())
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device, wait_group=wait_group)


def close_dist() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def fault_point(name: str, index: int) -> None:
    """Crash-test hook: DRAFTSMITH_KILL_AT=name:index makes this process SIGKILL itself here (tests of resume);
    with DRAFTSMITH_KILL_RANK=r only rank r does (one node of a multi-rank job dies, the others are stopped by
    torchrun)."""
    only = os.environ.get("DRAFTSMITH_KILL_RANK")
    if only is not None and only != os.environ.get("RANK", "0"):
        return
    if os.environ.get("DRAFTSMITH_KILL_AT") == f"{name}:{index}":
        os.kill(os.getpid(), signal.SIGKILL)
