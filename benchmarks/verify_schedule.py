"""DSpark's verify scheduler in the batch-1 loop against fixed draft lengths and n-gram lookup, on held-out prompts.

    python benchmarks/verify_schedule.py --draft runs/q60/dspark/train/final \\
        --eval-prompts runs/q60/eval_prompts.jsonl --calibration-prompts runs/q60/in_distribution_prompts.jsonl

On a CPU a verify of 1 + l tokens costs more the larger l (on the 2-core Xeon the 8-token verify of gamma 7 costs
1.36 plain steps), so a drafter whose later drafts are seldom accepted pays for verifying them. DSpark's confidence
head says, before the verify, how likely each draft is to survive; its scheduler (the paper's Algorithm 1,
eval/scheduler.py) verifies a draft only while the expected tokens pay for the longer verify. In one process, with
one target and the same plain-loop baseline for every arm (T=0, exact match checked on every prompt):
  1. calibration: the draft at gamma = --gamma on --calibration-prompts (prompts it never trained on, not the eval
     ones: quality.py writes its training sources' unseen prompts there), whose eval writes sts.json; the draft
     drafts over the whole vocabulary throughout, as SGLang serves it (a token map is ignored);
  2. on --eval-prompts: the draft at each fixed gamma in --gammas and at --gamma; the confidence schedule, uncalibrated
     and with that sts.json; the n-gram drafter at the same fixed gammas (its best is the baseline to beat).
Prints and writes OUT/verify_schedule.{json,md}: tau, drafts verified a round, ms a round, speedup over the plain loop;
then each draft arm against the fastest n-gram arm, speed and tau per source and copy-heavy / rest with paired 90%
intervals over the prompts (eval/compare.py).

The arms differ by a few percent in speed while a shared 2-core machine's speed drifts by tens of percent over
minutes (two runs arm after arm: n-gram at gamma 2 1.58x, then 1.02x). So every prompt is decoded by every arm back
to back, in reversed order on every other prompt, between two plain decodes of it (eval/arms.py, as eval.py does):
each arm's speedup is its tokens/s over the plain loop's in the same minutes. `plain_repeat_spread` reports how far
a prompt's two plain decodes differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET = "smollm2-135m-instruct"


def arms(gamma: int, gammas: list[int]) -> list[tuple[str, str, int, str, bool]]:
    """(name, drafter, gamma, schedule, calibrated by STS) in run order; `draft` stands for the --draft folder."""
    fixed = sorted(set(gammas) | {gamma})
    return ([(f"dspark gamma {g}", "draft", g, "fixed", False) for g in fixed]
            + [("dspark confidence schedule, uncalibrated", "draft", gamma, "confidence", False),
               ("dspark confidence schedule, STS", "draft", gamma, "confidence", True)]
            + [(f"n-gram gamma {g}", "ngram", g, "fixed", False) for g in fixed])


def against_best_ngram(rows: list[dict]) -> dict:
    """Each draft arm against the fastest n-gram arm on the same prompts, per source, copy-heavy / rest and overall,
    with paired 90% intervals (eval/compare.py): {"ngram": its name, "speed": {arm: rows}, "tau": {arm: rows}}."""
    from eval.compare import source_rows, speed_tally, tally

    best = max((row for row in rows if row["drafter"] == "ngram"), key=lambda row: row["speedup"])
    sources, lookup = [x["source"] for x in best["samples"]], tally(best["samples"])
    drafts = [row for row in rows if row["drafter"] == "draft"]
    return {"ngram": best["name"],
            "speed": {row["name"]: source_rows(speed_tally(row["samples"]), speed_tally(best["samples"]), sources,
                                               lookup=lookup) for row in drafts},
            "tau": {row["name"]: source_rows(tally(row["samples"]), lookup, sources) for row in drafts}}


def markdown(result: dict) -> str:
    from eval.compare import source_table

    lines = [f"# DSpark's verify scheduler in the batch-1 loop ({result['num_eval_prompts']} held-out prompts, T=0, "
             f"{result['max_new_tokens']} new tokens)", "",
             f"Draft `{result['draft']}`; STS fitted on {result['num_calibration_prompts']} other prompts "
             f"(temperatures {', '.join(f'{t:.2f}' for t in result['sts_temperatures'])}). Plain loop "
             f"{result['target_tokens_per_s']:.1f} tok/s ({result['target_step_ms']:.1f} ms a token); a prompt's two "
             f"plain decodes differ by {result['plain_repeat_spread']:.1%} (median). Every prompt decoded by every arm "
             "back to back.", "",
             "| arm | tau | drafts verified a round | draft ms | verify ms | round ms | exact match | speedup vs "
             "plain loop | vs the best n-gram |", "|---|---|---|---|---|---|---|---|---|"]
    best_ngram = max(row["speedup"] for row in result["arms"] if row["drafter"] == "ngram")
    for row in result["arms"]:
        t = row["timing"]
        lines.append(f"| {row['name']} | {row['accept_len']:.3f} | {row['mean_verified_drafts']:.2f} | "
                     f"{t['draft_ms']:.1f} | {t['verify_ms']:.1f} | {t['round_ms']:.1f} | {row['exact_match']} | "
                     f"{row['speedup']:.2f}x | {row['speedup'] / best_ngram:.2f} |")
    vs = result["vs_best_ngram"]
    for name in vs["speed"]:
        lines += ["", f"{name} against {vs['ngram']}, per source (90% paired bootstrap over the prompts):", "",
                  *source_table(vs["speed"][name], other="n-gram", quantity="tok/s"), "",
                  *source_table(vs["tau"][name], other="n-gram")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--draft", type=Path, required=True, help="a DSpark draft folder with a confidence head")
    parser.add_argument("--eval-prompts", type=Path, required=True, help="held-out prompt file (JSON/JSONL)")
    calibration = parser.add_mutually_exclusive_group(required=True)
    calibration.add_argument("--calibration-prompts", type=Path,
                             help="other prompts the draft never trained on, for the STS calibration")
    calibration.add_argument("--calibration-run", type=Path, help="or the draft's training run (its recipe.yaml): "
                             "--calibration-per-source prompts of each of its sources' held-out split")
    parser.add_argument("--calibration-per-source", type=int, default=6, help="with --calibration-run (6)")
    parser.add_argument("--num-samples", type=int, default=0, help="eval prompts to use (0: all)")
    parser.add_argument("--num-calibration", type=int, default=0, help="calibration prompts to use (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (128)")
    parser.add_argument("--gamma", type=int, default=7, help="the draft's block: the scheduler's longest verify (7)")
    parser.add_argument("--gammas", default="1,2,3", help="fixed draft lengths compared besides --gamma (1,2,3)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "verify_schedule", help="(runs/verify_schedule)")
    args = parser.parse_args(argv)
    from modeling.draft_folder import is_draft_dir

    problems = [f"{flag} {path}: no such file" for flag, path in (("--eval-prompts", args.eval_prompts),
                ("--calibration-prompts", args.calibration_prompts),
                ("--calibration-run", args.calibration_run and args.calibration_run / "recipe.yaml"))
                if path is not None and not path.is_file()]
    if not is_draft_dir(args.draft):
        problems.append(f"--draft {args.draft}: not a draft folder (config.json + model.safetensors)")
    try:
        gammas = [int(g) for g in args.gammas.split(",") if g.strip()]
    except ValueError:
        gammas = [0]
    if not gammas or min(gammas) < 1 or args.gamma < 1:
        problems.append(f"--gammas {args.gammas} / --gamma {args.gamma}: draft lengths must be integers >= 1")
    if problems:
        parser.error("\n  ".join(problems))

    import statistics

    import torch

    from core.malloc import keep_freed_memory
    from data.sources.prompts import eval_prompts
    from eval.arms import Arm, PlainLoop, decode_interleaved
    from eval.report import ReportSettings, arm_metrics
    from eval.run import EvalDecode, first_turn_ids, loop_schedule, make_drafter, run_eval
    from eval.spec_decode import Decoding
    from modeling.target import load_target, load_tokenizer
    from tqdm.auto import tqdm

    keep_freed_memory()
    if args.calibration_run is not None:
        from benchmarks.harness import holdout_prompt_file

        args.calibration_prompts = holdout_prompt_file(args.calibration_run, args.calibration_per_source,
                                                       args.out / "calibration_prompts.jsonl")
    target = load_target(TARGET, "cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(TARGET)
    calibration = run_eval(EvalDecode(
        draft=str(args.draft), target_name=TARGET, dataset=str(args.calibration_prompts),
        num_samples=args.num_calibration, temperature=0.0, block_size=args.gamma,
        max_new_tokens=args.max_new_tokens, full_vocab=True),
        ReportSettings(out_dir=args.out / "calibration", scheduler=False), target=target)
    if "calibration" not in calibration:
        parser.error(f"--draft {args.draft}: no confidence head, nothing to schedule with")
    sts = calibration["calibration"]["sts_path"]
    arms_run = []
    for name, drafter_name, gamma, policy, calibrated in arms(args.gamma, gammas):
        # as the engines serve it: over the whole vocabulary, whatever token map the draft folder has
        drafter = make_drafter(str(args.draft) if drafter_name == "draft" else drafter_name, target, gamma,
                               full_vocab=True)
        schedule = None
        if policy != "fixed":
            arm_dir = args.out / name.replace(" ", "_").replace(",", "")
            arm_dir.mkdir(parents=True, exist_ok=True)
            schedule, _ = loop_schedule(target, drafter, gamma, sts if calibrated else None, arm_dir)
        arms_run.append((Arm(name, drafter, schedule=schedule, gamma=gamma), drafter_name, policy))
    prompts = eval_prompts(str(args.eval_prompts), args.num_samples, 0)
    plain = PlainLoop()
    for i, prompt in enumerate(tqdm(prompts, desc="prompts (every arm)", unit="prompt")):
        ids = first_turn_ids(tokenizer, prompt, None, False)
        decode_interleaved(target, [arm for arm, _, _ in arms_run], prompt, ids, i, Decoding(
            max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id, seed=i), plain)
    rows = []
    for arm, drafter_name, policy in arms_run:  # the figures eval.py reports of an arm (eval/report.py)
        row = {"name": arm.name, "drafter": drafter_name, "gamma": arm.gamma, "schedule": policy,
               **arm_metrics(arm, arm.gamma, plain, greedy=True)}
        rows.append(row)
        print(f"[verify_schedule] {arm.name}: tau {row['accept_len']:.3f}, {row['mean_verified_drafts']:.2f} drafts "
              f"verified a round, speedup {row['speedup']:.2f}x, exact match {row['exact_match']}", flush=True)
    result = {"draft": str(args.draft), "eval_prompts": str(args.eval_prompts), "num_eval_prompts": len(prompts),
              "num_calibration_prompts": calibration["num_samples"], "max_new_tokens": args.max_new_tokens,
              "sts_temperatures": calibration["calibration"]["sts_temperatures"],
              "target_tokens_per_s": plain.tokens_per_s, "target_step_ms": rows[0]["timing"]["target_step_ms"],
              "plain_repeat_spread": statistics.median(plain.spreads), "arms": rows,
              "vs_best_ngram": against_best_ngram(rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verify_schedule.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out / "verify_schedule.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
