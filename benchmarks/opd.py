"""SFT + on-policy distillation (the opd stage) against SFT alone at the same compute, on held-out prompts.

    python benchmarks/opd.py --train-prompts 128 --sft-steps 100 --opd-rounds 3 --opd-steps 20   # ~1 h, 2 cores
    python benchmarks/opd.py --families dspark --train-prompts 16 --sft-steps 6 --opd-rounds 1 --opd-steps 3  # smoke

Data as benchmarks/quality.py: greedy SmolLM2 answers to ShareGPT prompts for training; MT-bench and HumanEval
(+ GSM8K test with --gsm8k) prompts, never trained on, for evaluation. For each family, from the same data:
  sft       train.max_steps = S: the start both arms share;
  sft+opd   then opd.rounds R of opd.steps_per_round M; its compute = the rollouts' seconds + its training steps'
            seconds (the opd stage records both);
  sft-long  SFT alone with that compute spent on more SFT: one run of S + E steps, E = the opd compute / the median
            SFT step's seconds (same machine, same ranks; wall seconds of a 2-core machine are its CPU seconds / 2).
Each final draft's held-out tau is replayed at T=0 on the eval prompts' greedy answers (eval/replay.py, equal to the
real loop's rounds); the ratio sft+opd / sft-long is the answer. Writes OUT/opd.json and OUT/opd.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.quality import (FAMILIES, link_data, open_eval_cache, prepare_data, ratio, run_pipeline,  # noqa: E402
                                sets)


def step_seconds(train_dir: Path) -> list[float]:
    return [json.loads(line)["step_s"] for line in (train_dir / "metrics.jsonl").read_text().splitlines()]


def opd_seconds(opd_dir: Path) -> float:
    """Rollouts plus the rounds' training steps."""
    rounds = json.loads((opd_dir / "DONE.json").read_text())["rounds"]
    rollouts = sum(r.get("rollout_s", 0.0) for r in rounds)
    return rollouts + sum(sum(step_seconds(p)) for p in sorted(opd_dir.glob("round-*")))


def markdown(result: dict) -> str:
    lines = [f"# SFT + OPD vs SFT alone at the same compute ({result['num_eval_prompts']} held-out prompts: "
             f"{', '.join(result['eval_sources'])}; T=0, {result['max_new_tokens']} new tokens)", "",
             f"Training data: {result['train_records']} greedy SmolLM2 conversations ({result['train_sources']}). "
             f"SFT {result['sft_steps']} steps; OPD {result['opd_rounds']} rounds x {result['opd_steps']} steps over "
             f"{result['rollout_records']} rolled-out conversations a round; {result['nproc']} rank(s).", "",
             "| family | SFT tau | SFT+OPD tau | SFT-long tau | SFT+OPD / SFT-long | OPD compute (s) | SFT-long extra "
             "steps | rollout tau by round |", "|---|---|---|---|---|---|---|---|"]
    for family, r in result["families"].items():
        lines.append(f"| {family} | {r['tau']['sft']:.3f} | {r['tau']['sft+opd']:.3f} | {r['tau']['sft-long']:.3f} | "
                     f"{r['opd_vs_sft_long']:.3f} | {r['opd_s']:.0f} | {r['extra_steps']} | "
                     f"{' -> '.join(f'{t:.2f}' for t in r['rollout_tau'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "opd_bench", help="work folder (runs/opd_bench)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (dspark,dflash,eagle3)")
    parser.add_argument("--train-prompts", type=int, default=128, help="training prompts to regenerate (128)")
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
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if set(families) - set(FAMILIES):
        parser.error(f"unknown families {sorted(set(families) - set(FAMILIES))}; known: {', '.join(FAMILIES)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pipeline.log"
    data_run, eval_run, eval_file, eval_sources, sources, _ = prepare_data(
        out, args.train_prompts, args.gsm8k, args.eval_per_source, args.max_new_tokens, args.nproc, log)

    from core.recipe import load_recipe
    from eval.replay import replay_records
    from modeling.registry import load_draft_model
    from modeling.target import load_tokenizer
    from train.opd import draft_gamma

    extra = [arg for item in args.overrides for arg in ("--set", item)]
    results = {}
    for family in families:
        recipe_name = f"{family}_smollm2_135m"
        recipe = load_recipe(recipe_name)
        # a replayed answer ends where the loop stops
        eos_token_id = load_tokenizer(recipe.target.name_or_path).eos_token_id
        eval_cache = open_eval_cache(recipe_name, eval_run)
        eval_records = [eval_cache[i] for i in range(len(eval_cache))]

        def held_out(draft_dir: Path) -> float:
            model = load_draft_model(draft_dir).float()
            return replay_records(model, eval_records, draft_gamma(recipe), args.max_new_tokens,
                                  eos_token_id)["accept_len"]

        run = out / family / "sft-opd"
        link_data(data_run, run)
        opd_sets = extra + sets(train__max_steps=args.sft_steps, opd__rounds=args.opd_rounds,
                                opd__steps_per_round=args.opd_steps, opd__rollout_records=args.rollout_records)
        run_pipeline(recipe_name, run, "train,opd", args.nproc, opd_sets, log)
        per_step = statistics.median(step_seconds(run / "train")[1:] or step_seconds(run / "train"))
        spent = opd_seconds(run / "opd")
        extra_steps = max(1, round(spent / per_step))
        long = out / family / "sft-long"
        link_data(data_run, long)
        run_pipeline(recipe_name, long, "train", args.nproc,
                     extra + sets(train__max_steps=args.sft_steps + extra_steps), log)
        tau = {"sft": held_out(run / "train" / "final"), "sft+opd": held_out(run / "opd" / "final"),
               "sft-long": held_out(long / "train" / "final")}
        rounds = json.loads((run / "opd" / "DONE.json").read_text())["rounds"]
        results[family] = {"tau": tau, "opd_vs_sft_long": ratio(tau["sft+opd"], tau["sft-long"]),
                           "opd_vs_sft": ratio(tau["sft+opd"], tau["sft"]), "opd_s": spent,
                           "sft_step_s": per_step, "extra_steps": extra_steps,
                           "sft_long_extra_s": sum(step_seconds(long / "train")[args.sft_steps:]),
                           "rollout_tau": [r["rollout_tau"] for r in rounds]}
        print(f"[opd-bench] {family}: held-out tau SFT {tau['sft']:.3f}, SFT+OPD {tau['sft+opd']:.3f}, SFT-long "
              f"{tau['sft-long']:.3f} (+{extra_steps} steps = {spent:.0f} s of OPD compute); "
              f"SFT+OPD / SFT-long {results[family]['opd_vs_sft_long']:.3f}", flush=True)
        # written after every family: a long run stopped midway keeps the families it finished
        train_manifest = json.loads((data_run / "cache" / "manifest.json").read_text())
        result = {"families": results, "sft_steps": args.sft_steps, "opd_rounds": args.opd_rounds,
                  "opd_steps": args.opd_steps, "rollout_records": args.rollout_records, "nproc": args.nproc,
                  "train_sources": sources, "train_records": train_manifest["num_records"], "eval_sources": eval_sources,
                  "num_eval_prompts": len(eval_file.read_text().splitlines()), "max_new_tokens": args.max_new_tokens}
        (out / "opd.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "opd.md").write_text(markdown(result))

    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
