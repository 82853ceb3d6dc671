"""Regeneration backends side by side in one run: tokens/s on the same prompts, and whether the answers are the same.

    python benchmarks/regenerate.py                          # dspark_smollm2_135m, 96 ShareGPT prompts, ~16 min
    python benchmarks/regenerate.py --prompts 16 --arms hf-padded,vllm
    python benchmarks/regenerate.py --prompts 640 --arms hf,vllm --baseline hf   # at scale: the default path vs vLLM

Every arm runs the recipe's regenerate stage (`train/main.py --stages regenerate`, greedy, the recipe's
data.max_turns and regen.max_new_tokens) into its own folder, on the same prompts:
  hf-padded  torchrun, 2 ranks x 1 thread, HF generate with its own prefill of each left-padded batch (the stage
             before the tuned path: the baseline every ratio divides by unless --baseline names another arm);
  hf         the same with regen.prefill: each (the tuned in-process path: each prompt prefilled alone on a CPU);
  hf-torch   hf with DRAFTSMITH_ONEDNN=0: the target's CPU products as torch's own (MKL on x86) instead of oneDNN
             over prepacked weights (modeling/cpu_linear.py), to show what that gives;
  hf-before  hf with DRAFTSMITH_ONEDNN=0 and DRAFTSMITH_MALLOC=0 (glibc's malloc as it ships, core/malloc.py): the
             in-process path before either change;
  vllm       regen.backend: vllm, one process: the stage starts a vLLM server on all the cores and stops it after;
  vllm-2     regen.backend: vllm under torchrun with 2 ranks: one server per rank, each on its own core.
Prints tokens/s (the stage's own figure, server start included; and without it), the ratio to hf-padded, and the
share of conversations and of answer tokens equal to the baseline's token for token. Writes OUT/regenerate.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import ratio, run_pipeline, sets  # noqa: E402

ARMS = {  # name: (ranks, recipe overrides, environment)
    "hf-padded": (2, {"regen__backend": "hf", "regen__prefill": "padded"}, {}),
    "hf": (2, {"regen__backend": "hf", "regen__prefill": "each"}, {}),
    "hf-torch": (2, {"regen__backend": "hf", "regen__prefill": "each"}, {"DRAFTSMITH_ONEDNN": "0"}),
    "hf-before": (2, {"regen__backend": "hf", "regen__prefill": "each"},
                  {"DRAFTSMITH_ONEDNN": "0", "DRAFTSMITH_MALLOC": "0"}),
    "vllm": (1, {"regen__backend": "vllm"}, {}),
    "vllm-2": (2, {"regen__backend": "vllm"}, {}),
}
BASELINE = "hf-padded"


def answers(folder: Path) -> dict[str, list[list[int]]]:
    with open(folder / "records.jsonl") as handle:
        return {r["id"]: r["response_ids"] for r in map(json.loads, handle)}


def same_share(mine: dict, base: dict) -> tuple[float, float]:
    """(share of base's conversations whose answers equal, share of base's answer tokens in those conversations)."""
    equal = [k for k in base if mine.get(k) == base[k]]
    tokens = lambda keys: sum(len(ids) for k in keys for ids in base[k])  # noqa: E731
    return len(equal) / max(len(base), 1), tokens(equal) / max(tokens(base), 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--recipe", default="dspark_smollm2_135m")
    parser.add_argument("--prompts", type=int, default=96, help="training prompts every arm regenerates")
    parser.add_argument("--arms", default="hf-padded,hf,vllm", help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--out", default="runs/regenerate_bench", help="output folder (an arm already done is reused)")
    parser.add_argument("--baseline", default=BASELINE,
                        help=f"the arm every ratio and sameness share is taken against ({BASELINE}); one of --arms")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or args.baseline not in arms:
        parser.error(f"--arms {args.arms}: unknown {unknown}; known {', '.join(ARMS)}, and --baseline "
                     f"{args.baseline} must be one of them")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"

    rows = {}
    for name in arms:
        ranks, overrides, env = ARMS[name]
        run = out / name
        wall = run_pipeline(args.recipe, run, "regenerate", ranks,
                            sets(data__num_prompts=args.prompts, regen__temperature=0.0, **overrides), log, env)
        done = json.loads((run / "regen" / "DONE.json").read_text())
        startup = done.get("server_startup_s", 0.0)
        rows[name] = {"ranks": ranks, "tokens": done["tokens_this_run"], "seconds": done["seconds"],
                      "tokens_per_s": done["tokens_per_s"], "server_startup_s": startup,
                      "tokens_per_s_after_startup": done["tokens_this_run"] / max(done["seconds"] - startup, 1e-9),
                      "process_wall_s": wall}
    baseline = args.baseline
    base = answers(out / baseline / "regen")
    for name, row in rows.items():
        row["conversations_equal"], row["tokens_equal"] = same_share(answers(out / name / "regen"), base)
        row["speedup"] = ratio(row["tokens_per_s"], rows[baseline]["tokens_per_s"])
        row["speedup_after_startup"] = ratio(row["tokens_per_s_after_startup"], rows[baseline]["tokens_per_s"])

    result = {"recipe": args.recipe, "prompts": args.prompts, "conversations": len(base), "baseline": baseline,
              "arms": rows}
    (out / "regenerate.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{args.recipe}: {len(base)} conversations, greedy; ratios against {baseline}")
    print(f"{'arm':<10} {'ranks':>5} {'tokens':>7} {'s':>7} {'tok/s':>7} {'x':>6} {'start s':>8} "
          f"{'tok/s w/o start':>16} {'x':>6} {'same conv':>9} {'same tok':>9}")
    for name, r in rows.items():
        print(f"{name:<10} {r['ranks']:>5} {r['tokens']:>7} {r['seconds']:>7.1f} {r['tokens_per_s']:>7.1f} "
              f"{r['speedup']:>5.2f}x {r['server_startup_s']:>8.1f} {r['tokens_per_s_after_startup']:>16.1f} "
              f"{r['speedup_after_startup']:>5.2f}x {r['conversations_equal']:>9.0%} {r['tokens_equal']:>9.0%}")
    print(f"written: {out / 'regenerate.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
