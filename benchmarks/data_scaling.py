"""Held-out tau against the amount of regenerated data and the training steps, measured on a grid: every (data size,
steps) pair trained with its own full schedule, a second seed at one point, two fits through the final drafts against
the training data's answer tokens, and the next data size predicted before it is run, then run and compared.

    python benchmarks/data_scaling.py --out runs/scaling --grid 240,480:200,400 --seeds 2 --predict 960:400 \\
        --add-source libcode=1 --regen-backend vllm --gsm8k ../shared/data/gsm8k --eval-per-source 12
    python benchmarks/data_scaling.py --out runs/scaling-smoke --grid 4,8:2,4 --seeds 2 --predict 12:4 \\
        --eval-per-source 1                                      # a smoke run (~30 min on 2 busy CPU cores)

Each point PROMPTS:STEPS is a `benchmarks/quality.py --curve-only` run in OUT/p<PROMPTS>/s<STEPS> (train STEPS
steps, train.max_steps = STEPS: each schedule runs to its end; held-out tau of the final draft replayed, prompt lookup
replayed on the same prompts). The points of one data size share its data: OUT/p<PROMPTS> holds the regeneration and
cache, made once (quality.py --data-dir). --seeds N trains N-1 more seeds at --seed-point (default the largest data x
the largest steps) in OUT/p<P>/s<S>-seed<K>: `--set seed=K` for training only (init, batch order, anchors; the
training prompts are drawn by the data run, which takes no --set). Flags this script does not know go to quality.py
(--gsm8k, --regen-backend, --add-source, --set ...). The held-out prompts are the same at every point, so every
ratio here is paired over them (eval/compare.paired_ratio).

The x axis is the training data's answer tokens (the cache's supervised tokens: what training sees). Through the
final drafts at the largest steps two fits: tau = a + b log10(tokens), and a power law in the rejection rate,
log10(1 - alpha) = c + d log10(tokens), alpha the per-draft acceptance with tau = (1 - alpha^8) / (1 - alpha) at
gamma 7. --predict PROMPTS:STEPS prints both fits' tau there (tokens from PROMPTS at the measured tokens per prompt)
and writes it to OUT/scaling.json before the point is run, then runs it and prints measured against predicted, and
whether the miss is within the seed spread. A rerun reuses every finished stage. Writes OUT/scaling.json. Measured:
benchmarks/README.md, "How held-out tau grows with the data".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import OFFLINE  # noqa: E402
from core.recipe import FAMILIES, load_recipe  # noqa: E402
from eval.compare import format_ratio, paired_ratio  # noqa: E402

GAMMA = 7  # drafts per round in quality.py's replays
# quality.py flags this script sets for every point: passing them through would break the grid
OWN_FLAGS = ("--out", "--data-dir", "--train-prompts", "--steps", "--budget-s", "--curve-only", "--curve-points",
             "--families", "--report-only")


def parse_grid(text: str) -> tuple[list[int], list[int]]:
    """"240,480:200,400" -> ([240, 480], [200, 400]): the data sizes (training prompts) and the steps values, every
    pair a point; two or more of each."""
    data, _, steps = text.partition(":")
    try:
        values = [sorted({int(v) for v in part.split(",") if v.strip()}) for part in (data, steps)]
    except ValueError:
        values = [[], []]
    if not steps or any(len(v) < 2 or v[0] < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected PROMPTS,PROMPTS:STEPS,STEPS with two or more positive "
                                         "integers on each side, e.g. 240,480:200,400")
    return values[0], values[1]


def parse_point(text: str) -> tuple[int, int]:
    """"960:400" -> (960, 400): one PROMPTS:STEPS point."""
    try:
        prompts, steps = (int(v) for v in text.split(":"))
    except ValueError:
        prompts = steps = 0
    if min(prompts, steps) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PROMPTS:STEPS, two positive integers, e.g. 960:400")
    return prompts, steps


# --- the fits ---------------------------------------------------------------------------------------------------

def log_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b * log10(x) through (x, y) points."""
    xs, ys = [math.log10(x) for x, _ in points], [y for _, y in points]
    x0, y0 = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - x0) ** 2 for x in xs)
    b = sum((x - x0) * (y - y0) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return y0 - b * x0, b


def tau_from_alpha(alpha: float, gamma: int = GAMMA) -> float:
    """Tokens per round when each of `gamma` drafts is accepted with probability alpha until the first rejection."""
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def alpha_from_tau(tau: float, gamma: int = GAMMA) -> float:
    """The per-draft acceptance alpha whose tau_from_alpha is `tau` (0 at tau <= 1; tau_from_alpha rises with alpha, so
    bisection finds it)."""
    if not tau < gamma + 1:
        raise ValueError(f"tau {tau} is not below gamma + 1 = {gamma + 1}: no rejection rate to fit")
    low, high = 0.0, 1.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if tau_from_alpha(middle, gamma) < tau else (low, middle)
    return (low + high) / 2 if tau > 1 else 0.0


def scaling_fits(rows: list[dict]) -> dict:
    """Both fits through the final drafts of `rows` against their answer tokens: tau = a + b log10(tokens), and
    log10(1 - alpha) = c + d log10(tokens)."""
    a, b = log_fit([(r["answer_tokens"], r["tau"]) for r in rows])
    c, d = log_fit([(r["answer_tokens"], math.log10(1 - alpha_from_tau(r["tau"]))) for r in rows])
    return {"log_linear": {"a": a, "b_per_decade": b}, "power_law": {"c": c, "d": d}}


def predicted_tau(fits: dict, tokens: float) -> dict:
    """Each fit's tau at `tokens` answer tokens."""
    line, power = fits["log_linear"], fits["power_law"]
    rejection = min(1.0, 10 ** (power["c"] + power["d"] * math.log10(tokens)))
    return {"log_linear": line["a"] + line["b_per_decade"] * math.log10(tokens),
            "power_law": tau_from_alpha(1 - rejection)}


def tokens_for(tau: float, fits: dict) -> dict:
    """Where each fit reaches `tau` (inf where it does not rise toward it)."""
    line, power = fits["log_linear"], fits["power_law"]
    rejection = 1 - alpha_from_tau(tau)
    return {"log_linear": 10 ** ((tau - line["a"]) / line["b_per_decade"]) if line["b_per_decade"] > 0 else math.inf,
            "power_law": 10 ** ((math.log10(rejection) - power["c"]) / power["d"]) if power["d"] < 0 else math.inf}


# --- the runs -----------------------------------------------------------------------------------------------------

def run_quality(run: Path, data_dir: Path, prompts: int, steps: int, flags: list[str], log: Path) -> None:
    """One point: quality.py --curve-only into `run`, its data in `data_dir` (made there once, then reused)."""
    command = [sys.executable, "benchmarks/quality.py", "--out", str(run), "--data-dir", str(data_dir),
               "--train-prompts", str(prompts), "--steps", str(steps), "--curve-points", "1", "--curve-only", *flags]
    with open(log, "a") as handle:
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **OFFLINE}, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"[scaling] quality.py failed (exit {done.returncode}); see {log}")


def point_row(run: Path, data_dir: Path, family: str, prompts: int, steps: int, seed: int, role: str) -> dict:
    """One finished point: its data (conversations, answer tokens), its final draft's tally and the n-gram's."""
    curves = json.loads((run / "curves.json").read_text())
    manifest = json.loads((data_dir / "train-data" / "cache" / "manifest.json").read_text())
    regen = json.loads((data_dir / "train-data" / "regen" / "DONE.json").read_text())
    final, ngram = curves["curves"][family][-1], curves["ngram"]
    tally = ("replayed_tau", "per_record_tokens", "per_record_rounds")
    return {"role": role, "prompts": prompts, "steps": final["step"], "seed": seed,
            "conversations": manifest["num_records"],
            "answer_tokens": sum(count for _, count in manifest["meta"]["loss_token_counts"]),
            "generated_tokens": regen["generated_tokens"], "data_min": curves["data_s"] / 60,
            "train_min": final["minutes"], "tau": final["replayed_tau"], "ngram_tau": ngram["replayed_tau"],
            "over_ngram": paired_ratio(final, ngram), "generalization": curves["trained"][family]["generalization"],
            "final": {k: final[k] for k in tally if k in final}, "ngram": {k: ngram[k] for k in tally if k in ngram},
            "record_ids": [r["id"] for r in curves["records"]]}


def paired(a: dict, b: dict) -> tuple[float, float | None, float | None]:
    """a's final draft over b's on the same held-out records, with paired_ratio's 90% interval."""
    if a["record_ids"] != b["record_ids"]:
        raise ValueError(f"points {a['prompts']}:{a['steps']} and {b['prompts']}:{b['steps']} were replayed on "
                         "different held-out records: no paired ratio (were they run with other eval flags?)")
    return paired_ratio(a["final"], b["final"])


def effects(rows: list[dict]) -> dict[str, list[str]]:
    """The data effect at each steps value, the steps effect at each data size (neighbours on the grid), and each
    extra seed against the first, as paired ratios of the final drafts."""
    grid = {(r["prompts"], r["steps"]): r for r in rows if r["role"] == "grid"}
    data, steps = sorted({p for p, _ in grid}), sorted({s for _, s in grid})
    lines = {"data": [f"{p2} / {p1} prompts at {s} steps: {format_ratio(*paired(grid[p2, s], grid[p1, s]))}"
                      for s in steps for p1, p2 in zip(data, data[1:])],
             "steps": [f"{s2} / {s1} steps at {p} prompts: {format_ratio(*paired(grid[p, s2], grid[p, s1]))}"
                       for p in data for s1, s2 in zip(steps, steps[1:])], "seeds": []}
    for r in (r for r in rows if r["role"] == "seed"):
        first = grid[r["prompts"], r["steps"]]
        lines["seeds"].append(f"seed {r['seed']} / seed {first['seed']} at {r['prompts']}:{r['steps']}: tau "
                              f"{r['tau']:.3f} against {first['tau']:.3f} (difference {r['tau'] - first['tau']:+.3f}),"
                              f" {format_ratio(*paired(r, first))}")
    return lines


def seed_spread(rows: list[dict]) -> float | None:
    """The largest minus the smallest final tau over the seeds of the seed point (None with one seed)."""
    seeds = [r for r in rows if r["role"] == "seed"]
    if not seeds:
        return None
    taus = [r["tau"] for r in rows if r["role"] != "predicted" and (r["prompts"], r["steps"]) ==
            (seeds[0]["prompts"], seeds[0]["steps"])]
    return max(taus) - min(taus)


def table(rows: list[dict]) -> list[str]:
    lines = ["| prompts | conversations | answer tokens | steps | seed | held-out tau (final) | n-gram tau | "
             "tau / n-gram (90% paired bootstrap) | on its training records / unseen prompts of its sources |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        split = r["generalization"]
        lines.append(f"| {r['prompts']}{' (predicted point)' if r['role'] == 'predicted' else ''} | "
                     f"{r['conversations']} | {r['answer_tokens']:,} | {r['steps']} | {r['seed']} | {r['tau']:.3f} | "
                     f"{r['ngram_tau']:.3f} | {format_ratio(*r['over_ngram'])} | "
                     f"{split['training records']:.2f} / {split['in-distribution held-out']:.2f} |")
    return lines


def fit_lines(fits: dict, steps: int, largest_tokens: int, goals: dict[str, float]) -> list[str]:
    line, power = fits["log_linear"], fits["power_law"]
    lines = [f"Fits through the final drafts at {steps} steps, against answer tokens:",
             f"- log-linear: tau = {line['a']:.3f} {line['b_per_decade']:+.3f} * log10(tokens)",
             f"- power law in the rejection rate: 1 - alpha = {10 ** power['c']:.4g} * tokens^{power['d']:.4f} "
             f"(log10(1 - alpha) = {power['c']:.3f} {power['d']:+.4f} * log10(tokens); tau = (1 - alpha^{GAMMA + 1})"
             f" / (1 - alpha))"]
    for name, tau in goals.items():
        need = tokens_for(tau, fits)
        lines.append(f"Extrapolated, not measured: {name} at " + ", ".join(
            f"~{v:.2g} answer tokens ({v / largest_tokens:.2g}x the largest data here) on the {fit.replace('_', '-')} "
            "fit" if math.isfinite(v) else f"never on the {fit.replace('_', '-')} fit" for fit, v in need.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "scaling", help="work folder (runs/scaling)")
    parser.add_argument("--grid", type=parse_grid, required=True, help="PROMPTS,PROMPTS:STEPS,STEPS: every pair a "
                        "point, e.g. 240,480:200,400")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds at --seed-point (1; 2 measures the spread)")
    parser.add_argument("--seed-point", type=parse_point, help="PROMPTS:STEPS of the grid for the extra seeds "
                        "(default the largest of each)")
    parser.add_argument("--predict", type=parse_point, help="PROMPTS:STEPS to predict from the fits, then run; its "
                        "STEPS must be the grid's largest (the fits' steps)")
    parser.add_argument("--family", default="dspark", choices=FAMILIES)
    parser.add_argument("--eval-per-source", type=int, default=12, help="held-out prompts per eval source (12)")
    parser.add_argument("--goal", type=float, default=2.5, help="the held-out tau to extrapolate to (2.5)")
    parser.add_argument("--goal-over-ngram", type=float, default=1.3, help="the tau / n-gram to extrapolate to (1.3)")
    args, passthrough = parser.parse_known_args(argv)
    data_sizes, steps_values = args.grid
    own = [flag for flag in passthrough if flag.split("=")[0] in OWN_FLAGS]
    if own:
        parser.error(f"{', '.join(own)}: set by this script for every point (--grid gives prompts and steps)")
    seed_point = args.seed_point or (data_sizes[-1], steps_values[-1])
    if seed_point[0] not in data_sizes or seed_point[1] not in steps_values:
        parser.error(f"--seed-point {seed_point[0]}:{seed_point[1]} is not on the grid {args.grid}")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: expected 1 or more")
    if args.predict and args.predict[0] in data_sizes:
        parser.error(f"--predict {args.predict[0]}:{args.predict[1]}: that data size is on the grid, measured already;"
                     " predict another, e.g. twice the largest")
    if args.predict and args.predict[1] != steps_values[-1]:
        parser.error(f"--predict {args.predict[0]}:{args.predict[1]}: the fits are through the final drafts at "
                     f"{steps_values[-1]} steps; predict at those steps, e.g. {args.predict[0]}:{steps_values[-1]}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    base_seed = load_recipe(f"{args.family}_smollm2_135m").seed
    flags = ["--families", args.family, "--eval-per-source", str(args.eval_per_source), *passthrough]

    def measure(prompts: int, steps: int, seed: int, role: str) -> dict:
        data_dir, name = out / f"p{prompts}", f"s{steps}" + (f"-seed{seed}" if seed != base_seed else "")
        print(f"[scaling] {prompts} prompts, {steps} steps, seed {seed}: {data_dir / name}", flush=True)
        data_dir.mkdir(exist_ok=True)
        run_quality(data_dir / name, data_dir, prompts, steps,
                    flags + (["--set", f"seed={seed}"] if seed != base_seed else []), data_dir / f"{name}.log")
        return point_row(data_dir / name, data_dir, args.family, prompts, steps, seed, role)

    rows = [measure(p, s, base_seed, "grid") for p in data_sizes for s in steps_values]
    rows += [measure(*seed_point, base_seed + k, "seed") for k in range(1, args.seeds)]
    fits = scaling_fits([r for r in rows if r["role"] == "grid" and r["steps"] == steps_values[-1]])
    result = {"family": args.family, "grid": {"prompts": data_sizes, "steps": steps_values}, "gamma": GAMMA,
              "seed_point": list(seed_point), "seeds": args.seeds, "fits": fits, "rows": rows}
    spread = seed_spread(rows)
    lines = []
    if args.predict:
        prompts, steps = args.predict
        fitted = [r for r in rows if r["role"] == "grid" and r["steps"] == steps]
        per_prompt = sum(r["answer_tokens"] for r in fitted) / sum(r["prompts"] for r in fitted)
        run = out / f"p{prompts}" / f"s{steps}"
        result["prediction"] = {"prompts": prompts, "steps": steps, "tokens_per_prompt": per_prompt,
                                "answer_tokens": prompts * per_prompt, "tau": predicted_tau(fits, prompts * per_prompt),
                                "made_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "measured_before_prediction": (run / "curves.json").is_file()}
        (out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")  # written before the point runs
        guess = result["prediction"]["tau"]
        print(f"[scaling] predicted at {prompts}:{steps} (~{prompts * per_prompt:,.0f} answer tokens, "
              f"{per_prompt:.1f} a prompt): tau {guess['log_linear']:.3f} (log-linear), {guess['power_law']:.3f} "
              "(power law); running it", flush=True)
        row = measure(prompts, steps, base_seed, "predicted")
        rows.append(row)
        at_tokens = predicted_tau(fits, row["answer_tokens"])
        result["prediction"].update(measured_tau=row["tau"], measured_answer_tokens=row["answer_tokens"],
                                    tau_at_measured_tokens=at_tokens, seed_spread=spread)
        lines += ["", f"Predicted before it ran, at {prompts}:{steps}: measured tau {row['tau']:.3f}; "
                  + "; ".join(f"{fit.replace('_', '-')} fit {guess[fit]:.3f} (miss {row['tau'] - guess[fit]:+.3f}"
                              + ("" if spread is None else
                                 f", {'inside' if abs(row['tau'] - guess[fit]) <= spread else 'outside'} the seed "
                                 f"spread {spread:.3f}") + f"; {at_tokens[fit]:.3f} at its measured "
                              f"{row['answer_tokens']:,} answer tokens)" for fit in ("log_linear", "power_law"))]
    result["effects"] = effects(rows)
    goals = {f"tau {args.goal}": args.goal, f"{args.goal_over_ngram}x n-gram (tau "
             f"{args.goal_over_ngram * rows[0]['ngram_tau']:.2f})": args.goal_over_ngram * rows[0]["ngram_tau"]}
    largest = max(r["answer_tokens"] for r in rows if r["role"] == "grid")
    lines = (table(rows) + ["", *fit_lines(fits, steps_values[-1], largest, goals), "",
                            "Paired ratios of the final drafts on the same held-out prompts (90% bootstrap):"]
             + [f"- data: {line}" for line in result["effects"]["data"]]
             + [f"- steps: {line}" for line in result["effects"]["steps"]]
             + [f"- {line}" for line in result["effects"]["seeds"]] + lines)
    (out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
