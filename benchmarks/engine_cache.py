"""The cache stage in-process (cache.backend hf) against a vLLM engine's hidden states (cache.backend engine), side by
side on one finished regeneration, with the default recipe's cache settings (bf16, fp8, 8 rows a forward):

    python benchmarks/engine_cache.py --regen runs/demo/regen            # the demo's 64 records, ~5 min on 2 cores
    python benchmarks/engine_cache.py --regen RUN/regen --reps 2 --recipe eagle3_smollm2_135m

Each arm is the whole stage, as pipeline.py runs it, into a fresh folder: hf loads the whole target and runs its
padded forwards; engine loads the target's embedding, norm and head only, starts a vLLM server (extract_hidden_states,
the stage's own) and sends every row. The arms alternate (hf, engine, hf, ...), so a machine's load changes both.
Prints each arm's stage seconds, the engine's server start-up among them, tokens/s, and the engine / in-process time
ratio with and without the start-up; writes OUT/engine_cache.json. The two caches' states are compared too (largest
difference of a layer's state, relative to its largest magnitude, after both went through bf16 and fp8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import ratio  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--regen", required=True, help="a finished regenerate stage's folder (read only)")
    parser.add_argument("--recipe", default="dspark_smollm2_135m")
    parser.add_argument("--reps", type=int, default=1, help="runs of each arm, alternating")
    parser.add_argument("--set", action="append", default=[], help="recipe overrides for both arms")
    parser.add_argument("--out", default="runs/engine_cache")
    args = parser.parse_args(argv)

    import torch

    from core.dist import Dist
    from core.io import atomic_write_json, make_dir
    from core.recipe import load_recipe
    from data.states.cache import TargetCache
    from data.states.capture import CacheJob, run_cache
    from modeling.target import load_target, load_target_parts, load_tokenizer

    out = Path(args.out)
    make_dir(out)
    tokenizer = None
    arms = {"hf": [], "engine": []}
    for rep in range(args.reps):
        for arm in arms:
            recipe = load_recipe(args.recipe, [*args.set, f"cache.backend={arm}"])
            if tokenizer is None:
                tokenizer = load_tokenizer(recipe.target.name_or_path)
            folder = out / f"{arm}-{rep}"
            if folder.exists():
                raise SystemExit(f"{folder} exists: give a fresh --out (each arm writes a cache from nothing)")
            loader = load_target if arm == "hf" else load_target_parts
            start = time.perf_counter()
            done = run_cache(CacheJob(recipe, Path(args.regen), folder, Dist(),
                             lambda loader=loader, name=recipe.target.name_or_path: loader(name), tokenizer))
            seconds = time.perf_counter() - start
            arms[arm].append({"stage_s": round(seconds, 2), "server_startup_s": done.get("server_startup_s", 0.0),
                              "tokens": done["tokens"], "records": done["records"]})
            print(f"[engine_cache] {arm} rep {rep}: {seconds:.1f} s for {done['records']} records, {done['tokens']} "
                  f"tokens (server start-up {done.get('server_startup_s', 0.0):.1f} s)", flush=True)

    a, b = TargetCache(str(out / "hf-0")), TargetCache(str(out / "engine-0"))
    recipe = load_recipe(args.recipe, args.set)
    hidden = a.spec.hidden_size
    worst = [0.0] * (len(recipe.target.layer_ids) + 1)
    for i in range(len(a)):
        x, y = a[i], b[i]
        for k in range(len(recipe.target.layer_ids)):
            ref = x["hidden_states"][:, k * hidden:(k + 1) * hidden].float()
            got = y["hidden_states"][:, k * hidden:(k + 1) * hidden].float()
            worst[k] = max(worst[k], ((got - ref).abs().max() / ref.abs().max()).item())
        ref, got = x["last_hidden_state"].float(), y["last_hidden_state"].float()
        worst[-1] = max(worst[-1], ((got - ref).abs().max() / ref.abs().max()).item())

    def median(arm, key):
        return statistics.median(r[key] for r in arms[arm])

    hf_s, engine_s, startup = median("hf", "stage_s"), median("engine", "stage_s"), median("engine", "server_startup_s")
    tokens = arms["hf"][0]["tokens"]
    summary = {"recipe": args.recipe, "regen": str(args.regen), "sets": args.set, "reps": args.reps, "tokens": tokens,
               "arms": arms, "hf_stage_s": hf_s, "engine_stage_s": engine_s, "engine_server_startup_s": startup,
               "speedup_engine_over_hf": round(ratio(hf_s, engine_s), 3),
               "speedup_without_startup": round(ratio(hf_s, engine_s - startup), 3),
               "max_relative_difference": {**{f"layer {lid}": w for lid, w in zip(recipe.target.layer_ids, worst)},
                                           "final norm": worst[-1]},
               "torch_threads": torch.get_num_threads()}
    atomic_write_json(out / "engine_cache.json", summary)
    print(f"\n{'arm':<10}{'stage s':>10}{'start-up s':>12}{'tokens/s':>10}\n"
          f"{'hf':<10}{hf_s:>10.1f}{0:>12.1f}{tokens / hf_s:>10.0f}\n"
          f"{'engine':<10}{engine_s:>10.1f}{startup:>12.1f}{tokens / engine_s:>10.0f}\n"
          f"engine speed-up over in-process: {summary['speedup_engine_over_hf']:.2f}x the stage, "
          f"{summary['speedup_without_startup']:.2f}x without the server's start-up\n"
          f"largest state difference (bf16 + fp8 cache): {max(worst):.2e} of the state's largest magnitude "
          f"({out / 'engine_cache.json'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
