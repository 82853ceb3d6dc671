"""GPU smoke run: every drafter family trains a few steps on CUDA (bf16, flex_attention) with tiny random models.

    python benchmarks/gpu_smoke.py               # on a CUDA machine; fails if there is none
    python benchmarks/gpu_smoke.py --allow-cpu   # the same script on CPU (what CI-less checks can do)

It builds a tiny random Qwen3 (hidden 64, 40 layers) with the real Qwen3 tokenizer, writes a handful of prompts,
and runs `train/main.py --stages regenerate,cache,train` for dspark, dflash and eagle3 with small overrides, once
with DeepSpeed ZeRO-2 (bf16 weights) and once with plain DDP (bf16 autocast). It prints each run's first and last
loss and training tau estimate, and exits non-zero if any run fails or produces a non-finite loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [{"turns": [f"Explain idea number {i} in one sentence.", "Now give an example."]} for i in range(12)]
SMALL = {
    "data.num_prompts": 12, "data.min_loss_tokens": 1, "data.max_length": 256,
    "regen.max_new_tokens": 24, "regen.batch_size": 4, "cache.records_per_shard": 4,
    "draft.num_layers": 1, "draft.num_anchors": 16, "draft.block_size": 4, "draft.draft_vocab_size": 2048,
    "draft.ttt_length": 3, "train.global_batch_size": 4, "train.max_steps": 4, "train.save_every": 4,
    "train.log_every": 1,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when there is no GPU")
    parser.add_argument("--out", help="work folder (default: a temporary one)")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device: run on a GPU machine, or pass --allow-cpu", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, device {device}", flush=True)

    from data.assets import make_tiny_qwen3

    work = Path(args.out or tempfile.mkdtemp(prefix="draftsmith-gpu-smoke-"))
    target = make_tiny_qwen3(str(work / "tiny-qwen3"), num_layers=40)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")

    failures = 0
    for family in ("dspark", "dflash", "eagle3"):
        for zero_stage in (2, 0):
            out = work / f"{family}-zero{zero_stage}"
            sets = dict(SMALL, **{"target.name_or_path": target, "data.sources": f"[{{name: '{prompts}'}}]",
                                  "train.zero_stage": zero_stage})
            if family == "dspark":
                sets["draft.markov_rank"] = 16
            cmd = [sys.executable, "train/main.py", "--recipe", f"{family}_qwen3_8b", "--out", str(out),
                   "--stages", "regenerate,cache,train"]
            for key, value in sets.items():
                cmd += ["--set", f"{key}={value}"]
            start = time.perf_counter()
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            metrics_file = out / "train" / "metrics.jsonl"
            if done.returncode != 0 or not metrics_file.is_file():
                failures += 1
                print(f"{family:7s} zero{zero_stage}: FAILED (rc {done.returncode}) after {seconds:.0f} s\n"
                      f"{done.stderr[-2000:]}", flush=True)
                continue
            rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
            finite = all(abs(r["loss"]) < float("inf") for r in rows)
            failures += not finite
            print(f"{family:7s} zero{zero_stage}: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, "
                  f"tau {rows[0]['tau']:.3f} -> {rows[-1]['tau']:.3f}, {len(rows)} steps, {seconds:.0f} s"
                  f"{'' if finite else '  NON-FINITE'}", flush=True)
    print("OK" if failures == 0 else f"{failures} run(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
