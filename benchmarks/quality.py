"""Drafter quality on prompts never trained on: the three families on the same data and CPU budget, side by side with
the n-gram drafter and plain HF `generate`, in one run.

    python benchmarks/quality.py --budget-s 600 --train-prompts 256 --eval-per-source 6 --gsm8k ../shared/data/gsm8k
                                                        # about 65 min on 2 CPU cores (benchmarks/README.md,
                                                        # "The 10-minute budget")
    python benchmarks/quality.py --out runs/q60 --train-prompts 1280 --regen-backend vllm \\
        --gsm8k ../shared/data/gsm8k --eval-per-source 6 --steps 1200 --curve-points 6 --families dspark
                                                        # the 60-minute budget: 41 min end to end + ~17 min of
                                                        # held-out answers, replays and the loop
                                                        # (benchmarks/README.md, "Five times the data")
    python benchmarks/quality.py --budget-s 60 --train-prompts 32 --eval-per-source 2  # a quick smoke run
    python benchmarks/quality.py --out runs/race --train-run runs/default --gsm8k ../shared/data/gsm8k \
        --eval-per-source 12 --budget-s 600 --curve-points 2 --curve-only --skip-split --full-vocab \
        --families dspark,dflash2,dflash,eagle3 [--arm copy:draft.init_copy=frozen --arm-families dflash2] \
        [--also-draft default=runs/default]     # the four families, 10 min each, on the default recipe's data:
                                                # ~55 min (benchmarks/README.md, "The four families at equal time")

1. Regenerates once: the target answers the training prompts (ShareGPT, plus GSM8K train with --gsm8k) and the cache
   stage stores its hidden states (the block drafters' 5 layers; Eagle3 reads its 3 of them from the same cache).
   --train-data source skips the generation: the sources' own answers, labelled by the target's argmax
   (regen.backend=source, loss.ce_labels=target), at the cost of the cache stage's forward pass alone.
2. Eval prompts from other sources: MT-bench and HumanEval first turns, plus GSM8K test with --gsm8k. Their greedy
   answers are regenerated and cached too, to replay held-out tau cheaply along training (eval/replay.py).
3. Trains each family with its smollm2 recipe for the same wall-clock budget on this machine: a short probe measures
   the seconds per step, then train.max_steps = budget / that (or --steps: every family the same optimizer steps).
   Checkpoints along the way give the learning curve.
4. Evaluates every final draft with the real speculative loop (T=0, gamma 7) on the eval prompts, with the n-gram
   drafter and plain HF generate on the same prompts: tau, accept_rate@k, exact_match, speedup.
5. Per source (MT-bench, HumanEval, GSM8K), for the copy-heavy prompts (prompt lookup's tau > 2.5 on the prompt) and
   the rest, and overall: each final draft's tau over prompt lookup's with a paired 90% interval (eval/compare.py),
   in the real loop and replayed, and beside each ratio the replayed tau of the per-round oracle chooser between
   the two (eval/replay.py): what the drafter still misses where lookup hits.

Writes OUT/quality.json, OUT/quality.md and OUT/learning_curve.png (held-out tau against training minutes). Each
final draft is also replayed on its training records and on unseen prompts of the training sources (their holdout
split), which splits its gap into memorisation and domain shift. --curve-only stops before the real loop
(OUT/curves.json; each draft's tau over prompt lookup's, both replayed on the same prompts): arms that compare
training settings at equal steps need only the curves. Each --arm trains every family again with its overrides on
the same data and steps and prints its held-out tau over the recipe's at every checkpoint, e.g.
--arm decay1.5:loss.loss_decay_gamma=1.5 (OUT/dspark-decay1.5); an arm that sets a cache.* key caches the shared
regeneration again in its own folder, e.g. --arm raw:cache.encoding=raw (raw states against the fp8 cache);
--arm-families names the families the arms train. --train-run trains every family on a finished run's regeneration and
cache instead of regenerating (the default recipe's, say), and --also-draft replays a finished run's final draft in
the same tables (its training minutes are its own run's). The
helpers the benchmark scripts share (the pipeline in a child process, the data, the replays) live in
benchmarks/harness.py. --full-vocab replays and runs the block drafts over the whole vocabulary (their loss.vocab_size
token map ignored), as the serving engines draft; with DSpark among the families each other family's final draft is
also tabled over DSpark's per source and copy-heavy / rest (--over NAME: over another draft's, e.g. an --also-draft),
beside every final draft's conditional acceptance at each draft position.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (eval_records, final_draft_point, finished_data, generalization,  # noqa: E402
                                learning_curve, link_data, ngram_replay, open_eval_cache, parse_arm, parse_source,
                                prepare_data, prepare_in_distribution_data, ratio, run_pipeline, sets, source_sets)
from core import stage  # noqa: E402
from core.io import read_json  # noqa: E402
from core.recipe import FAMILIES  # noqa: E402
from eval.compare import format_ratio, paired_ratio, source_rows, source_table  # noqa: E402

TRAIN_DATA = {"regenerate": "the target's own greedy answers", "source": "the sources' own answers, target's labels"}


def parse_also_draft(item: str) -> tuple[str, Path]:
    """NAME=RUN -> (NAME, RUN): a finished run whose RUN/train/final draft is replayed beside the families."""
    name, _, run = item.partition("=")
    if not name or "/" in name or not (Path(run) / "train" / "final").is_dir():
        raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=RUN with a finished run's RUN/train/final, e.g. "
                                         "default=runs/default")
    return name, Path(run).resolve()


def reads_own_cache(arm_sets: list[str]) -> bool:
    """Whether an arm's overrides change the cache (a cache.* key, e.g. cache.encoding=raw): the shared cache, made
    with the recipe's keys, would be refused, so the arm caches the shared regeneration again in its own folder."""
    return any(kv.startswith("cache.") for kv in arm_sets[1::2])


def seconds_per_step(out: Path) -> float:
    """The median step of a probe run: the first step pays for warm-up, and sequence lengths vary step to step."""
    rows = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["step_s"] for r in rows[1:]) or [rows[0]["step_s"]]
    return times[len(times) // 2]


def finished_steps(run: Path) -> int | None:
    """The optimizer steps of a finished train stage in `run`, None where there is none."""
    return read_json(run / "train" / stage.SETTINGS_NAME)["train"]["max_steps"] if stage.is_done(run / "train") \
        else None


def tau_at(points: list[dict], minutes: float) -> float:
    """Held-out tau on a learning curve at `minutes` of training, linear between checkpoints (tau 1.0 at 0)."""
    curve = [(0.0, 1.0)] + [(p["minutes"], p["replayed_tau"]) for p in points]
    for (m0, t0), (m1, t1) in zip(curve, curve[1:]):
        if m0 <= minutes <= m1:
            return t0 + (t1 - t0) * (minutes - m0) / (m1 - m0) if m1 > m0 else t1
    return curve[-1][1]


def plot_curves(curves: dict, baselines: dict, path: Path, budget_s: float) -> None:
    from eval.report import new_plot, save_plot

    fig, ax = new_plot((7, 4))
    for family, points in curves.items():
        ax.plot([0.0] + [p["minutes"] for p in points], [1.0] + [p["replayed_tau"] for p in points], marker="o",
                label=family)
    for name, tau in baselines.items():
        ax.axhline(tau, linestyle="--", linewidth=1, color="grey")
        ax.text(0, tau, f" {name} {tau:.2f}", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("training minutes (wall clock, this machine)")
    ax.set_ylabel("held-out tau (T=0, gamma 7)")
    ax.set_title("Held-out accept length while training"
                 + (f" ({budget_s / 60:.0f} min budget per family)" if budget_s else ""))
    save_plot(fig, ax, path)


def end_to_end(data_s: float, trained: dict) -> str:
    """The issue's budget is regenerate + cache + train: the data's stages' seconds, then each family's steps' own
    seconds (both read back from the finished folders, so a rerun that skips them reports the same)."""
    return ("End to end (regenerate + cache, then the family's training steps): " + ", ".join(
        f"{name} {(data_s + row['train_s']) / 60:.1f} min" for name, row in trained.items() if "train_s" in row) + ".")


def gap_split(taus: dict) -> str:
    return ", ".join(f"{where} {tau:.3f}" for where, tau in taus.items())


def markdown(result: dict) -> str:
    k = result["gamma"]
    lines = [f"# Drafter quality on held-out prompts ({', '.join(result['eval_sources'])}; "
             f"{result['num_eval_prompts']} prompts, {result['max_new_tokens']} new tokens, T=0, gamma {k})", "",
             f"Training data: {result['train_sources']} ({TRAIN_DATA[result.get('train_data', 'regenerate')]}), "
             f"{result['train_records']} conversations, {result['train_tokens']} tokens"
             + (f" ({result['data_s'] / 60:.1f} min to prepare"
                + (f", answered by {result['regen_backend']}" if result.get("regen_backend", "hf") != "hf" else "")
                + ")" if result.get("data_s") else "")
             + (f"; budget {result['budget_s']:.0f} s of training per family" if result.get("budget_s")
                else f"; {result['steps']} optimizer steps per family")
             + f" on {result['nproc']} rank(s).", "",
             "| drafter | steps | train s | tau | exact | spec tok/s | speedup vs target loop | vs HF generate | "
             + " | ".join(f"acc@{i + 1}" for i in range(k)) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * k]
    for name, row in result["drafters"].items():
        rep = row["report"]
        lines.append(f"| {name} | {row.get('steps', '')} | {row.get('train_s', 0):.0f} | {rep['accept_len']:.3f} | "
                     f"{rep['exact_match']} | {rep['spec_tokens_per_s']:.1f} | {rep['speedup']:.2f}x | "
                     f"{rep.get('speedup_vs_generate', float('nan')):.2f}x | "
                     + " | ".join(f"{v:.2f}" for v in rep["accept_rate_at_k"]) + " |")
    lines += ["", f"Target loop {result['target_tokens_per_s']:.1f} tok/s, HF generate "
                  f"{result['hf_generate_tokens_per_s']:.1f} tok/s (batch 1, greedy).", ""]
    if result.get("data_s"):
        lines += [end_to_end(result["data_s"], result["drafters"]), ""]
    lines += ["Ratios of tau:", ""]
    lines += [f"- {name}: {value:.3f}" + oracle_note(result["curves"].get(name.split("/")[0]), name)
              for name, value in result["ratios"].items()]
    for name, vs in result.get("loop_vs_ngram", {}).items():
        lines += ["", f"{name} against the n-gram drafter in the real loop, per source (T={vs['temperature']}):", "",
                  *source_table(vs["rows"])]
    # The step budget comes from a short probe, so the families' real training minutes differ: compare them on the
    # learning curves at the shortest family's minutes too.
    curves = result["curves"]
    if curves:
        minutes = min(points[-1]["minutes"] for points in curves.values())
        lines += ["", f"On the learning curves at equal training time ({minutes:.1f} min, replayed held-out tau; "
                      "training minutes per family: "
                      + ", ".join(f"{f} {points[-1]['minutes']:.1f}" for f, points in curves.items()) + "):", ""]
        lines += [f"- {family}: {tau_at(points, minutes):.3f}" for family, points in curves.items()]
        lines += ["", "Replayed held-out tau of the final drafts, with a 90% paired-bootstrap interval over the "
                      "held-out prompts:", ""] + [f"- {line}" for line in family_ratios(curves)]
        if "ngram" in result:
            lines += ["", "Replayed against prompt lookup on the same held-out prompts (oracle chooser: per round the "
                          "longer accepted proposal of the two, replayed):", ""]
            lines += [f"- {line}" for line in ngram_ratios(curves, result["ngram"])]
            lines += ["", *source_tables(result.get("vs_ngram", {}))]
            lines += family_source_tables(curves, result["ngram"], result.get("records", []))
        if position_acceptance(curves):
            lines += ["Acceptance at each draft position, final drafts (replayed):", "", *position_acceptance(curves)]
        copying = {f: points[-1] for f, points in curves.items() if "lookup_hit_share" in points[-1]}
        if copying:  # (results saved before this was measured lack it)
            share = next(iter(copying.values()))["lookup_hit_share"]
            lines += ["", f"Copying from the context: prompt lookup (the n-gram drafter) proposes the right next token "
                          f"at {share:.0%} of the held-out answer positions; each drafter's first draft (replayed, "
                          "last checkpoint) is right there, and elsewhere:", ""]
            lines += [f"- {f}: {p['first_draft_right_at_lookup_hits']:.3f} where lookup is right, "
                      f"{p['first_draft_right_elsewhere']:.3f} elsewhere" for f, p in copying.items()]
    if result.get("arms"):
        lines += ["", "Arms at equal steps, held-out tau over the recipe's (same data, batches and schedule):", ""]
        lines += [f"- {line}" for line in arm_ratios(curves, result["arms"])]
    split = {name: row["generalization"] for name, row in result["drafters"].items() if "generalization" in row}
    if split:
        lines += ["", "Where the gap is: each final draft replayed (tau) on its own training records, on prompts of "
                      "the training sources it never saw, and on the held-out sources (training -> in-distribution: "
                      "memorisation; in-distribution -> held-out sources: domain shift):", ""]
        lines += [f"- {name}: {gap_split(taus)}" for name, taus in split.items()]
    return "\n".join(lines) + "\n"


def at(temperature: float) -> str:
    """The suffix of a real-loop run's name at a temperature other than 0 (T=0 runs keep their plain names)."""
    return "" if temperature == 0 else f"@T={temperature:g}"


def arm_ratios(curves: dict, arms: list[tuple[str, str]]) -> list[str]:
    """Each arm's held-out tau over its family's recipe run, checkpoint by checkpoint (equal steps: the same
    batches and schedule, so checkpoint k of one against checkpoint k of the other), with paired_ratio's interval."""
    lines = []
    for arm, family in arms:
        cells = [format_ratio(*paired_ratio(p, q)) for p, q in zip(curves[arm], curves[family])]
        lines.append(f"{arm} / {family}: " + " / ".join(cells) + " at steps "
                     + " / ".join(str(p["step"]) for p in curves[arm]))
    return lines


def family_ratios(curves: dict) -> list[str]:
    """DSpark's held-out tau over each other family's, final draft against final draft (each family's own steps in the
    same budget), with paired_ratio's interval over the same held-out prompts."""
    lines = []
    for other in (f for f in FAMILIES if f != "dspark"):
        if "dspark" in curves and other in curves:
            p, q = curves["dspark"][-1], curves[other][-1]
            lines.append(f"dspark / {other}: {format_ratio(*paired_ratio(p, q))} (final drafts: {p['step']} / "
                         f"{q['step']} steps, {p['minutes']:.1f} / {q['minutes']:.1f} training min)")
    return lines


def family_source_tables(curves: dict, ngram: dict, records: list[dict], over: str = "dspark") -> list[str]:
    """Each other draft's final draft over `over`'s (DSpark's, or an --also-draft's: --over), replayed on the same
    held-out records, per source and for the copy-heavy prompts (prompt lookup's own tau > 2.5) and the rest, with
    paired intervals (eval/compare.py)."""
    if not records or over not in curves or "per_record_rounds" not in curves[over][-1]:
        return []  # (results saved before the records were kept)
    sources, lines = [r["source"] for r in records], []
    for other in (f for f in curves if f != over and "per_record_rounds" in curves[f][-1]):
        rows = source_rows(curves[other][-1], curves[over][-1], sources, lookup=ngram)
        lines += [f"{other} over {over}, final drafts per source (replayed, T=0):", "",
                  *source_table(rows, other=over), ""]
    return lines


def position_acceptance(curves: dict) -> list[str]:
    """The final drafts' conditional acceptance at each draft position k (accepted at k given accepted up to k-1) and
    the unconditional rate, replayed; a markdown table (curves saved before these were kept are left out)."""
    finals = {name: points[-1] for name, points in curves.items() if "cond_accept_rate_at_k" in points[-1]}
    if not finals:
        return []
    k = len(next(iter(finals.values()))["cond_accept_rate_at_k"])
    lines = ["| final draft | steps | " + " | ".join(f"cond@{i + 1}" for i in range(k))
             + " | acc@1 | acc@2 | acc@3 |", "|---|---|" + "---|" * (k + 3)]
    for name, p in finals.items():
        lines.append(f"| {name} | {p['step']} | " + " | ".join(f"{v:.3f}" for v in p["cond_accept_rate_at_k"])
                     + " | " + " | ".join(f"{v:.3f}" for v in p["accept_rate_at_k"][:3]) + " |")
    return lines


def ngram_ratios(curves: dict, ngram: dict) -> list[str]:
    """Each run's final draft over prompt lookup on the same held-out prompts (the issue's each / n-gram), with
    paired_ratio's interval and, where the replay kept it, the tau of the per-round oracle chooser of the two."""
    lines = []
    for name, points in curves.items():
        final = points[-1]
        oracle = f"; oracle chooser {final['oracle']['replayed_tau']:.3f}" if "oracle" in final else ""
        lines.append(f"{name} / n-gram: {format_ratio(*paired_ratio(final, ngram))} (step {final['step']}; n-gram "
                     f"replayed tau {ngram['replayed_tau']:.3f}{oracle})")
    return lines


def oracle_note(points: list[dict] | None, ratio_name: str) -> str:
    """Beside a drafter / n-gram ratio of the real loop: the replayed tau of the per-round oracle chooser between that
    drafter's final draft and prompt lookup, where the curve kept it."""
    if not ratio_name.endswith("/ngram") or not points or "oracle" not in points[-1]:
        return ""
    return f" (oracle chooser of the two, replayed: tau {points[-1]['oracle']['replayed_tau']:.3f})"


def replayed_vs_ngram(curves: dict, ngram: dict, records: list[dict]) -> dict:
    """Each run's final draft against prompt lookup, both replayed on the held-out records: eval/compare.py's rows per
    source, copy-heavy / rest and overall, with the oracle chooser's tau, and the same for the lookup-first rule at each
    match length n (eval/replay.py); runs saved without tallies are left out."""
    sources, rows = [r["source"] for r in records], {}
    for name, points in curves.items():
        final = points[-1]
        if "per_record_rounds" not in final:
            continue
        rows[name] = source_rows(final, ngram, sources, final.get("oracle"))
        for n, tally in final.get("lookup_first", {}).items():  # lookup's proposal when it matched >= n tokens
            rows[f"{name}, lookup first (n >= {n})"] = source_rows(tally, ngram, sources, final.get("oracle"))
    return rows


def source_tables(vs_ngram: dict) -> list[str]:
    """replayed_vs_ngram's rows as one markdown table a run."""
    lines = []
    for name, rows in vs_ngram.items():
        lines += [f"{name}, final draft against prompt lookup per source (replayed, T=0):", "", *source_table(rows), ""]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "quality", help="work folder (runs/quality)")
    parser.add_argument("--budget-s", type=float, default=900.0, help="training seconds per family (900)")
    parser.add_argument("--steps", type=int, help="train every family this many optimizer steps instead of for "
                                                  "--budget-s seconds (no probe)")
    parser.add_argument("--train-prompts", type=int, default=512, help="training prompts to regenerate (512)")
    parser.add_argument("--eval-per-source", type=int, default=8, help="held-out prompts per eval source (8)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per eval prompt (128)")
    parser.add_argument("--gsm8k", type=Path, help="folder with GSM8K train.jsonl/test.jsonl (train on train, "
                                                   "evaluate on test); without it GSM8K is left out")
    parser.add_argument("--train-data", choices=("regenerate", "source"), default="regenerate",
                        help="regenerate: the target answers the training prompts (default); source: the sources' "
                             "own answers with the target's labels, no generation")
    parser.add_argument("--regen-backend", choices=("hf", "vllm"), default="hf",
                        help="who answers the training prompts: hf (in-process, default) or vllm (a vLLM server on "
                             "every core, ~3x the tokens a second once started; needs .venv-vllm, `make venv-vllm`)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (dspark,dflash,dflash2,eagle3)")
    parser.add_argument("--nproc", type=int, default=2, help="training ranks (2)")
    parser.add_argument("--curve-points", type=int, default=5, help="checkpoints replayed for the curve (5)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite quality.md and learning_curve.png from OUT/quality.json, training nothing")
    parser.add_argument("--lookup-first", type=int, action="append", default=[], metavar="N",
                        help="also run each final draft in the real loop with prompt lookup first (its proposal "
                             "whenever the context's last N tokens occurred before; eval.py --lookup-first): "
                             "repeatable. Its replays at every N are always reported")
    parser.add_argument("--temperatures", type=lambda text: [float(t) for t in text.split(",")], default=[0.0],
                        help="real-loop temperatures, comma-separated (default 0; e.g. 0,1 adds every drafter and "
                             "the n-gram drafter at T=1 with per-source ratios; the ratios list is T=0's)")
    parser.add_argument("--curve-only", action="store_true",
                        help="stop after the learning curves (OUT/curves.json, with prompt lookup replayed on the "
                             "same prompts): no real loop, no HF generate; for comparing training arms at equal "
                             "steps (the loop adds ~11 min on 2 CPU cores)")
    parser.add_argument("--skip-split", action="store_true",
                        help="skip replaying each final draft on its training records and unseen prompts of its "
                             "sources (the memorisation / domain-shift split: two more replays a family)")
    parser.add_argument("--full-vocab", action="store_true",
                        help="replay and run every block draft over the whole vocabulary, as the engines draft, "
                             "although it trained over loss.vocab_size's tokens (its token map ignored; eval.py "
                             "--full-vocab)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override for every family's training, e.g. --set train.lr=2e-3")
    parser.add_argument("--arm", dest="arms", action="append", default=[], type=parse_arm,
                        metavar="NAME:KEY=VALUE[,KEY=VALUE]", help="also train each family with these recipe "
                        "overrides, on the same data and steps, in OUT/<family>-NAME (repeatable; a cache.* key "
                        "caches the regeneration again there): its held-out "
                        "curve and its ratio to the recipe's at every checkpoint (the real loop runs the recipe's "
                        "drafts only)")
    parser.add_argument("--add-source", dest="extra_sources", action="append", default=[], type=parse_source,
                        metavar="FILE=WEIGHT", help="a local prompt file added to the training sources with that "
                        "weight (ShareGPT's is 1); never the held-out sources")
    parser.add_argument("--data-dir", type=Path, help="folder of the data stages (train-data, eval-data, "
                        "in-distribution-data; default OUT): runs given one folder train on one regeneration "
                        "(benchmarks/data_scaling.py's steps at one data size)")
    parser.add_argument("--train-run", type=Path, help="a finished pipeline run whose regeneration and cache every "
                        "family trains on instead of regenerating (--train-prompts, --train-data, --regen-backend and "
                        "--add-source then unused), e.g. the default recipe's run: the families at equal time on the "
                        "default's data")
    parser.add_argument("--arm-families", help="comma-separated families the --arm runs train (default: every one "
                        "of --families), e.g. dflash2 for an arm that only that family takes")
    parser.add_argument("--also-draft", dest="also_drafts", action="append", default=[], type=parse_also_draft,
                        metavar="NAME=RUN", help="a finished pipeline run's final draft (RUN/train/final), replayed on "
                        "the same held-out prompts and tabled beside the families (repeatable), e.g. "
                        "default=runs/default: the default recipe's own draft")
    parser.add_argument("--over", default="dspark", help="the draft the others are tabled over, per source with "
                        "paired intervals (dspark; a family or an --also-draft NAME, e.g. default)")
    args = parser.parse_args()
    if 0.0 not in args.temperatures:
        parser.error("--temperatures must include 0 (the ratios and speedups are T=0's)")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    arm_families = families if args.arm_families is None else [f.strip() for f in args.arm_families.split(",")]
    if set(arm_families) - set(families):
        parser.error(f"--arm-families {args.arm_families}: not among --families {args.families}")
    clash = {name for name, _ in args.also_drafts} & {*FAMILIES, *(f"{f}-{a}" for f in families for a, _ in args.arms)}
    if clash:
        parser.error(f"--also-draft names {sorted(clash)} are a family's or an arm's: name them otherwise")
    if args.over not in {*families, *(name for name, _ in args.also_drafts)}:
        parser.error(f"--over {args.over}: not among --families {args.families} or the --also-draft names")
    if args.gsm8k is not None and not (args.gsm8k / "train.jsonl").is_file():
        parser.error(f"--gsm8k {args.gsm8k}: no train.jsonl there")
    out = args.out.resolve()
    if args.report_only:
        result = json.loads((out / "quality.json").read_text())
        return write_reports(result, out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pipeline.log"
    extra_sets = [arg for item in args.overrides for arg in ("--set", item)] + source_sets(args.train_data)

    data_dir = (args.data_dir or out).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    if args.train_run:
        data_run, eval_run, eval_file, eval_sources, sources, data_s = finished_data(
            args.train_run.resolve(), data_dir, args.eval_per_source, args.gsm8k, args.max_new_tokens, args.nproc, log)
    else:
        data_run, eval_run, eval_file, eval_sources, sources, data_s = prepare_data(
            data_dir, args.train_prompts, args.gsm8k, args.eval_per_source, args.max_new_tokens, args.nproc, log,
            args.train_data, args.regen_backend, args.extra_sources)

    num_eval = len(eval_file.read_text().splitlines())
    # the split's unseen prompts of the training sources: answered only where the split is replayed
    in_distribution_run = None if args.skip_split else prepare_in_distribution_data(
        data_dir, data_run, sources, num_eval, args.max_new_tokens, args.nproc, log)

    import torch

    from core.recipe import load_recipe
    from data.states.capture import open_cache
    from eval.report import ReportSettings, vs_ngram
    from eval.run import EvalDecode, run_eval
    from modeling.target import load_target, load_tokenizer, target_hidden_size

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    eos_token_id = tokenizer.eos_token_id  # a replayed answer ends where the loop stops
    train_manifest = json.loads((data_run / "cache" / "manifest.json").read_text())

    # --- 3. each family, the same budget; then each --arm of it on the same data and steps ---------------------------
    # the family's training names its real data (it reads the shared regeneration, whatever its recipe's sources say)
    family_sets = extra_sets + sets(data__sources=sources)
    runs = [(family, family, []) for family in families]
    runs += [(f"{family}-{name}", family, arm_sets) for family in arm_families for name, arm_sets in args.arms]
    arm_pairs = [(name, family) for name, family, arm_sets in runs if arm_sets]
    curves, trained, family_steps = {}, {}, {}
    for name, family, arm_sets in runs:
        recipe = f"{family}_smollm2_135m"
        # an arm takes its family's steps (the same batches and schedule); a finished run keeps its own steps (a new
        # probe would give others, which its train stage refuses)
        per_step, steps = None, args.steps or family_steps.get(family) or finished_steps(out / name)
        if steps is None:
            probe = out / f"{name}-probe"
            link_data(data_run, probe)
            run_pipeline(recipe, probe, "train", args.nproc,
                         family_sets + arm_sets + sets(train__max_steps=10, train__save_every=10), log)
            per_step = seconds_per_step(probe)
            steps = max(1, int(args.budget_s / per_step))
            shutil.rmtree(probe)
        family_steps.setdefault(family, steps)
        run = out / name
        own_cache = reads_own_cache(arm_sets)
        link_data(data_run, run, names=("regen",) if own_cache else ("regen", "cache"))
        save_every = max(1, steps // args.curve_points)
        wall_s = run_pipeline(recipe, run, "cache,train" if own_cache else "train", args.nproc,
                              family_sets + arm_sets + sets(train__max_steps=steps, train__save_every=save_every,
                                                            train__keep_checkpoints=0), log)
        eval_cache = open_eval_cache(recipe, eval_run)
        saved_curve = run / "curve.json"  # the checkpoints are deleted once read: a rerun reads the curve back
        if saved_curve.is_file() and not any((run / "train" / "checkpoints").glob("step-*")):
            curves[name] = json.loads(saved_curve.read_text())
        else:
            curves[name] = learning_curve(run, eval_cache, 7, args.max_new_tokens, eos_token_id, args.full_vocab)
            saved_curve.write_text(json.dumps(curves[name], indent=1) + "\n")
        saved_split = run / "generalization.json"
        if not saved_split.is_file() and not args.skip_split:
            recipe_obj = load_recipe(recipe, args.overrides)
            hidden = target_hidden_size(recipe_obj.target.name_or_path)
            caches = {"training records": open_cache(recipe_obj, data_run / "cache", hidden, tokenizer),
                      "in-distribution held-out": open_eval_cache(recipe, in_distribution_run),
                      "held-out sources": eval_cache}
            last = curves[name][-1]
            if last["step"] == steps:  # the curve's last checkpoint is the final draft: its replay is already done
                del caches["held-out sources"]
            split = generalization(run / "train" / "final", caches, num_eval, 7, args.max_new_tokens, eos_token_id,
                                   args.full_vocab)
            split.setdefault("held-out sources", last["replayed_tau"])
            saved_split.write_text(json.dumps(split) + "\n")
        # train_s: the steps' own seconds (the curve's clock), also right when a finished folder was skipped
        trained[name] = {"steps": steps, "train_s": curves[name][-1]["minutes"] * 60, "wall_s": wall_s,
                         "probe_s_per_step": per_step}
        if saved_split.is_file():
            trained[name]["generalization"] = json.loads(saved_split.read_text())
        if arm_sets:
            trained[name]["overrides"] = arm_sets[1::2]
        for ckpt in (run / "train" / "checkpoints").glob("step-*"):  # the curve is read: free the disk
            shutil.rmtree(ckpt)

    for name, run in args.also_drafts:  # a draft trained elsewhere, on the same held-out records
        its_layers = open_eval_cache(str(run / "recipe.yaml"), eval_run)  # the held-out states at its recipe's layers
        curves[name] = [final_draft_point(run, its_layers, 7, args.max_new_tokens, eos_token_id, args.full_vocab)]
        trained[name] = {"steps": curves[name][0]["step"], "train_s": curves[name][0]["minutes"] * 60}

    # prompt lookup replayed on the same held-out records, and which prompt each record is: the per-source tables
    records = eval_records(eval_run)
    ngram = ngram_replay(eval_cache, args.max_new_tokens, eos_token_id)
    replayed = replayed_vs_ngram(curves, ngram, records)
    if args.curve_only:
        (out / "curves.json").write_text(json.dumps({"data_s": data_s, "full_vocab": args.full_vocab,
                                                     "trained": trained, "curves": curves,
                                                     "ngram": ngram, "records": records, "vs_ngram": replayed},
                                                    indent=1) + "\n")
        print(f"[quality] {end_to_end(data_s, trained)}")
        for name, points in curves.items():
            if "generalization" in trained[name]:
                print(f"[quality] {name}: final draft replayed on {gap_split(trained[name]['generalization'])}")
            print(f"[quality] {name}: replayed held-out tau " + " / ".join(
                f"{p['replayed_tau']:.3f}" for p in points) + " at steps " + " / ".join(str(p["step"]) for p in points))
        for line in family_ratios(curves) + arm_ratios(curves, arm_pairs) + ngram_ratios(curves, ngram):
            print(f"[quality] {line}")
        print("\n".join(["", *source_tables(replayed), *family_source_tables(curves, ngram, records, args.over),
                         "Acceptance at each draft position, final drafts (replayed):", "", *position_acceptance(curves)]))
        return 0

    # --- 4. the real loop on the held-out prompts, baselines in the same process ------------------------------------
    target = load_target("smollm2-135m-instruct", "cuda" if torch.cuda.is_available() else "cpu")
    baselines, drafters, samples = {}, {}, {}
    # (name, draft, lookup-first n, temperature): T=0 first (the ratios), then each --temperatures T > 0
    loop_runs = [(f, f, 0) for f in families] + [(f"{f}+lookup{n}", f, n) for f in families for n in args.lookup_first]
    loop_runs = [(name + at(t), draft, n, t) for t in sorted(set(args.temperatures))
                 for name, draft, n in loop_runs + [("ngram", "ngram", 0)]]
    for name, draft, n, temperature in loop_runs:
        draft = str(out / draft / "train" / "final") if draft in FAMILIES else draft
        report = run_eval(EvalDecode(draft=draft, target_name="smollm2-135m-instruct", dataset=str(eval_file),
                                     num_samples=0, temperature=temperature, block_size=7,
                                     max_new_tokens=args.max_new_tokens, lookup_first=n, full_vocab=args.full_vocab),
                          ReportSettings(out_dir=out / "eval" / name, scheduler=False, hf_generate=True),
                          target=target, baselines=baselines)
        drafters[name] = {**trained.get(name, {}), "report": {k: v for k, v in report.items() if k != "samples"}}
        samples[name] = report["samples"]
        print(f"[quality] {name}: tau {report['accept_len']:.3f}, speedup {report['speedup']:.2f}x"
              + (f", {report['speedup_vs_generate']:.2f}x of HF generate" if "speedup_vs_generate" in report else ""),
              flush=True)

    tau = {name: row["report"]["accept_len"] for name, row in drafters.items()}
    ratios = {}
    if "dspark" in tau:
        ratios.update({f"dspark/{other}": ratio(tau["dspark"], tau[other]) for other in FAMILIES
                       if other != "dspark" and other in tau})
    ratios.update({f"{name}/ngram": ratio(tau[name], tau["ngram"]) for name, _, _, t in loop_runs
                   if t == 0 and name != "ngram"})
    first = next(iter(drafters.values()))["report"]
    result = {"budget_s": None if args.steps else args.budget_s, "steps": args.steps, "nproc": args.nproc,
              "train_data": args.train_data, "regen_backend": args.regen_backend, "gamma": 7,
              "max_new_tokens": args.max_new_tokens,
              "train_sources": sources, "train_records": train_manifest["num_records"],
              "train_tokens": train_manifest["num_tokens"], "data_s": data_s, "eval_sources": eval_sources,
              "num_eval_prompts": first["num_samples"], "target_tokens_per_s": first["target_tokens_per_s"],
              "hf_generate_tokens_per_s": first["hf_generate_tokens_per_s"], "drafters": drafters,
              "ratios": ratios, "curves": curves, "arms": arm_pairs, "records": records, "ngram": ngram,
              "vs_ngram": replayed,
              "loop_vs_ngram": {name: vs_ngram(samples[name], samples["ngram" + at(t)], t)
                                for name, _, _, t in loop_runs if not name.startswith("ngram")}}
    (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    return write_reports(result, out)


def write_reports(result: dict, out: Path) -> int:
    (out / "quality.md").write_text(markdown(result))
    plot_curves(result["curves"], {"ngram": result["drafters"]["ngram"]["report"]["accept_len"]},
                out / "learning_curve.png", result["budget_s"])
    print(markdown(result))
    print(f"[quality] {out / 'quality.md'}, {out / 'learning_curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
