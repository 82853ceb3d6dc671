"""SFT + on-policy distillation (the opd stage) against SFT alone at the same compute, on held-out prompts.

    python benchmarks/opd.py --train-prompts 128 --sft-steps 100 --opd-rounds 3 --opd-steps 20   # ~1 h, 2 cores
    python benchmarks/opd.py --families dspark --train-prompts 16 --sft-steps 6 --opd-rounds 1 --opd-steps 3  # smoke
    python benchmarks/opd.py --out runs/q60 --sft-from runs/q60/dspark --gsm8k ../shared/data/gsm8k \
        --eval-per-source 6 --opd-rounds 3 --opd-steps 100 --rollout-records 256      # from quality.py's finished run

Data as benchmarks/quality.py: greedy SmolLM2 answers to ShareGPT prompts for training; MT-bench and HumanEval
(+ GSM8K test with --gsm8k) prompts, never trained on, for evaluation. For each family, from the same data:
  sft            train.max_steps = S, or the finished train stage of --sft-from: the start both arms share;
  sft+opd        then opd.rounds R of opd.steps_per_round M, anchored at the rollouts' round starts; its compute =
                 the rollouts' seconds + its training steps' seconds (the opd stage records both);
  sft-continued  SFT alone with that compute: the same R rounds over the same conversations at the same lr, anchored
                 anywhere in the answers as SFT is (opd.anchors=uniform, nothing rolled out), with the rollouts'
                 seconds spent on more steps a round (the median OPD step's seconds; same machine, same ranks).
Each final draft's held-out tau is replayed at T=0 on the eval prompts' greedy answers (eval/replay.py, equal to the
real loop's rounds); the ratio sft+opd / sft-continued is the answer. Writes OUT/opd.json and OUT/opd.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (link_data, open_eval_cache, prepare_data, prepare_eval_data, ratio,  # noqa: E402
                                run_pipeline, sets)
from core.recipe import FAMILIES  # noqa: E402
from eval.compare import format_ratio, paired_ratio  # noqa: E402


def step_seconds(train_dir: Path) -> list[float]:
    return [json.loads(line)["step_s"] for line in (train_dir / "metrics.jsonl").read_text().splitlines()]


def rounds_of(opd_dir: Path) -> list[dict]:
    return json.loads((opd_dir / "DONE.json").read_text())["rounds"]


def opd_seconds(opd_dir: Path) -> float:
    """Rollouts plus the rounds' training steps."""
    rollouts = sum(r.get("rollout_s", 0.0) for r in rounds_of(opd_dir))
    return rollouts + sum(sum(step_seconds(p)) for p in sorted(opd_dir.glob("round-*")))


def markdown(result: dict) -> str:
    start = (f"the finished train stage of {result['sft_from']}" if result.get("sft_from")
             else f"SFT {result['sft_steps']} steps")
    lines = [f"# SFT + OPD vs SFT alone at the same compute ({result['num_eval_prompts']} held-out prompts: "
             f"{', '.join(result['eval_sources'])}; T=0, {result['max_new_tokens']} new tokens)", "",
             f"Training data: {result['train_records']} greedy SmolLM2 conversations ({result['train_sources']}). "
             f"Start: {start}; then OPD {result['opd_rounds']} rounds x {result['opd_steps']} steps over "
             f"{result['rollout_records']} rolled-out conversations a round, against SFT continued over the same "
             f"rounds and conversations at the same compute; {result['nproc']} rank(s).", "",
             "| family | SFT tau | SFT+OPD tau | SFT continued tau | SFT+OPD / SFT continued [90% paired bootstrap] | "
             "compute (s) OPD / continued | steps a round OPD / continued | rollout tau by round |",
             "|---|---|---|---|---|---|---|---|"]
    for family, r in result["families"].items():
        lines.append(f"| {family} | {r['tau']['sft']:.3f} | {r['tau']['sft+opd']:.3f} | {r['tau']['sft-continued']:.3f}"
                     # results saved before the interval was computed have none
                     f" | {format_ratio(r['opd_vs_sft_continued'], *r.get('opd_vs_sft_continued_90', (None, None)))} | "
                     f"{r['opd_s']:.0f} / {r['continued_s']:.0f} | "
                     f"{result['opd_steps']} / {r['continued_steps']} | "
                     f"{' -> '.join(f'{t:.2f}' for t in r['rollout_tau'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "opd_bench", help="work folder (runs/opd_bench)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (dspark,dflash,eagle3)")
    parser.add_argument("--sft-from", type=Path, metavar="RUN",
                        help="start both arms from this finished run of one family (e.g. runs/q60/dspark, made by "
                             "quality.py): its train/final, regen and cache, read with its recipe.yaml; no SFT and no "
                             "training data are made (--train-prompts, --sft-steps and --families are not used)")
    parser.add_argument("--train-prompts", type=int, default=128, help="training prompts to regenerate (128)")
    parser.add_argument("--regen-backend", choices=("hf", "vllm"), default="hf",
                        help="what answers the training prompts (hf; vllm: one server on every core)")
    parser.add_argument("--eval-per-source", type=int, default=6, help="held-out prompts per eval source (6)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer tokens per eval prompt (128)")
    parser.add_argument("--gsm8k", type=Path, help="folder with GSM8K train.jsonl/test.jsonl (optional)")
    parser.add_argument("--sft-steps", type=int, default=100, help="SFT steps both arms start from (100)")
    parser.add_argument("--opd-rounds", type=int, default=3, help="opd rounds (3)")
    parser.add_argument("--opd-steps", type=int, default=20, help="optimizer steps per opd round (20)")
    parser.add_argument("--rollout-records", type=int, default=64, help="conversations rolled out per round (64)")
    parser.add_argument("--nproc", type=int, default=2, help="training ranks (2)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra recipe override for every training run (repeatable)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pipeline.log"

    from core.recipe import load_recipe
    from eval.replay import replay_records
    from modeling.registry import load_draft_model
    from modeling.target import load_tokenizer
    from train.opd import draft_gamma

    if args.sft_from:
        sft_from = args.sft_from.resolve()
        if not all((sft_from / name).is_file() for name in ("train/final/model.safetensors", "recipe.yaml")):
            parser.error(f"--sft-from {args.sft_from}: no finished run there (train/final/model.safetensors and "
                         f"recipe.yaml); give a family's folder of a quality.py run, e.g. runs/q60/dspark")
        sft_recipe = load_recipe(str(sft_from / "recipe.yaml"))
        recipe_names = {sft_recipe.family: str(sft_from / "recipe.yaml")}
        # the sources the data was made from (the run's recipe.yaml says what its train stage was given)
        regen_sources = json.loads((sft_from / "regen" / "settings.json").read_text())["data"]["sources"]
        data_run, sources = sft_from, ", ".join(source["name"] for source in regen_sources)
        eval_run, eval_file, eval_sources = prepare_eval_data(out, args.eval_per_source, args.gsm8k,
                                                              args.max_new_tokens, args.nproc, log)
    else:
        families = [f.strip() for f in args.families.split(",") if f.strip()]
        if set(families) - set(FAMILIES):
            parser.error(f"unknown families {sorted(set(families) - set(FAMILIES))}; known: {', '.join(FAMILIES)}")
        recipe_names = {family: f"{family}_smollm2_135m" for family in families}
        data_run, eval_run, eval_file, eval_sources, sources, _ = prepare_data(
            out, args.train_prompts, args.gsm8k, args.eval_per_source, args.max_new_tokens, args.nproc, log,
            regen_backend=args.regen_backend)

    extra = [arg for item in args.overrides for arg in ("--set", item)]
    rounds = sets(opd__rounds=args.opd_rounds, opd__rollout_records=args.rollout_records)
    results = {}
    for family, recipe_name in recipe_names.items():
        recipe = load_recipe(recipe_name)
        # a replayed answer ends where the loop stops
        eos_token_id = load_tokenizer(recipe.target.name_or_path).eos_token_id
        eval_cache = open_eval_cache(recipe_name, eval_run)
        eval_records = [eval_cache[i] for i in range(len(eval_cache))]

        def held_out(draft_dir: Path) -> dict:
            """Replayed held-out tau, with each prompt's tokens and rounds for paired_ratio's interval."""
            model = load_draft_model(draft_dir).float()
            replay = replay_records(model, eval_records, draft_gamma(recipe), args.max_new_tokens, eos_token_id)
            return {"replayed_tau": replay["accept_len"], "per_record_tokens": replay["per_record_tokens"],
                    "per_record_rounds": replay["per_record_rounds"]}

        # beside the --sft-from folder, not inside it (as quality.py's arms: OUT/<family>-NAME)
        run = out / f"{family}-sft-opd"
        if args.sft_from:
            link_data(data_run, run, ("regen", "cache", "train"))
            run_pipeline(recipe_name, run, "opd", args.nproc,
                         extra + rounds + sets(opd__steps_per_round=args.opd_steps), log)
        else:
            link_data(data_run, run)
            run_pipeline(recipe_name, run, "train,opd", args.nproc, extra + rounds + sets(
                train__max_steps=args.sft_steps, opd__steps_per_round=args.opd_steps), log)
        spent = opd_seconds(run / "opd")
        per_step = statistics.median(s for p in sorted((run / "opd").glob("round-*")) for s in step_seconds(p))
        # the same compute: the rollouts' seconds become more steps in every round
        continued_steps = max(args.opd_steps, round(spent / per_step / args.opd_rounds))
        continued = out / f"{family}-sft-continued"
        link_data(run, continued, ("regen", "cache", "train"))
        run_pipeline(recipe_name, continued, "opd", args.nproc, extra + rounds + sets(
            opd__steps_per_round=continued_steps, opd__anchors="uniform"), log)
        replays = {"sft": held_out(run / "train" / "final"), "sft+opd": held_out(run / "opd" / "final"),
                   "sft-continued": held_out(continued / "opd" / "final")}
        tau = {arm: replay["replayed_tau"] for arm, replay in replays.items()}
        value, low, high = paired_ratio(replays["sft+opd"], replays["sft-continued"])
        results[family] = {"tau": tau, "opd_vs_sft_continued": value, "opd_vs_sft_continued_90": [low, high],
                           "opd_vs_sft": ratio(tau["sft+opd"], tau["sft"]), "opd_s": spent,
                           "continued_s": opd_seconds(continued / "opd"), "opd_step_s": per_step,
                           "continued_steps": continued_steps,
                           "rollout_tau": [r["rollout_tau"] for r in rounds_of(run / "opd")]}
        r = results[family]
        print(f"[opd-bench] {family}: held-out tau SFT {tau['sft']:.3f}, SFT+OPD {tau['sft+opd']:.3f} ({spent:.0f} s), "
              f"SFT continued {tau['sft-continued']:.3f} ({r['continued_s']:.0f} s, {continued_steps} steps a round); "
              f"SFT+OPD / SFT continued {format_ratio(value, low, high)}", flush=True)
        # written after every family: a long run stopped midway keeps the families it finished
        train_manifest = json.loads((run / "cache" / "manifest.json").read_text())
        result = {"families": results, "sft_steps": None if args.sft_from else args.sft_steps,
                  "sft_from": str(args.sft_from) if args.sft_from else None, "opd_rounds": args.opd_rounds,
                  "opd_steps": args.opd_steps, "rollout_records": args.rollout_records, "nproc": args.nproc,
                  "train_sources": sources, "train_records": train_manifest["num_records"],
                  "eval_sources": eval_sources,
                  "num_eval_prompts": len(eval_file.read_text().splitlines()), "max_new_tokens": args.max_new_tokens}
        (out / "opd.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "opd.md").write_text(markdown(result))

    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
