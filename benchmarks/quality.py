"""Drafter quality on prompts never trained on: the three families on the same data and CPU budget, side by side with
the n-gram drafter and plain HF `generate`, in one run.

    python benchmarks/quality.py --budget-s 600 --train-prompts 256 --eval-per-source 6 --gsm8k ../shared/data/gsm8k
                                                        # about 65 min on 2 CPU cores (the README's figures)
    python benchmarks/quality.py --out runs/q60 --train-prompts 1280 --regen-backend vllm \\
        --gsm8k ../shared/data/gsm8k --eval-per-source 6 --steps 1200 --curve-points 6 --families dspark
                                                        # the 60-minute budget: 41 min end to end + ~17 min of
                                                        # held-out answers, replays and the loop (README)
    python benchmarks/quality.py --budget-s 60 --train-prompts 32 --eval-per-source 2  # a quick smoke run

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

Writes OUT/quality.json, OUT/quality.md and OUT/learning_curve.png (held-out tau against training minutes). Each
final draft is also replayed on its training records and on unseen prompts of the training sources (their holdout
split), which splits its gap into memorisation and domain shift. --curve-only stops before the real loop
(OUT/curves.json; each draft's tau over prompt lookup's, both replayed on the same prompts): arms that compare
training settings at equal steps need only the curves. Each --arm trains
every family again with its overrides on the same data and steps and prints its held-out tau over the recipe's
at every checkpoint, e.g. --arm decay1.5:loss.loss_decay_gamma=1.5 (OUT/dspark-decay1.5).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core import stage  # noqa: E402
from core.io import read_json  # noqa: E402

FAMILIES = ("dspark", "dflash", "eagle3")
TRAIN_DATA = {"regenerate": "the target's own greedy answers", "source": "the sources' own answers, target's labels"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}


def sets(**values) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key.replace('__', '.')}={value}")]


def run_pipeline(recipe: str, out: Path, stages: str, nproc: int, extra: list[str], log: Path,
                 env: dict | None = None) -> float:
    """train/main.py in a child process (torchrun with nproc > 1), `env` added to its environment; returns its wall
    seconds. Fails loudly."""
    launcher = [sys.executable, "train/main.py"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train/main.py"]
    command = launcher + ["--recipe", recipe, "--out", str(out), "--stages", stages] + extra
    print(f"[quality] {' '.join(command[-(len(extra) + 6):])}", flush=True)
    start = time.perf_counter()
    with open(log, "a") as handle:
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **OFFLINE, **(env or {})}, stdout=handle,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"[quality] failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def write_eval_prompts(path: Path, per_source: int, gsm8k: Path | None, seed: int) -> list[str]:
    from data.prompts import eval_prompts

    sources = [("mtbench", None), ("humaneval", None)] + ([("gsm8k", str(gsm8k / "test.jsonl"))] if gsm8k else [])
    rows, names = [], []
    for name, source_path in sources:
        for prompt in eval_prompts(name, per_source, seed, path=source_path):
            rows.append({"id": prompt.id, "turns": [prompt.turns[0]]})
        names.append(name)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return names


def link_data(data_run: Path, family_run: Path, names: tuple[str, ...] = ("regen", "cache")) -> None:
    """A family's run folder reads the shared regeneration and cache (the train stage only reads them)."""
    family_run.mkdir(parents=True, exist_ok=True)
    for name in names:
        link = family_run / name
        if not link.exists():
            link.symlink_to((data_run / name).resolve(), target_is_directory=True)


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


def learning_curve(family_run: Path, eval_cache, gamma: int, max_new_tokens: int, eos_token_id) -> list[dict]:
    """Replayed held-out tau of every checkpoint, against the training minutes spent to reach it."""
    from eval.replay import replay_records
    from modeling.registry import load_draft_model

    rows = [json.loads(line) for line in (family_run / "train" / "metrics.jsonl").read_text().splitlines()]
    elapsed, minutes = 0.0, {}
    for row in rows:
        elapsed += row["step_s"]
        minutes[row["step"]] = elapsed / 60
    records = [eval_cache[i] for i in range(len(eval_cache))]
    points = []
    for ckpt in sorted((family_run / "train" / "checkpoints").glob("step-*")):
        step = int(ckpt.name.split("-")[1])
        model = load_draft_model(ckpt / "draft").float()
        replay = replay_records(model, records, gamma, max_new_tokens, eos_token_id)
        copying = {k: replay[k] for k in ("lookup_hit_share", "first_draft_right_at_lookup_hits",
                                          "first_draft_right_elsewhere", "per_record_tokens", "per_record_rounds")}
        points.append({"step": step, "minutes": minutes[step], "replayed_tau": replay["accept_len"], **copying})
        print(f"[quality] {family_run.name} step {step}: replayed held-out tau {replay['accept_len']:.3f}; first "
              f"draft right at {copying['first_draft_right_at_lookup_hits']:.3f} of the positions prompt lookup gets "
              f"right ({copying['lookup_hit_share']:.0%} of them), {copying['first_draft_right_elsewhere']:.3f} "
              "elsewhere", flush=True)
    return points


def plot_curves(curves: dict, baselines: dict, path: Path, budget_s: float) -> None:
    from eval.run import new_plot, save_plot

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


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


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
    lines += [f"- {name}: {value:.3f}" for name, value in result["ratios"].items()]
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


def source_sets(train_data: str) -> list[str]:
    """The recipe keys of --train-data: the sources' answers need the target's labels."""
    return sets(regen__backend="source", loss__ce_labels="target") if train_data == "source" else []


def training_sources(gsm8k: Path | None, extra: list[tuple[Path, float]] = ()) -> str:
    """The training prompt sources, as a recipe value: ShareGPT, plus GSM8K train with --gsm8k, plus local prompt
    files (--add-source)."""
    return "[{name: sharegpt, weight: 1.0}" + (f", {{name: gsm8k, path: '{gsm8k / 'train.jsonl'}', "
                                              f"weight: 1.0}}" if gsm8k else "") + "".join(
        f", {{name: '{path.resolve()}', weight: {weight}}}" for path, weight in extra) + "]"


def parse_arm(item: str) -> tuple[str, list[str]]:
    """NAME:KEY=VALUE[,KEY=VALUE...] -> (NAME, ["--set", "KEY=VALUE", ...]): a training arm's recipe overrides."""
    name, _, keys = item.partition(":")
    if not name or "/" in name or not keys or any("=" not in kv for kv in keys.split(",")):
        raise argparse.ArgumentTypeError(f"{item!r}: expected NAME:KEY=VALUE[,KEY=VALUE...], e.g. "
                                         "decay1.5:loss.loss_decay_gamma=1.5")
    return name, [arg for kv in keys.split(",") for arg in ("--set", kv)]


def paired_ratio(arm: dict, recipe: dict, resamples: int = 2000) -> tuple[float, float | None, float | None]:
    """Held-out tau of one checkpoint over another's, and a 90% interval from a paired bootstrap over the held-out
    prompts (both taus recomputed on each resample of the same prompts), where both kept each prompt's tokens and
    rounds (None, None otherwise): an interval that holds 1 is a lever the prompts do not resolve."""
    ratio = arm["replayed_tau"] / recipe["replayed_tau"]
    if "per_record_rounds" not in arm or "per_record_rounds" not in recipe:
        return ratio, None, None
    import random

    def tau(point: dict, picks: list[int]) -> float:
        return sum(point["per_record_tokens"][i] for i in picks) / sum(point["per_record_rounds"][i] for i in picks)

    rng, count = random.Random(0), len(arm["per_record_rounds"])
    draws = sorted(tau(arm, picks) / tau(recipe, picks) for picks in (
        [rng.randrange(count) for _ in range(count)] for _ in range(resamples)))
    return ratio, draws[int(0.05 * resamples)], draws[int(0.95 * resamples) - 1]


def format_ratio(value: float, low: float | None, high: float | None) -> str:
    """paired_ratio's result as printed: the ratio, and its interval where there is one."""
    return f"{value:.3f}" + (f" [{low:.3f}, {high:.3f}]" if low is not None else "")


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
    for other in ("dflash", "eagle3"):
        if "dspark" in curves and other in curves:
            p, q = curves["dspark"][-1], curves[other][-1]
            lines.append(f"dspark / {other}: {format_ratio(*paired_ratio(p, q))} (final drafts: {p['step']} / "
                         f"{q['step']} steps, {p['minutes']:.1f} / {q['minutes']:.1f} training min)")
    return lines


def ngram_replay(eval_cache, max_new_tokens: int, eos_token_id) -> dict:
    """Prompt lookup (the n-gram drafter) replayed on the held-out records: its tau, and the tokens and rounds per
    prompt that pair it with a draft's in paired_ratio."""
    from eval.replay import replay_records
    from eval.spec_decode import NgramDrafter

    replay = replay_records(NgramDrafter(), [eval_cache[i] for i in range(len(eval_cache))], 7, max_new_tokens,
                            eos_token_id)
    return {"replayed_tau": replay["accept_len"], "per_record_tokens": replay["per_record_tokens"],
            "per_record_rounds": replay["per_record_rounds"]}


def ngram_ratios(curves: dict, ngram: dict) -> list[str]:
    """Each run's final draft over prompt lookup on the same held-out prompts (the issue's each / n-gram), with
    paired_ratio's interval."""
    return [f"{name} / n-gram: {format_ratio(*paired_ratio(points[-1], ngram))} (step {points[-1]['step']}; n-gram "
            f"replayed tau {ngram['replayed_tau']:.3f})" for name, points in curves.items()]


def parse_source(item: str) -> tuple[Path, float]:
    """--add-source FILE=WEIGHT (FILE: a local prompt file, .json/.jsonl in any shape data.sources reads)."""
    path, _, weight = item.rpartition("=")
    try:
        value = float(weight)
    except ValueError:
        value = 0.0
    if not (0 < value < math.inf) or not Path(path).is_file():  # (nan fails the comparison too)
        raise argparse.ArgumentTypeError(f"{item!r}: expected FILE=WEIGHT with an existing prompt file and a weight "
                                         "> 0, e.g. prompts.jsonl=0.5")
    return Path(path), value


def prepare_eval_data(out: Path, eval_per_source: int, gsm8k: Path | None, max_new_tokens: int, nproc: int,
                      log: Path) -> tuple[Path, Path, list[str]]:
    """The held-out prompts (MT-bench, HumanEval, + GSM8K test) with their greedy answers regenerated and cached, to
    replay held-out tau. Returns (eval run, eval prompt file, eval source names)."""
    eval_file = out / "eval_prompts.jsonl"
    eval_sources = write_eval_prompts(eval_file, eval_per_source, gsm8k, seed=0)
    eval_run = out / "eval-data"
    answer_and_cache(eval_file, eval_run, max_new_tokens, nproc, log)
    return eval_run, eval_file, eval_sources


def answer_and_cache(prompt_file: Path, run: Path, max_new_tokens: int, nproc: int, log: Path) -> None:
    """First turns of `prompt_file` answered greedily by the target and cached, for replay (eval/replay.py)."""
    count = len(prompt_file.read_text().splitlines())
    run_pipeline("dspark_smollm2_135m", run, "regenerate,cache", nproc,
                 sets(data__sources=f"[{{name: '{prompt_file}'}}]", data__num_prompts=count, data__holdout_fraction=0.0,
                      data__max_turns=1, data__min_loss_tokens=1, regen__temperature=0,
                      regen__max_new_tokens=max_new_tokens, cache__encoding=EVAL_CACHE_ENCODING), log)


def prepare_in_distribution_data(out: Path, sources: str, count: int, max_new_tokens: int, nproc: int, log: Path,
                                 overrides: list[str] = ()) -> Path:
    """Prompts of the training sources that training never saw (their holdout split under the recipe's
    data.holdout_fraction and seed), answered and cached like the held-out prompts: the same drafter replayed on them,
    on the held-out sources and on its training records splits its gap into domain shift and memorisation."""
    import yaml

    from core.recipe import load_recipe
    from data.prompts import load_prompts

    recipe = load_recipe("dspark_smollm2_135m", list(overrides))
    prompt_file = out / "in_distribution_prompts.jsonl"
    prompts = load_prompts(yaml.safe_load(sources), count, recipe.data.holdout_fraction, recipe.seed, split="holdout")
    prompt_file.write_text("".join(json.dumps({"id": p.id, "turns": [p.turns[0]]}) + "\n" for p in prompts))
    run = out / "in-distribution-data"
    answer_and_cache(prompt_file, run, max_new_tokens, nproc, log)
    return run


def generalization(final: Path, caches: dict, count: int, gamma: int, max_new_tokens: int, eos_token_id) -> dict:
    """Replayed tau of the final draft on the first `count` records of each cache (name -> cache)."""
    from eval.replay import replay_records
    from modeling.registry import load_draft_model

    model = load_draft_model(final).float()
    return {name: replay_records(model, [cache[i] for i in range(min(count, len(cache)))], gamma, max_new_tokens,
                                 eos_token_id)["accept_len"] for name, cache in caches.items()}


#: held-out tau is replayed from the target's own states, not from a compact copy of them (whatever the training
#: cache's encoding: the arms that compare encodings must not change their yardstick)
EVAL_CACHE_ENCODING = "raw"


def open_eval_cache(recipe_name: str, eval_run: Path):
    """The held-out prompts' cache (prepare_eval_data), read with `recipe_name`'s layers."""
    from core.recipe import load_recipe
    from data.capture import open_cache
    from modeling.target import load_tokenizer, target_hidden_size

    recipe = load_recipe(recipe_name, [f"cache.encoding={EVAL_CACHE_ENCODING}"])
    return open_cache(recipe, eval_run / "cache", target_hidden_size(recipe.target.name_or_path),
                      load_tokenizer(recipe.target.name_or_path))


def prepare_data(out: Path, train_prompts: int, gsm8k: Path | None, eval_per_source: int, max_new_tokens: int,
                 nproc: int, log: Path, train_data: str = "regenerate", regen_backend: str = "hf",
                 extra_sources: list[tuple[Path, float]] = ()):
    """Regenerate + cache the training prompts and the held-out eval prompts. Returns (train run, eval run, eval
    prompt file, eval source names, training sources, training data seconds). `regen_backend` answers the training
    prompts (vllm: one server on every core, so one process); the held-out prompts are always answered in-process."""
    sources = training_sources(gsm8k, extra_sources)
    data_run = out / "train-data"
    backend = sets(regen__backend=regen_backend) if train_data == "regenerate" and regen_backend != "hf" else []
    run_pipeline("dspark_smollm2_135m", data_run, "regenerate,cache", 1 if backend else nproc,
                 sets(data__sources=sources, data__num_prompts=train_prompts) + source_sets(train_data) + backend, log)
    # the two stages' seconds from their DONE.json (their last run's): right also when a finished folder is skipped
    data_s = sum(json.loads((data_run / stage / "DONE.json").read_text())["seconds"] for stage in ("regen", "cache"))
    eval_run, eval_file, eval_sources = prepare_eval_data(out, eval_per_source, gsm8k, max_new_tokens, nproc, log)
    return data_run, eval_run, eval_file, eval_sources, sources, data_s


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
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (dspark,dflash,eagle3)")
    parser.add_argument("--nproc", type=int, default=2, help="training ranks (2)")
    parser.add_argument("--curve-points", type=int, default=5, help="checkpoints replayed for the curve (5)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite quality.md and learning_curve.png from OUT/quality.json, training nothing")
    parser.add_argument("--curve-only", action="store_true",
                        help="stop after the learning curves (OUT/curves.json, with prompt lookup replayed on the "
                             "same prompts): no real loop, no HF generate; for comparing training arms at equal "
                             "steps (the loop adds ~11 min on 2 CPU cores)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override for every family's training, e.g. --set train.lr=2e-3")
    parser.add_argument("--arm", dest="arms", action="append", default=[], type=parse_arm,
                        metavar="NAME:KEY=VALUE[,KEY=VALUE]", help="also train each family with these recipe "
                        "overrides, on the same data and steps, in OUT/<family>-NAME (repeatable): its held-out "
                        "curve and its ratio to the recipe's at every checkpoint (the real loop runs the recipe's "
                        "drafts only)")
    parser.add_argument("--add-source", dest="extra_sources", action="append", default=[], type=parse_source,
                        metavar="FILE=WEIGHT", help="a local prompt file added to the training sources with that "
                        "weight (ShareGPT's is 1); never the held-out sources")
    args = parser.parse_args()
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    if args.gsm8k is not None and not (args.gsm8k / "train.jsonl").is_file():
        parser.error(f"--gsm8k {args.gsm8k}: no train.jsonl there")
    out = args.out.resolve()
    if args.report_only:
        result = json.loads((out / "quality.json").read_text())
        return write_reports(result, out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "pipeline.log"
    extra_sets = [arg for item in args.overrides for arg in ("--set", item)] + source_sets(args.train_data)

    data_run, eval_run, eval_file, eval_sources, sources, data_s = prepare_data(
        out, args.train_prompts, args.gsm8k, args.eval_per_source, args.max_new_tokens, args.nproc, log,
        args.train_data, args.regen_backend, args.extra_sources)

    num_eval = len(eval_file.read_text().splitlines())
    in_distribution_run = prepare_in_distribution_data(out, sources, num_eval, args.max_new_tokens, args.nproc, log,
                                                       args.overrides)

    import torch

    from core.recipe import load_recipe
    from data.capture import open_cache
    from eval.run import run_eval
    from modeling.target import load_target, load_tokenizer, target_hidden_size

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    eos_token_id = tokenizer.eos_token_id  # a replayed answer ends where the loop stops
    train_manifest = json.loads((data_run / "cache" / "manifest.json").read_text())

    # --- 3. each family, the same budget; then each --arm of it on the same data and steps ---------------------------
    # the family's training names its real data (it reads the shared regeneration, whatever its recipe's sources say)
    family_sets = extra_sets + sets(data__sources=sources)
    runs = [(family, family, []) for family in families]
    runs += [(f"{family}-{name}", family, arm_sets) for family in families for name, arm_sets in args.arms]
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
        link_data(data_run, run)
        save_every = max(1, steps // args.curve_points)
        wall_s = run_pipeline(recipe, run, "train", args.nproc,
                              family_sets + arm_sets + sets(train__max_steps=steps, train__save_every=save_every,
                                                            train__keep_checkpoints=0), log)
        eval_cache = open_eval_cache(recipe, eval_run)
        saved_curve = run / "curve.json"  # the checkpoints are deleted once read: a rerun reads the curve back
        if saved_curve.is_file() and not any((run / "train" / "checkpoints").glob("step-*")):
            curves[name] = json.loads(saved_curve.read_text())
        else:
            curves[name] = learning_curve(run, eval_cache, 7, args.max_new_tokens, eos_token_id)
            saved_curve.write_text(json.dumps(curves[name], indent=1) + "\n")
        saved_split = run / "generalization.json"
        if not saved_split.is_file():
            recipe_obj = load_recipe(recipe, args.overrides)
            hidden = target_hidden_size(recipe_obj.target.name_or_path)
            caches = {"training records": open_cache(recipe_obj, data_run / "cache", hidden, tokenizer),
                      "in-distribution held-out": open_eval_cache(recipe, in_distribution_run),
                      "held-out sources": eval_cache}
            last = curves[name][-1]
            if last["step"] == steps:  # the curve's last checkpoint is the final draft: its replay is already done
                del caches["held-out sources"]
            split = generalization(run / "train" / "final", caches, num_eval, 7, args.max_new_tokens, eos_token_id)
            split.setdefault("held-out sources", last["replayed_tau"])
            saved_split.write_text(json.dumps(split) + "\n")
        # train_s: the steps' own seconds (the curve's clock), also right when a finished folder was skipped
        trained[name] = {"steps": steps, "train_s": curves[name][-1]["minutes"] * 60, "wall_s": wall_s,
                         "probe_s_per_step": per_step, "generalization": json.loads(saved_split.read_text())}
        if arm_sets:
            trained[name]["overrides"] = arm_sets[1::2]
        for ckpt in (run / "train" / "checkpoints").glob("step-*"):  # the curve is read: free the disk
            shutil.rmtree(ckpt)

    if args.curve_only:
        ngram = ngram_replay(eval_cache, args.max_new_tokens, eos_token_id)
        (out / "curves.json").write_text(json.dumps({"data_s": data_s, "trained": trained, "curves": curves,
                                                     "ngram": ngram}, indent=1) + "\n")
        print(f"[quality] {end_to_end(data_s, trained)}")
        for name, points in curves.items():
            print(f"[quality] {name}: final draft replayed on {gap_split(trained[name]['generalization'])}")
            print(f"[quality] {name}: replayed held-out tau " + " / ".join(
                f"{p['replayed_tau']:.3f}" for p in points) + " at steps " + " / ".join(str(p["step"]) for p in points))
        for line in family_ratios(curves) + arm_ratios(curves, arm_pairs) + ngram_ratios(curves, ngram):
            print(f"[quality] {line}")
        return 0

    # --- 4. the real loop on the held-out prompts, baselines in the same process ------------------------------------
    target = load_target("smollm2-135m-instruct", "cuda" if torch.cuda.is_available() else "cpu")
    baselines, drafters = {}, {}
    for name in families + ["ngram"]:
        draft = str(out / name / "train" / "final") if name in FAMILIES else name
        report = run_eval(draft=draft, target_name="smollm2-135m-instruct", dataset=str(eval_file),
                          out_dir=out / "eval" / name, num_samples=0, temperature=0.0, block_size=7,
                          max_new_tokens=args.max_new_tokens, scheduler=False, target=target, hf_generate=True,
                          baselines=baselines)
        drafters[name] = {**trained.get(name, {}), "report": {k: v for k, v in report.items() if k != "samples"}}
        print(f"[quality] {name}: tau {report['accept_len']:.3f}, speedup {report['speedup']:.2f}x, "
              f"{report['speedup_vs_generate']:.2f}x of HF generate", flush=True)

    tau = {name: row["report"]["accept_len"] for name, row in drafters.items()}
    ratios = {}
    if "dspark" in tau:
        ratios.update({f"dspark/{other}": ratio(tau["dspark"], tau[other]) for other in ("dflash", "eagle3")
                       if other in tau})
    ratios.update({f"{f}/ngram": ratio(tau[f], tau["ngram"]) for f in families})
    first = next(iter(drafters.values()))["report"]
    result = {"budget_s": None if args.steps else args.budget_s, "steps": args.steps, "nproc": args.nproc,
              "train_data": args.train_data, "regen_backend": args.regen_backend, "gamma": 7,
              "max_new_tokens": args.max_new_tokens,
              "train_sources": sources, "train_records": train_manifest["num_records"],
              "train_tokens": train_manifest["num_tokens"], "data_s": data_s, "eval_sources": eval_sources,
              "num_eval_prompts": first["num_samples"], "target_tokens_per_s": first["target_tokens_per_s"],
              "hf_generate_tokens_per_s": first["hf_generate_tokens_per_s"], "drafters": drafters,
              "ratios": ratios, "curves": curves, "arms": arm_pairs}
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
