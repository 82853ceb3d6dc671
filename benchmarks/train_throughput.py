"""Training throughput against the machine: each family's training step, in model FLOPs per second, as a fraction of
this machine's matrix-multiply rate at the step's precision, measured in the same run.

    python benchmarks/train_throughput.py                      # the SmolLM2 recipes, one rank's share of a step
    python benchmarks/train_throughput.py --set loss.vocab_size=null   # the same without the reduced softmax

FLOPs are counted by torch's FlopCounterMode over one forward + backward (matmuls and attention; elementwise work is
not counted, so the fraction is a lower bound of the machine's use). The step is the trainer's (the family's train
module, its loss and AdamW) on synthetic records of the recipe's shapes: the FLOPs depend on shapes only. It runs at the
precision the trainer picks (`--precision auto`: bf16 autocast on CPUs with bf16 matrix units, else fp32). The rate is
the faster of torch's square matmul and oneDNN's product (`torch.ops.mkldnn`) in that dtype, as large as the step's
biggest: on AMD CPUs torch's fp32 matmul (MKL) runs at a third of what the cores do, so it is no measure of the machine.
Prints both rates and one row per family.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from core.recipe import load_recipe  # noqa: E402
from modeling import cpu_linear  # noqa: E402
from modeling.target import load_target  # noqa: E402
from train.algorithms import attach_hidden, get_algorithm  # noqa: E402
from train.trainer import cpu_has_bf16_matmul  # noqa: E402


class SyntheticCache(list):
    """Records of the cache's shapes (prompt then answer, the answer supervised); what a train module's build reads."""

    manifest: dict = {}

    def with_hidden(self, records):
        return records


def synthetic_records(recipe, hidden: int, vocab: int, count: int, length: int, answer: int) -> SyntheticCache:
    g = torch.Generator().manual_seed(0)
    layers = len(recipe.target.layer_ids)
    # Zipf-like ids, as text: the reduced vocabularies then keep the frequent ones
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    out = SyntheticCache()
    for _ in range(count):
        ids = torch.multinomial(1.0 / ranks, length, replacement=True, generator=g)
        mask = torch.zeros(length, dtype=torch.long)
        mask[length - answer:] = 1
        out.append({"input_ids": ids, "loss_mask": mask,
                    "hidden_states": torch.randn(length, layers * hidden, generator=g).bfloat16(),
                    "last_hidden_state": torch.randn(length, hidden, generator=g).bfloat16()})
    return out


def matmul_rates(size: int, dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of a size^3 product in `dtype`: torch's matmul, and oneDNN's where torch has it."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    products = {"torch": lambda: torch.mm(a, b)}
    if cpu_linear.available():  # the machine's rate, whether or not the step uses it (DRAFTSMITH_ONEDNN)
        products["onednn"] = lambda: cpu_linear.product(a, b)
    rates = {}
    for name, product in products.items():
        product()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        rates[name] = 2 * size**3 / statistics.median(times)
    return rates


def step_throughput(family: str, target, overrides: list[str], sequences: int, length: int, answer: int,
                    repeats: int, autocast) -> dict:
    recipe = load_recipe(f"{family}_smollm2_135m", overrides)
    algo = get_algorithm(family)
    config = target.config
    records = synthetic_records(recipe, config.hidden_size, config.vocab_size, sequences, length, answer)
    torch.manual_seed(recipe.seed)
    module = algo.build(recipe, target, records)
    cpu_linear.pack_linears(module, prepack=False)  # as the trainer does
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    batches = [attach_hidden(algo.make_batch(recipe, [r], seeds=[(0, 0, i)], device="cpu"), [r], "cpu",
                             torch.float32) for i, r in enumerate(records)]

    def step():
        for batch in batches:  # micro-batches of one sequence, as the SmolLM2 recipes train
            with autocast():
                out = module(batch, 0)  # as optimizer step 0 (a loss.ce_warmup_steps recipe: its CE-only start)
            (out.loss_sum / batch["weight_sum"]).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up
    # counted with torch's own products: FlopCounterMode does not see oneDNN's, and the FLOPs depend on shapes only
    with patch.dict(os.environ, {"DRAFTSMITH_ONEDNN": "0"}), FlopCounterMode(display=False) as counter:
        for batch in batches:
            with autocast():
                out = module(batch, 0)
            (out.loss_sum / batch["weight_sum"]).backward()
    optimizer.zero_grad()
    flops = counter.get_total_flops()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"family": family, "step_s": seconds, "gflop": flops / 1e9, "gflops": flops / seconds / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--families", default="dspark,dflash,eagle3")
    parser.add_argument("--sequences", type=int, default=4, help="sequences a step (4: one of 2 ranks' share of 8)")
    parser.add_argument("--length", type=int, default=384, help="tokens a sequence (384)")
    parser.add_argument("--answer", type=int, default=256, help="supervised tokens at its end (256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps, median (3)")
    parser.add_argument("--matmul-size", type=int, default=2048, help="square matmul for the machine rate")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="the step's precision (auto: the trainer's choice on this CPU)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    precision = args.precision if args.precision != "auto" else "bf16" if cpu_has_bf16_matmul() else "fp32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()

    target = load_target("smollm2-135m-instruct", "cpu", "float32")
    rates = matmul_rates(args.matmul_size, dtype)
    rate = max(rates.values())
    print(f"[train_throughput] {precision} step; {precision} matmul {args.matmul_size}^3 on "
          f"{torch.get_num_threads()} threads: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items())
          + " GFLOP/s; the machine's rate is the faster", flush=True)
    print(f"{'family':<8} {'step s':>7} {'GFLOP':>8} {'GFLOP/s':>8} {'of matmul':>10}")
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        row = step_throughput(family, target, args.overrides, args.sequences, args.length, args.answer, args.repeats,
                              autocast)
        print(f"{family:<8} {row['step_s']:>7.2f} {row['gflop']:>8.1f} {row['gflops']:>8.1f} "
              f"{row['gflops'] * 1e9 / rate:>9.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
