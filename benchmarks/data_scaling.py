"""Held-out tau against the amount of regenerated data: one family's recipe trained on each data size (about the same
passes over it), replayed on the same held-out prompts beside prompt lookup, and a straight line in log-conversations
through the final drafts: how many conversations a goal would take on this recipe (an extrapolation, printed as one).

    python benchmarks/data_scaling.py --out runs/scaling --gsm8k ../shared/data/gsm8k --regen-backend vllm \\
        --sizes 256:480,1280:1200,2560:2400   # ~2.5 h on 2 CPU cores (benchmarks/README.md)
    python benchmarks/data_scaling.py --out runs/scaling-smoke --sizes 8:4,16:8 --eval-per-source 1  # a smoke run

Each size PROMPTS:STEPS is a `benchmarks/quality.py --curve-only` run in OUT/p<PROMPTS> (regenerate PROMPTS training
prompts, cache, train STEPS steps, replay held-out tau at half and all the steps, prompt lookup replayed on the same
prompts); a rerun reuses every finished size. The held-out prompts are the same at every size (quality.py's fixed
selection). Writes OUT/scaling.json and prints the table and the fit. Measured: benchmarks/README.md, "How held-out
tau grows with the data".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import OFFLINE  # noqa: E402
from core.recipe import FAMILIES  # noqa: E402
from eval.compare import format_ratio, paired_ratio  # noqa: E402


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """"256:480,1280:1200" -> [(256, 480), (1280, 1200)]: training prompts and optimizer steps per size."""
    try:
        sizes = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        sizes = []
    if len(sizes) < 2 or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected two or more PROMPTS:STEPS, e.g. 256:480,1280:1200")
    return sorted(sizes)


def log_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line tau = a + b * log10(conversations) through (conversations, tau) points."""
    xs, ys = [math.log10(c) for c, _ in points], [t for _, t in points]
    x0, y0 = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - x0) ** 2 for x in xs)
    b = sum((x - x0) * (y - y0) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return y0 - b * x0, b


def final_fit(rows: list[dict]) -> tuple[float, float]:
    """log_fit through each size's final draft."""
    return log_fit([(r["conversations"], r["taus"][-1]) for r in rows])


def conversations_for(tau: float, a: float, b: float) -> float:
    """Where the fitted line reaches `tau` (inf where it does not rise)."""
    return 10 ** ((tau - a) / b) if b > 0 else math.inf


def size_row(run: Path, family: str, prompts: int) -> dict:
    """One finished size: its data (conversations, generated answer tokens, minutes), its curve and the n-gram."""
    curves = json.loads((run / "curves.json").read_text())
    regen = json.loads((run / "train-data" / "regen" / "DONE.json").read_text())
    manifest = json.loads((run / "train-data" / "cache" / "manifest.json").read_text())
    points, ngram = curves["curves"][family], curves["ngram"]
    final = points[-1]
    return {"prompts": prompts, "conversations": manifest["num_records"], "answer_tokens": regen["generated_tokens"],
            "data_min": curves["data_s"] / 60, "train_min": final["minutes"], "steps": final["step"],
            "taus": [p["replayed_tau"] for p in points], "tau_steps": [p["step"] for p in points],
            "ngram_tau": ngram["replayed_tau"], "over_ngram": paired_ratio(final, ngram),
            "generalization": curves["trained"][family]["generalization"]}


def report(rows: list[dict], fit: tuple[float, float], goal: float, goal_over_ngram: float) -> list[str]:
    """The table of the sizes, final_fit's line and where it reaches the goals."""
    lines = ["| prompts | conversations | answer tokens | steps | held-out tau at half / all the steps | n-gram tau "
             "| tau / n-gram (90% paired bootstrap) | on its training records / unseen prompts of its sources |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompts']} | {r['conversations']} | {r['answer_tokens']:,} | {r['steps']} | "
                     + " / ".join(f"{t:.3f}" for t in r["taus"]) + f" | {r['ngram_tau']:.3f} | "
                     f"{format_ratio(*r['over_ngram'])} | {r['generalization']['training records']:.2f} / "
                     f"{r['generalization']['in-distribution held-out']:.2f} |")
    a, b = fit
    ngram = rows[-1]["ngram_tau"]
    lines += ["", f"Fit through the final drafts: tau = {a:.3f} + {b:.3f} * log10(conversations) (+{b:.3f} per tenfold "
              "data)."]
    for name, tau in ((f"tau {goal}", goal), (f"{goal_over_ngram}x n-gram (tau {goal_over_ngram * ngram:.2f})",
                                               goal_over_ngram * ngram)):
        need = conversations_for(tau, a, b)
        lines.append(f"Extrapolated, not measured: {name} at ~{need:.2g} conversations on this recipe and its "
                     f"steps per conversation ({need / rows[-1]['conversations']:.2g}x the largest size here)."
                     if math.isfinite(need) else f"{name}: the fitted line does not rise; no extrapolation.")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "scaling", help="work folder (runs/scaling)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("256:480,1280:1200,2560:2400"),
                        help="PROMPTS:STEPS per size, comma-separated (256:480,1280:1200,2560:2400)")
    parser.add_argument("--family", default="dspark", choices=FAMILIES)
    parser.add_argument("--gsm8k", type=Path, help="folder with GSM8K train.jsonl/test.jsonl (quality.py's --gsm8k)")
    parser.add_argument("--regen-backend", choices=("hf", "vllm"), default="hf", help="quality.py's --regen-backend")
    parser.add_argument("--eval-per-source", type=int, default=12, help="held-out prompts per eval source (12)")
    parser.add_argument("--goal", type=float, default=2.5, help="the held-out tau to extrapolate to (2.5)")
    parser.add_argument("--goal-over-ngram", type=float, default=1.3, help="the tau / n-gram to extrapolate to (1.3)")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for prompts, steps in args.sizes:
        run = out / f"p{prompts}"
        command = [sys.executable, "benchmarks/quality.py", "--out", str(run), "--train-prompts", str(prompts),
                   "--steps", str(steps), "--curve-points", "2", "--curve-only", "--families", args.family,
                   "--eval-per-source", str(args.eval_per_source), "--regen-backend", args.regen_backend]
        command += ["--gsm8k", str(args.gsm8k)] if args.gsm8k else []
        print(f"[scaling] {prompts} prompts, {steps} steps: {run}", flush=True)
        with open(out / f"p{prompts}.log", "a") as log:
            done = subprocess.run(command, cwd=ROOT, env={**os.environ, **OFFLINE}, stdout=log,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"[scaling] quality.py failed (exit {done.returncode}); see {out / f'p{prompts}.log'}")
        rows.append(size_row(run, args.family, prompts))
    a, b = final_fit(rows)
    lines = report(rows, (a, b), args.goal, args.goal_over_ngram)
    (out / "scaling.json").write_text(json.dumps({"family": args.family, "fit": {"a": a, "b_per_decade": b},
                                                  "rows": rows}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
