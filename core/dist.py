"""Process-group helpers shared by every stage: torchrun or plain python, gloo on CPU, NCCL on GPU.

Stages split their work into fixed units (regeneration chunks, cache shards) and give unit k to rank k % world,
so the result never depends on how many ranks made it, and a resumed run redoes only the missing units.
"""

from __future__ import annotations

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, units) -> list:
        """The units (ints) this rank handles."""
        return [u for u in units if u % self.world_size == self.rank]

    def barrier(self) -> None:
        if self.world_size > 1:
            tdist.barrier()

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

    def print(self, *args) -> None:
        if self.is_main:
            print(*args, flush=True)


def init_dist() -> Dist:
    """Join the torchrun process group if there is one; pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not tdist.is_initialized():
        # Regeneration on one rank can run for hours while the others wait at a barrier.
        minutes = float(os.environ.get("DRAFTSMITH_DIST_TIMEOUT_MIN", "360"))
        tdist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(minutes=minutes),
        )
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def close_dist() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def fault_point(name: str, index: int) -> None:
    """Crash-test hook: DRAFTSMITH_KILL_AT=name:index makes this process SIGKILL itself here (tests of resume)."""
    if os.environ.get("DRAFTSMITH_KILL_AT") == f"{name}:{index}":
        os.kill(os.getpid(), signal.SIGKILL)
