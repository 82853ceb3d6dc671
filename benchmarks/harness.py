"""What the benchmark scripts share: recipe overrides and their command-line forms, the pipeline run in a child
process, the training and held-out data they prepare (regenerated, cached), and the held-out replays (learning
curves, prompt lookup, the generalization split). benchmarks/quality.py is the benchmark that uses all of it; every
script imports it the same way, with the repository root on sys.path (as `python benchmarks/X.py` puts it there):

    ROOT = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(ROOT))
    from benchmarks.harness import run_pipeline, sets  # noqa: E402

The ratio of two drafters' taus and its paired interval live in eval/compare.py, which eval's own report uses too.
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

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}

#: held-out tau is replayed from the target's own states, not from a compact copy of them (whatever the training
#: cache's encoding: the arms that compare encodings must not change their yardstick)
EVAL_CACHE_ENCODING = "raw"
# named sources --add-source takes: the held-out sets (MT-bench, HumanEval, GSM8K test) never; GSM8K train via --gsm8k
TRAINING_SOURCES = ("sharegpt", "libcode")


def host_copy(func, args, kwargs):
    """(source, dtype, destination) when an aten call a TorchDispatchMode sees copies a tensor from another device into
    host memory, else None: _to_copy, the .to overloads (under inference mode `.to("cpu", dtype)` reaches a mode as
    aten.to.device, not as the _to_copy it decomposes into), or copy_ into a host tensor (its `destination`; None for
    the others, which make a new one)."""
    import torch

    aten = torch.ops.aten
    if func.overloadpacket is aten._to_copy or func in (aten.to.dtype_layout, aten.to.device):
        device, dtype = (args[1], args[2]) if func is aten.to.device else (kwargs.get("device"), kwargs.get("dtype"))
        if device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu":
            return args[0], dtype or args[0].dtype, None
    elif func.overloadpacket is aten.copy_ and args[0].device.type == "cpu" and args[1].device.type != "cpu":
        return args[1], args[0].dtype, args[0]
    return None


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def sets(**values) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key.replace('__', '.')}={value}")]


def parse_arm(item: str) -> tuple[str, list[str]]:
    """NAME:KEY=VALUE[,KEY=VALUE...] -> (NAME, ["--set", "KEY=VALUE", ...]): a training arm's recipe overrides."""
    name, _, keys = item.partition(":")
    if not name or "/" in name or not keys or any("=" not in kv for kv in keys.split(",")):
        raise argparse.ArgumentTypeError(f"{item!r}: expected NAME:KEY=VALUE[,KEY=VALUE...], e.g. "
                                         "decay1.5:loss.loss_decay_gamma=1.5")
    return name, [arg for kv in keys.split(",") for arg in ("--set", kv)]


def parse_source(item: str) -> tuple[Path | str, float]:
    """--add-source SOURCE=WEIGHT: SOURCE a local prompt file (.json/.jsonl in any shape data.sources reads) or a
    training source's name (e.g. libcode); never a held-out source."""
    name, _, weight = item.rpartition("=")
    try:
        value = float(weight)
    except ValueError:
        value = 0.0
    builtin = name in TRAINING_SOURCES
    if not (0 < value < math.inf) or not (builtin or Path(name).is_file()):  # (nan fails the comparison too)
        raise argparse.ArgumentTypeError(f"{item!r}: expected SOURCE=WEIGHT with an existing prompt file or a training "
                                         "source's name and a weight > 0, e.g. prompts.jsonl=0.5 or libcode=1")
    return (name if builtin else Path(name)), value


def source_sets(train_data: str) -> list[str]:
    """The recipe keys of --train-data: the sources' answers need the target's labels."""
    return sets(regen__backend="source", loss__ce_labels="target") if train_data == "source" else []


def training_sources(gsm8k: Path | None, extra: list[tuple[Path, float]] = ()) -> str:
    """The training prompt sources, as a recipe value: ShareGPT, plus GSM8K train with --gsm8k, plus local prompt
    files and named training sources (--add-source)."""
    return "[{name: sharegpt, weight: 1.0}" + (f", {{name: gsm8k, path: '{gsm8k / 'train.jsonl'}', "
                                              f"weight: 1.0}}" if gsm8k else "") + "".join(
        f", {{name: '{source.resolve() if isinstance(source, Path) else source}', weight: {weight}}}"
        for source, weight in extra) + "]"


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


def link_data(data_run: Path, family_run: Path, names: tuple[str, ...] = ("regen", "cache")) -> None:
    """A family's run folder reads the shared regeneration and cache (the train stage only reads them)."""
    family_run.mkdir(parents=True, exist_ok=True)
    for name in names:
        link = family_run / name
        if not link.exists():
            link.symlink_to((data_run / name).resolve(), target_is_directory=True)


def prepare_data(out: Path, train_prompts: int, gsm8k: Path | None, eval_per_source: int, max_new_tokens: int,
                 nproc: int, log: Path, train_data: str = "regenerate", regen_backend: str = "hf",
                 extra_sources: list[tuple[Path, float]] = ()):
    """Regenerate + cache the training prompts and the held-out eval prompts. Returns (train run, eval run, eval
    prompt file, eval source names, training sources, training data seconds). `regen_backend` answers the training
    prompts (vllm: one server on every core, so one process); the held-out prompts are always answered in-process."""
    sources = training_sources(gsm8k, extra_sources)
    data_run = out / "train-data"
    backend = sets(regen__backend=regen_backend) if train_data == "regenerate" else []
    run_pipeline("dspark_smollm2_135m", data_run, "regenerate,cache", 1 if regen_backend == "vllm" else nproc,
                 sets(data__sources=sources, data__num_prompts=train_prompts) + source_sets(train_data) + backend, log)
    data_s = data_seconds(data_run)
    eval_run, eval_file, eval_sources = prepare_eval_data(out, eval_per_source, gsm8k, max_new_tokens, nproc, log)
    return data_run, eval_run, eval_file, eval_sources, sources, data_s


def data_seconds(run: Path) -> float:
    """The regeneration and cache stages' seconds, from their DONE.json (their last run's: right also when a finished
    folder is skipped)."""
    return sum(json.loads((run / stage / "DONE.json").read_text())["seconds"] for stage in ("regen", "cache"))


def finished_data(run: Path, out: Path, eval_per_source: int, gsm8k: Path | None, max_new_tokens: int, nproc: int,
                  log: Path):
    """prepare_data's returns for a finished pipeline run's regeneration and cache (e.g. the default recipe's run),
    trained on as they are: its recipe names the sources, its stages' DONE.json the seconds they took."""
    import yaml

    for name in ("regen", "cache"):
        if not (run / name / "DONE.json").is_file():
            raise SystemExit(f"[quality] --train-run {run}: no finished {name} stage there ({run / name}/DONE.json); "
                             f"run `train/main.py --out {run} --stages regenerate,cache` first")
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    sources = yaml.safe_dump(recipe["data"]["sources"], default_flow_style=True, width=10**6).strip()
    data_s = data_seconds(run)
    eval_run, eval_file, eval_sources = prepare_eval_data(out, eval_per_source, gsm8k, max_new_tokens, nproc, log)
    return run, eval_run, eval_file, eval_sources, sources, data_s


def prepare_eval_data(out: Path, eval_per_source: int, gsm8k: Path | None, max_new_tokens: int, nproc: int,
                      log: Path) -> tuple[Path, Path, list[str]]:
    """The held-out prompts (MT-bench, HumanEval, + GSM8K test) with their greedy answers regenerated and cached, to
    replay held-out tau. Returns (eval run, eval prompt file, eval source names)."""
    eval_file = out / "eval_prompts.jsonl"
    eval_sources = write_eval_prompts(eval_file, eval_per_source, gsm8k, seed=0)
    eval_run = out / "eval-data"
    answer_and_cache(eval_file, eval_run, max_new_tokens, nproc, log)
    return eval_run, eval_file, eval_sources


def write_first_turns(path: Path, prompts) -> Path:
    """A prompt file (JSONL) of the prompts' ids and first turns: what the benchmarks answer, cache and replay."""
    path.write_text("".join(json.dumps({"id": p.id, "turns": [p.turns[0]]}) + "\n" for p in prompts))
    return path


def write_eval_prompts(path: Path, per_source: int, gsm8k: Path | None, seed: int) -> list[str]:
    from data.sources.prompts import eval_prompts

    sources = [("mtbench", None), ("humaneval", None)] + ([("gsm8k", str(gsm8k / "test.jsonl"))] if gsm8k else [])
    write_first_turns(path, [prompt for name, source_path in sources
                             for prompt in eval_prompts(name, per_source, seed, path=source_path)])
    return [name for name, _ in sources]


def answer_and_cache(prompt_file: Path, run: Path, max_new_tokens: int, nproc: int, log: Path) -> None:
    """First turns of `prompt_file` answered greedily by the target and cached, for replay (eval/replay.py)."""
    count = len(prompt_file.read_text().splitlines())
    run_pipeline("dspark_smollm2_135m", run, "regenerate,cache", nproc,
                 sets(data__sources=f"[{{name: '{prompt_file}'}}]", data__num_prompts=count, data__holdout_fraction=0.0,
                      data__max_turns=1, data__min_loss_tokens=1, regen__backend="hf", regen__temperature=0,
                      regen__max_new_tokens=max_new_tokens, cache__encoding=EVAL_CACHE_ENCODING), log)


def prepare_in_distribution_data(out: Path, data_run: Path, sources: str, count: int, max_new_tokens: int, nproc: int,
                                 log: Path) -> Path:
    """Prompts of the training sources that training never saw (their holdout split under the data.holdout_fraction
    and seed `data_run` drew its training prompts with: a training override such as --set seed=43 changes neither),
    answered and cached like the held-out prompts: the same drafter replayed on them, on the held-out sources and on
    its training records splits its gap into domain shift and memorisation."""
    import yaml

    from core.recipe import load_recipe
    from data.sources.prompts import load_prompts

    recipe = load_recipe(str(data_run / "recipe.yaml"))
    prompt_file = out / "in_distribution_prompts.jsonl"
    prompts = load_prompts(yaml.safe_load(sources), count, recipe.data.holdout_fraction, recipe.seed, split="holdout")
    write_first_turns(prompt_file, prompts)
    run = out / "in-distribution-data"
    answer_and_cache(prompt_file, run, max_new_tokens, nproc, log)
    return run


def holdout_prompt_file(data_run: Path, per_source: int, path: Path) -> Path:
    """`per_source` prompts of each of `data_run`'s training sources that its training never saw (each source's
    held-out split under the run's data.holdout_fraction and seed), first turns only, written to `path` (JSONL): in
    distribution, yet unseen, as a calibration set wants."""
    from core.recipe import load_recipe
    from data.sources.prompts import load_prompts

    recipe = load_recipe(str(data_run / "recipe.yaml"))
    prompts = [p for source in recipe.data.sources for p in load_prompts(
        [{"name": source.name, "path": source.path}], per_source, recipe.data.holdout_fraction, recipe.seed,
        split="holdout")]
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_first_turns(path, prompts)


def open_eval_cache(recipe_name: str, eval_run: Path):
    """The held-out prompts' cache (prepare_eval_data), read with `recipe_name`'s layers."""
    from core.recipe import load_recipe
    from data.states.capture import open_cache
    from modeling.target import load_tokenizer, target_hidden_size

    recipe = load_recipe(recipe_name, [f"cache.encoding={EVAL_CACHE_ENCODING}"])
    return open_cache(recipe, eval_run / "cache", target_hidden_size(recipe.target.name_or_path),
                      load_tokenizer(recipe.target.name_or_path))


def eval_records(eval_run: Path) -> list[dict]:
    """{"id", "source"} of each record of the held-out cache (prepare_eval_data), in the cache's order, which is the
    order of every replay's per-record tallies: the cache stores the regenerated conversations in record order, less
    those without a supervised token (data/states/capture.py training_rows, read here with the run's own recipe)."""
    from core.recipe import load_recipe
    from data.states.capture import training_rows
    from eval.compare import record_source
    from modeling.target import load_tokenizer

    recipe = load_recipe(str(eval_run / "recipe.yaml"))
    rows, _ = training_rows(recipe, eval_run / "regen", load_tokenizer(recipe.target.name_or_path))
    return [{"id": row["id"], "source": record_source(row["id"])} for row in rows]


def learning_curve(family_run: Path, eval_cache, gamma: int, max_new_tokens: int, eos_token_id,
                   full_vocab: bool = False) -> list[dict]:
    """Replayed held-out tau of every checkpoint (its weight average where train.ema_decay kept one: the weights
    train/final holds), against the training minutes spent to reach it (replay_point)."""
    from modeling.registry import load_draft_model
    from train.checkpoint import AVERAGE_NAME, published_weights

    minutes = training_minutes(family_run)
    records = [eval_cache[i] for i in range(len(eval_cache))]
    points = []
    for ckpt in sorted((family_run / "train" / "checkpoints").glob("step-*")):
        step = int(ckpt.name.split("-")[1])
        model = load_draft_model(ckpt / "draft")
        if (ckpt / AVERAGE_NAME).is_file():  # train.ema_decay: the weights train/final, eval and export read
            model.load_state_dict(published_weights(ckpt))
        points.append(replay_point(f"{family_run.name} step {step}", replay_model(model, full_vocab), records,
                                   step, minutes[step], gamma, max_new_tokens, eos_token_id))
    return points


def final_draft_point(run: Path, eval_cache, gamma: int, max_new_tokens: int, eos_token_id,
                      full_vocab: bool = False) -> dict:
    """replay_point of a finished run's final draft (RUN/train/final), at its last step and training minutes."""
    from modeling.registry import load_draft_model

    minutes = training_minutes(run)
    step = max(minutes)
    records = [eval_cache[i] for i in range(len(eval_cache))]
    return replay_point(f"{run.name} final", replay_model(load_draft_model(run / "train" / "final"), full_vocab),
                        records, step, minutes[step], gamma, max_new_tokens, eos_token_id)


def training_minutes(run: Path) -> dict[int, float]:
    """step -> training minutes spent to reach it (the steps' own seconds in RUN/train/metrics.jsonl)."""
    elapsed, minutes = 0.0, {}
    for line in (run / "train" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        elapsed += row["step_s"]
        minutes[row["step"]] = elapsed / 60
    return minutes


def replay_point(label: str, model, records: list, step: int, minutes: float, gamma: int, max_new_tokens: int,
                 eos_token_id) -> dict:
    """One draft replayed on the held-out records: its tau, with the tallies behind it and behind the per-round oracle
    chooser between it and prompt lookup (`oracle`) and the lookup-first rule (`lookup_first`, eval/replay.py), which
    the paired intervals and per-source tables of eval/compare.py read, and the acceptance at each draft position
    (accept_rate_at_k, cond_accept_rate_at_k)."""
    from eval.replay import replay_records

    replay = replay_records(model, records, gamma, max_new_tokens, eos_token_id)
    copying = {k: replay[k] for k in ("lookup_hit_share", "first_draft_right_at_lookup_hits",
                                      "first_draft_right_elsewhere", "per_record_tokens", "per_record_rounds",
                                      "oracle", "lookup_first", "accept_rate_at_k", "cond_accept_rate_at_k")}
    print(f"[quality] {label}: replayed held-out tau {replay['accept_len']:.3f}; first draft right at "
          f"{copying['first_draft_right_at_lookup_hits']:.3f} of the positions prompt lookup gets right "
          f"({copying['lookup_hit_share']:.0%} of them), {copying['first_draft_right_elsewhere']:.3f} elsewhere",
          flush=True)
    return {"step": step, "minutes": minutes, "replayed_tau": replay["accept_len"], **copying}


def replay_model(model, full_vocab: bool):
    """A loaded draft made ready to replay, in fp32; full_vocab: a block draft trained over loss.vocab_size drafts over
    the whole vocabulary anyway (its token map dropped), as the serving engines draft and eval.py --full-vocab does."""
    from eval.spec_decode import drop_token_map

    return (drop_token_map(model) if full_vocab else model).float()


def ngram_replay(eval_cache, max_new_tokens: int, eos_token_id) -> dict:
    """Prompt lookup (the n-gram drafter) replayed on the held-out records: its tau, and the tokens and rounds per
    prompt that pair it with a draft's in paired_ratio."""
    from eval.replay import replay_records
    from eval.lookup import NgramDrafter

    replay = replay_records(NgramDrafter(), [eval_cache[i] for i in range(len(eval_cache))], 7, max_new_tokens,
                            eos_token_id)
    return {"replayed_tau": replay["accept_len"], "per_record_tokens": replay["per_record_tokens"],
            "per_record_rounds": replay["per_record_rounds"]}


def generalization(final: Path, caches: dict, count: int, gamma: int, max_new_tokens: int, eos_token_id,
                   full_vocab: bool = False) -> dict:
    """Replayed tau of the final draft on the first `count` records of each cache (name -> cache)."""
    from eval.replay import replay_records
    from modeling.registry import load_draft_model

    model = replay_model(load_draft_model(final), full_vocab)
    return {name: replay_records(model, [cache[i] for i in range(min(count, len(cache)))], gamma, max_new_tokens,
                                 eos_token_id)["accept_len"] for name, cache in caches.items()}
