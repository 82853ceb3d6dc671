"""What a GPU run computes and copies, checked on CPU (issue 55: G10, G11). None of it has run on a GPU.

* G11: a ZeRO-2 run with bf16 weights (every GPU run of the Qwen3 recipes) sums its micro-batches' gradients in fp32.
  DeepSpeed's bf16 mode is forced on the CPU here, through the project's own Engine, over dspark_qwen3_8b's 64
  micro-batches a rank: the gradient DeepSpeed holds at the step matches an fp32 sum of the micro-batches' bf16
  gradients, and without the config's `data_types` key (as before) it misses by hundreds of times fp32's error.
* G10: online hidden states stay on the target's device from the forward to the draft's input. The path runs with the
  target and the batch on PyTorch's `meta` device, where copying a tensor to the host raises; tests/test_online.py
  keeps online equal to offline, bit for bit.
* GPU ranks' host threads: cores / ranks on the node, not torchrun's one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from core.dist import Dist, host_threads
from core.recipe import load_recipe
from train import trainer
from train.trainer import Engine, deepspeed_config, grad_accum_steps

ROOT = Path(__file__).resolve().parent.parent
MICRO_BATCHES = 64  # dspark_qwen3_8b on 8 ranks: 512 sequences / (1 × 8)


def test_the_flagships_deepspeed_config_sums_gradients_in_fp32(monkeypatch):
    recipe = load_recipe("dspark_qwen3_8b")
    gpu_rank = Dist(rank=0, world_size=8, device=torch.device("cuda", 0))
    assert grad_accum_steps(recipe, gpu_rank) == MICRO_BATCHES
    config = deepspeed_config(recipe, gpu_rank, MICRO_BATCHES)
    assert config["bf16"]["enabled"] and config["zero_optimization"]["stage"] == 2
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}


class Scaled(torch.nn.Module):
    """loss = <w, c> for the micro-batch's c: the gradient is c, rounded to the weights' bf16."""

    def __init__(self, size: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(size))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c.to(self.w.dtype)).sum()


def accumulated_gradient_error(with_fp32_sum: bool) -> float:
    """Relative error of the gradient DeepSpeed holds after 64 bf16 micro-batches, against their fp32 sum. Run in a
    process of its own (this file as a script): DeepSpeed keeps its process groups for the process's life. Without
    the rendezvous variables an earlier test in this worker left (its group still holds that MASTER_PORT)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                             "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    done = subprocess.run([sys.executable, __file__, "fp32" if with_fp32_sum else "model-dtype"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["relative_error"]


def _accumulate(with_fp32_sum: bool) -> float:
    trainer.bf16_weights = lambda recipe, dist: True  # as on a GPU: DeepSpeed's bf16 mode
    if not with_fp32_sum:
        built = trainer.deepspeed_config
        trainer.deepspeed_config = lambda *a: {k: v for k, v in built(*a).items() if k != "data_types"}
    recipe = load_recipe("dspark_qwen3_8b", ["train.zero_stage=2", "train.micro_batch_size=1",
                                             f"train.global_batch_size={MICRO_BATCHES}", "train.max_grad_norm=1e9"])
    engine = Engine(Scaled(256), recipe, Dist(), MICRO_BATCHES)
    assert engine.kind == "deepspeed" and engine.module.bfloat16_enabled()
    # each micro-batch's gradient is about 1/64 of the sum, as the loss normalised by the global batch makes it
    grads = torch.rand(MICRO_BATCHES, 256, generator=torch.Generator().manual_seed(0)) / MICRO_BATCHES + 1 / MICRO_BATCHES
    norm = None
    for i, c in enumerate(grads):
        engine.backward(engine.module(c))
        norm = engine.step(lr=0.0, last_micro=i == MICRO_BATCHES - 1)
    reference = grads.bfloat16().double().sum(0)  # what each micro-batch contributes is its bf16 gradient
    return abs(norm - float(reference.norm())) / float(reference.norm())


def test_64_bf16_micro_batches_sum_as_in_fp32():
    """The step's gradient norm is DeepSpeed's own reading of the summed gradient partition."""
    assert accumulated_gradient_error(with_fp32_sum=True) < 1e-6


def test_without_the_key_deepspeed_sums_in_bf16():
    """The config before G11: the same 64 micro-batches lose bits in a bf16 accumulator."""
    assert accumulated_gradient_error(with_fp32_sum=False) > 1e-4


def test_a_gpu_ranks_host_threads_are_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr("core.dist.usable_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert host_threads() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert host_threads() == 16


if __name__ == "__main__":
    print(json.dumps({"relative_error": _accumulate(sys.argv[1] == "fp32")}))
