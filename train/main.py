"""DraftSmith's one entry point: run a recipe's stages in order.

    torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m --stages regenerate,cache --set data.num_prompts=64
    python train/main.py --list-recipes

Stages: regenerate (the target answers the prompts) -> cache (target hidden states) -> train -> eval -> export
(an SGLang checkpoint in runs/<recipe>/export/sglang, with the eval's STS calibration beside a DSpark draft).
Each stage writes into --out (default runs/<recipe>) and is skipped when its output is already complete, so
rerunning the same command after a crash resumes where it stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# `python train/main.py` puts train/ first on sys.path; the project root must come first so that the top-level
# packages (data, modeling, ...) resolve even without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.recipe import RecipeError, list_recipes, load_recipe, recipe_to_dict  # noqa: E402

STAGES = ("regenerate", "cache", "train", "eval", "export")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a speculative-decoding drafter: regenerate -> cache -> train -> eval -> export.",
        epilog="Example: torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m "
               "--stages regenerate,cache --set data.num_prompts=64",
    )
    parser.add_argument("--recipe", help="recipe name (see --list-recipes) or path to a recipe .yaml")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated stages to run, in order, from {','.join(STAGES)} (default: all)")
    parser.add_argument("--out", help="output folder for every stage (default: runs/<recipe>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set data.num_prompts=64 (repeatable; values are YAML)")
    parser.add_argument("--list-recipes", action="store_true", help="print every recipe name, one a line, and exit")
    args = parser.parse_args(argv)
    if not args.list_recipes and not args.recipe:
        parser.error("--recipe is required (see --list-recipes)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_recipes:
        print("\n".join(list_recipes()))
        return 0
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"error: unknown stage(s) {unknown}; stages are {', '.join(STAGES)}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("runs") / recipe.name)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var) is None and recipe.target.name_or_path == "smollm2-135m-instruct":
            os.environ[var] = "1"  # the embedded target never needs the hub

    import yaml

    from train.dist import close_dist, init_dist

    dist = init_dist()
    try:
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
        dist.print(f"[draftsmith] recipe {recipe.name} ({recipe.family}), target {recipe.target.name_or_path}, "
                   f"stages {','.join(stages)}, out {out}, {dist.world_size} rank(s) on {dist.device.type}")
        run_stages(recipe, stages, out, dist)
    finally:
        close_dist()
    return 0


def run_stages(recipe, stages: list[str], out: Path, dist) -> None:
    from modeling.target import load_target, load_tokenizer

    tokenizer = load_tokenizer(recipe.target.name_or_path)
    model = None

    def target():
        nonlocal model
        if model is None:
            model = load_target(recipe.target.name_or_path, dist.device, recipe.target.dtype)
        return model

    eval_report = None
    for name in stages:
        start = time.perf_counter()
        if name == "regenerate":
            from data.regenerate import run_regenerate

            run_regenerate(recipe, out / "regen", dist, target, tokenizer)
        elif name == "cache":
            from data.capture import run_cache

            run_cache(recipe, out / "regen", out / "cache", dist, target, tokenizer)
        elif name == "train":
            from data.capture import open_cache
            from modeling.target import target_hidden_size
            from train.trainer import run_train

            cache = open_cache(recipe, out / "cache", target_hidden_size(recipe.target.name_or_path), tokenizer)
            run_train(recipe, cache, out / "train", dist, target)
        elif name == "eval":
            eval_report = run_eval_stage(recipe, out, dist, target)
        elif name == "export":
            if dist.is_main:
                from export.main import export_draft, serve_command
                from modeling.target import resolve_target

                sts = out / "eval" / "sts.json"
                path = export_draft(out / "train" / "final", "sglang", out / "export" / "sglang",
                                    sts_path=sts if sts.is_file() else None, overwrite=True)
                command = serve_command(out / "train" / "final", "sglang", path,
                                        resolve_target(recipe.target.name_or_path))
                print(f"[export] SGLang checkpoint: {path}\n[export] serve it (GPU) with: {command}", flush=True)
            dist.barrier()
        dist.print(f"[{name}] stage time {time.perf_counter() - start:.1f} s")
    if eval_report is not None:  # rank 0, eval among the stages
        print(f"[draftsmith] done: accept length tau = {eval_report['accept_len']:.3f} "
              f"({out / 'eval' / 'report.json'})", flush=True)


def run_eval_stage(recipe, out: Path, dist, target) -> dict | None:
    """Speculative decoding with the trained drafter on recipe.eval's prompts (batch size 1, on rank 0, with the
    target the run already holds). Returns the report on rank 0."""
    import json

    from eval.run import print_summary, run_eval
    from train import stage

    eval_dir, report = out / "eval", None
    if dist.is_main:
        if stage.is_done(eval_dir):
            print(f"[eval] {eval_dir} is complete; skipping", flush=True)
            report = json.loads((eval_dir / "report.json").read_text())
        else:
            report = run_eval(draft=str(out / "train" / "final"), target_name=recipe.target.name_or_path,
                              dataset=recipe.eval.dataset, out_dir=eval_dir, num_samples=recipe.eval.num_samples,
                              temperature=recipe.eval.temperature, block_size=None,
                              max_new_tokens=recipe.eval.max_new_tokens, seed=recipe.seed,
                              system_prompt=recipe.data.system_prompt, enable_thinking=recipe.regen.enable_thinking,
                              target=target())
            # written last, after report.md and the plot: a crash before it reruns the stage
            stage.mark_done(eval_dir, {"accept_len": report["accept_len"]})
        print_summary(report)
    dist.barrier()
    return report


if __name__ == "__main__":
    sys.exit(main())
