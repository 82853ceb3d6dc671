"""Online vs offline hidden states, side by side in one run: training throughput, time to a trained step, bytes written.

    python benchmarks/online_throughput.py                      # dspark_smollm2_135m, 32 prompts, 8 steps, ~10 min
    python benchmarks/online_throughput.py --family eagle3 --prompts 16 --steps 4

Regenerates once (greedy SmolLM2 answers to ShareGPT prompts), then from the same records:
  offline = the cache stage, then the train stage reading the cache;
  online  = the train stage alone with train.hidden_states=online (the target runs inside each step).
Prints training tokens/s (median step after the first), the seconds each step spends getting hidden states, the
cache stage's seconds, the end-to-end seconds of cache + train, and the bytes each writes under its run folder, with
online/offline ratios. Writes OUT/online_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import ratio, run_pipeline, sets  # noqa: E402
from core.recipe import FAMILIES  # noqa: E402


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.exists() else 0


def train_figures(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows  # the first step pays for warm-up
    return {"steps": len(rows), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "step_s": statistics.median(r["step_s"] for r in steady),
            "hidden_s": statistics.median(r["hidden_s"] for r in steady),
            "train_s": sum(r["step_s"] for r in rows)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--family", default="dspark", choices=FAMILIES)
    parser.add_argument("--prompts", type=int, default=32, help="training prompts regenerated once for both runs")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each run (the recipe's batch)")
    parser.add_argument("--nproc", type=int, default=1, help="training ranks (torchrun) of each run")
    parser.add_argument("--out", default="runs/online_throughput", help="output folder (reused: regeneration once)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    recipe = f"{args.family}_smollm2_135m"
    common = sets(data__num_prompts=args.prompts, regen__backend="hf", train__max_steps=args.steps,
                  train__save_every=args.steps, train__log_every=1)

    run_pipeline(recipe, out / "data", "regenerate", args.nproc, common, log)
    runs = {}
    for mode in ("offline", "online"):
        run = out / mode
        run.mkdir(exist_ok=True)
        if not (run / "regen").exists():
            (run / "regen").symlink_to(out / "data" / "regen", target_is_directory=True)
        stages = "cache,train" if mode == "offline" else "train"
        hidden_states = {"offline": "cache", "online": "online"}[mode]
        wall = run_pipeline(recipe, run, stages, args.nproc, common + sets(train__hidden_states=hidden_states), log)
        cache_done = run / "cache" / "DONE.json"
        figures = train_figures(run)
        figures.update(wall_s=wall, cache_s=json.loads(cache_done.read_text())["seconds"] if cache_done.is_file() else 0.0,
                       cache_bytes=folder_bytes(run / "cache"), train_bytes=folder_bytes(run / "train"))
        figures["end_to_end_s"] = figures["cache_s"] + figures["train_s"]
        figures["bytes_written"] = figures["cache_bytes"] + figures["train_bytes"]
        runs[mode] = figures

    off, on = runs["offline"], runs["online"]
    result = {"recipe": recipe, "prompts": args.prompts, "steps": args.steps, "nproc": args.nproc, "runs": runs,
              "ratios_online_over_offline": {k: ratio(on[k], off[k]) for k in
                                             ("tokens_per_s", "step_s", "end_to_end_s", "bytes_written")}}
    (out / "online_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{recipe}: {args.prompts} regenerated conversations, {args.steps} steps, {args.nproc} rank(s)")
    print(f"{'':8} {'train tok/s':>11} {'step s':>7} {'hidden s':>8} {'cache s':>8} {'cache+train s':>13} "
          f"{'bytes written':>14}")
    for mode, r in runs.items():
        print(f"{mode:8} {r['tokens_per_s']:11.0f} {r['step_s']:7.2f} {r['hidden_s']:8.2f} {r['cache_s']:8.1f} "
              f"{r['end_to_end_s']:13.1f} {r['bytes_written']:14,d}")
    ratios = result["ratios_online_over_offline"]
    print(f"online/offline: train tok/s {ratios['tokens_per_s']:.2f}x, cache+train time {ratios['end_to_end_s']:.2f}x, "
          f"bytes written {ratios['bytes_written']:.3f}x ({off['cache_bytes']:,d} cache bytes not written)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
