"""What a training lever gives: one family trained on the same data with and without it, at equal steps (the same
batches and schedule), scored by held-out tau replayed on prompts from other sources. The figures of
benchmarks/README.md's "What each lever gave" and "Hidden-state cache encoding" tables.

    python benchmarks/levers.py --gsm8k ../shared/data/gsm8k --steps 240 --regen-prompts 128 --source-prompts 384 \\
        --variant full-vocab:loss.vocab_size=null --variant lr3e-3:train.lr=3e-3     # about 75 min on 2 CPU cores
    python benchmarks/levers.py --steps 8 --regen-prompts 8 --source-prompts 8 --eval-per-source 1  # a smoke run
    python benchmarks/levers.py --gsm8k ../shared/data/gsm8k --steps 240 --regen-prompts 0 --source-prompts 384 \\
        --encoding fp8      # the fp8 cache against the raw bf16 one at equal steps, ~35 min on 2 cores (estimated)

1. Held-out prompts (MT-bench, HumanEval, + GSM8K test) with their greedy answers, regenerated and cached.
2. Training data two ways from the same sources (ShareGPT, + GSM8K train), one turn each: the target regenerates
   --regen-prompts answers (regen data), and the sources' own answers of --source-prompts conversations are cached
   as they are (source data: regen.backend=source, the target's argmax as the label). Each way's CPU seconds printed.
   --regen-prompts 0 skips the regen data and its arm. Each --encoding caches the source data's records again in
   that cache.encoding (the base arms' caches are raw).
3. The family trains on each data (the recipe as it is: the base arms), then once per --variant on the source data
   with the variant's overrides, and once per --encoding on its cache; checkpoints at a quarter of the steps each
   replay the held-out tau (the eval data stays raw: at inference the drafter reads the target's own states).

Writes OUT/levers.json and prints a table: arm, data, steps, seconds a step, held-out tau at each checkpoint; and the
tau of each --encoding arm over the source arm's at each checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (learning_curve, link_data, open_eval_cache, parse_arm,  # noqa: E402
                                prepare_eval_data, run_pipeline, sets, source_sets, training_sources)
from core.recipe import FAMILIES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "levers", help="work folder (runs/levers)")
    parser.add_argument("--family", default="dspark", choices=FAMILIES)
    parser.add_argument("--steps", type=int, default=240, help="optimizer steps of every arm (240)")
    parser.add_argument("--regen-prompts", type=int, default=128, help="prompts the target regenerates (128)")
    parser.add_argument("--source-prompts", type=int, default=384, help="conversations kept as the source wrote them")
    parser.add_argument("--eval-per-source", type=int, default=4, help="held-out prompts per eval source (4)")
    parser.add_argument("--gsm8k", type=Path, help="folder with GSM8K train.jsonl/test.jsonl")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (2)")
    parser.add_argument("--variant", dest="variants", action="append", default=[], type=parse_arm,
                        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="an arm on the source data with these recipe overrides (repeatable)")
    parser.add_argument("--encoding", action="append", default=[], choices=("fp8",),
                        help="an arm on the source data cached in this cache.encoding (repeatable)")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pipeline.log"
    recipe = f"{args.family}_smollm2_135m"
    # the base arms' caches are raw whatever the default: the --encoding arms are measured against them
    raw = sets(cache__encoding="raw")
    source_labels = source_sets("source") + raw

    prepare_eval_data(out, args.eval_per_source, args.gsm8k, 128, args.nproc, log)
    sources = training_sources(args.gsm8k)
    data = {}
    ways = [("regen", args.regen_prompts, raw, "regenerate,cache")] if args.regen_prompts else []
    ways.append(("source", args.source_prompts, source_labels, "regenerate,cache"))
    # the source records again, cached in another encoding (the cache stage pins their digest, not their folder)
    ways += [(f"source-{encoding}", args.source_prompts, source_labels + sets(cache__encoding=encoding), "cache")
             for encoding in args.encoding]
    for name, prompts, extra, stages in ways:
        if stages == "cache":
            link_data(out / "source-data", out / f"{name}-data", names=("regen",))
        seconds = run_pipeline(recipe, out / f"{name}-data", stages, args.nproc,
                               sets(data__sources=sources, data__max_turns=1, data__num_prompts=prompts) + extra, log)
        manifest = json.loads((out / f"{name}-data" / "cache" / "manifest.json").read_text())
        data[name] = {"seconds": seconds, "records": manifest["num_records"], "tokens": manifest["num_tokens"],
                      "cache_bytes": sum(s["num_bytes"] for s in manifest["shards"])}
        print(f"[levers] {name} data: {data[name]}", flush=True)

    eval_cache = open_eval_cache(recipe, out / "eval-data")
    from core.recipe import load_recipe  # torch-heavy: imported where the work starts
    from modeling.target import load_tokenizer

    eos_token_id = load_tokenizer(load_recipe(recipe).target.name_or_path).eos_token_id  # a replayed answer ends there
    arms = [("regen", "regen", raw)] if args.regen_prompts else []
    arms += [("source", "source", source_labels)]
    arms += [(name, "source", source_labels + extra) for name, extra in args.variants]
    arms += [(encoding, f"source-{encoding}", source_labels + sets(cache__encoding=encoding))
             for encoding in args.encoding]
    results = {}
    for name, data_name, extra in arms:
        run = out / f"arm-{name}"
        link_data(out / f"{data_name}-data", run)
        seconds = run_pipeline(recipe, run, "train", args.nproc, extra + sets(
            train__max_steps=args.steps, train__save_every=max(1, args.steps // 4), train__keep_checkpoints=0), log)
        results[name] = {"data": data_name, "train_s": seconds, "s_per_step": seconds / args.steps,
                         "curve": learning_curve(run, eval_cache, 7, 128, eos_token_id)}
    for encoding in args.encoding:  # same steps and batches: checkpoint k of one arm against checkpoint k of the other
        results[encoding]["tau_over_source"] = [p["replayed_tau"] / q["replayed_tau"] for p, q in zip(
            results[encoding]["curve"], results["source"]["curve"])]
    (out / "levers.json").write_text(json.dumps({"data": data, "arms": results}, indent=2) + "\n")
    print(f"\n{'arm':<16} {'data':<10} {'s/step':>7}  held-out tau by step")
    for name, row in results.items():
        curve = "  ".join(f"{p['step']}: {p['replayed_tau']:.3f}" for p in row["curve"])
        print(f"{name:<16} {row['data']:<10} {row['s_per_step']:>7.2f}  {curve}")
    for encoding in args.encoding:
        ratios = "  ".join(f"{p['step']}: {r:.4f}" for p, r in zip(results[encoding]["curve"],
                                                                   results[encoding]["tau_over_source"]))
        print(f"held-out tau, {encoding} cache over raw bf16 (source arm), by step: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
