"""The driver: run a recipe's stages in order. Users type `train/main.py`, which calls `main` here.

    torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m --stages regenerate,cache --set data.num_prompts=64
    python train/main.py --list-recipes

Stages: regenerate (the target answers the prompts) -> cache (target hidden states; skipped when
train.hidden_states is online) -> train -> opd (on-policy distillation; when opd.rounds > 0) -> eval -> export
(an SGLang checkpoint in runs/<recipe>/export/sglang, with the eval's STS calibration beside a DSpark draft).
Each stage writes into --out (default runs/<recipe>) and is skipped when its output is already complete
(core/stage.py), so rerunning the same command after a crash resumes where it stopped.

This file sits on top of the import graph: core/ and modeling/ at the bottom, then data/, train/, export/, eval/
(tests/test_layout.py checks it); only the driver sees every stage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import yaml

from core import stage
from core.io import (DamagedFileError, LinkedPathError, LockedError, atomic_write_bytes, atomic_write_text, link_problem,
                     links_under, lock_for_process, own_root, remove_own_temps, require_free_space)
from core.malloc import keep_freed_memory
from core.recipe import RecipeError, list_recipes, load_recipe, shareable_recipe_dict
from core.server import ENGINES, engine_python_problem
from data.prompts import training_overlap
from data.sources import source_problem

# The stages' modules (torch, transformers: ~12 s to import on a small machine) are imported where they are first
# needed, so that --help, --list-recipes and a bad recipe, stage or input answer within a second.

STAGES = ("regenerate", "cache", "train", "opd", "eval", "export")
STAGE_DIRS = dict(zip(STAGES, stage.STAGE_DIRS))  # each stage's folder under --out
LOCK_NAME = ".draftsmith.lock"
RECIPE_NAME = "recipe.yaml"  # the recipe a run last started with, written beside the stage folders


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train/main.py",
        description="Train a speculative-decoding drafter: regenerate -> cache -> train -> opd -> eval -> export.",
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
    if unknown or not stages:
        print(f"error: {f'unknown stage(s) {unknown}' if unknown else '--stages names no stage'}; stages are "
              f"{', '.join(STAGES)}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("runs") / recipe.name)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var) is None and recipe.target.name_or_path == "smollm2-135m-instruct":
            os.environ[var] = "1"  # the embedded target never needs the hub
    problems = planted_links(stages, out)  # first: nothing below reads through one
    if not problems and recipe.regen.backend == "auto":
        recipe.regen.backend = regen_backend_for(recipe, stages, out)
    problems = problems or check_inputs(recipe, stages, out, int(os.environ.get("WORLD_SIZE", "1")))
    if problems:
        print(f"error: recipe '{recipe.name}' cannot run:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    keep_freed_memory()  # torch's CPU tensors come from malloc: glibc's defaults fault them in again and again

    own_root(out)  # every rank: no write below --out passes through a link
    if int(os.environ.get("RANK", "0")) == 0:  # one lock per run; rank 0 stops a second run (torchrun the rest)
        was_run = (out / LOCK_NAME).is_file() or (out / RECIPE_NAME).is_file()  # before this run made either
        try:
            lock_for_process(out / LOCK_NAME, f"--out {out}")
        except (LockedError, LinkedPathError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # The lock is ours: no other writer's temporaries are in there. Only folders with DraftSmith's stage marker
        # are swept, and the recipe's temporaries only where a run was before; the user's files are never touched.
        ours = [out / d for d in stage.STAGE_DIRS if stage.is_ours(out / d)]
        stale = remove_own_temps(out, ours, [RECIPE_NAME] if was_run else [])
        if stale:
            print(f"[draftsmith] removed {len(stale)} temporary file(s) an interrupted run left in {out}", flush=True)
    from core.dist import close_dist, init_dist
    from data.cache import CacheCorruptedError, CacheMismatchError
    from export.convert import NotAnExportError

    dist = init_dist()
    recipe_file = out / RECIPE_NAME
    previous = recipe_file.read_bytes() if dist.is_main and recipe_file.is_file() else None
    pins = stage_pins(out)
    finished = False
    try:
        if dist.is_main:
            atomic_write_text(recipe_file, yaml.safe_dump(shareable_recipe_dict(recipe), sort_keys=False))
        dist.print(f"[draftsmith] recipe {recipe.name} ({recipe.family}), target {recipe.target.name_or_path}, "
                   f"stages {','.join(stages)}, out {out}, {dist.world_size} rank(s) on {dist.device.type}")
        run_stages(recipe, stages, out, dist)
        finished = True
    except (stage.StageMismatchError, CacheMismatchError, CacheCorruptedError, DamagedFileError, LinkedPathError,
            NotAnExportError) as exc:
        # a folder made with other settings, a damaged or malformed file, a link: the user's to mend, not a bug, so
        # its message alone (once, not a traceback from every rank)
        if dist.is_main:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        # a run that ended before any stage pinned or finished its folder did not start: the folder's recipe.yaml
        # stays the one its stages were made with (one that did leaves its own: its stages were made with it)
        if dist.is_main and not finished and stage_pins(out) == pins:
            if previous is None:
                recipe_file.unlink(missing_ok=True)
            else:
                atomic_write_bytes(recipe_file, previous)
        close_dist()
    return 0


def stage_pins(out: Path) -> list[bytes | None]:
    """Each stage folder's settings.json and DONE.json as they are: a stage that starts work pins the first, one
    that ends writes the second."""
    return [path.read_bytes() if path.is_file() else None
            for name in stage.STAGE_DIRS for path in (out / name / stage.SETTINGS_NAME, out / name / stage.DONE_NAME)]


def training_records(recipe, out: Path, tokenizer, target):
    """What train and opd read: the cache stage's cache, or the regenerated records with the target computing the
    hidden states per step (train.hidden_states online)."""
    from data.capture import open_cache
    from data.online import OnlineRecords
    from modeling.target import target_hidden_size

    if recipe.train.hidden_states == "online":
        return OnlineRecords(recipe, out / "regen", tokenizer, target)
    return open_cache(recipe, out / "cache", target_hidden_size(recipe.target.name_or_path), tokenizer)


def final_draft(recipe, out: Path) -> Path:
    """The draft eval and export read: on-policy distilled when the recipe has opd rounds."""
    return out / ("opd" if recipe.opd.rounds > 0 else "train") / "final"


def missing_inputs(recipe, stages: list[str], out: Path) -> list[str]:
    """--out itself, and each stage's input: another stage's finished output, or that stage among --stages (it used
    to fail with a traceback, 'No such file or directory: .../train/final/config.json')."""
    existing = next(folder for folder in (out, *out.parents) if folder.exists())  # what mkdir would meet
    if not existing.is_dir():
        return [f"--out {out}: {existing} is a file, not a folder: give a folder (it is created when missing)"]
    online = recipe.train.hidden_states == "online"
    opd = recipe.opd.rounds > 0
    # input: (its folder, whether it is there, the stage that makes it)
    inputs = {"regen": (out / "regen", stage.is_done(out / "regen"), "regenerate"),
              "cache": (out / "cache", online or stage.is_done(out / "cache"), "cache"),
              "train": (out / "train" / "final", stage.is_done(out / "train"), "train"),
              "final": (final_draft(recipe, out), stage.is_done(final_draft(recipe, out).parent), "opd" if opd
                        else "train")}
    needs = {"cache": ["regen"], "train": ["regen" if online else "cache"],
             "opd": ["regen" if online else "cache", "train"] if opd else [], "eval": ["final"], "export": ["final"]}
    problems = []
    for name in stages:
        for need in needs.get(name, []):
            folder, there, maker = inputs[need]
            if not there and maker not in stages[: stages.index(name)]:
                problems.append(f"--stages {name} reads {folder}, which no finished {maker} stage wrote: run "
                                f"{maker} first (e.g. --stages {maker},{name}), or point --out at the run that has it")
    return problems


def planted_links(stages: list[str], out: Path) -> list[str]:
    """Links in the folders this run writes (the stages' own, the run's recipe and lock): a stage would refuse them
    when it starts, after the stages before it ran; refused here, before anything, naming each."""
    if not out.is_dir():
        return []
    found = [link for name in stages for link in links_under(out / STAGE_DIRS[name])]
    found += [out / name for name in (RECIPE_NAME, LOCK_NAME) if (out / name).is_symlink()]
    return [link_problem(link) for link in found]


def regen_backend_for(recipe, stages: list[str], out: Path) -> str:
    """regen.backend auto, made concrete before anything pins it: the backend the folder's regeneration was started
    with (done or resumed: the same answers), else `choose_backend`'s (said once)."""
    started_with = stage.pinned(out / "regen").get("regen", {}).get("backend")
    if started_with:
        return started_with
    if "regenerate" not in stages:
        return "hf"  # nothing regenerates in this run; a later run with the stage chooses again
    from data.regen_backends import choose_backend

    backend, why = choose_backend(recipe.regen)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[draftsmith] regen.backend auto: {why}", flush=True)
    return backend


def check_inputs(recipe, stages: list[str], out: Path, world_size: int) -> list[str]:
    """What the recipe schema cannot see and a stage would find only hours later (an eval set named wrong is found
    after training): checked before anything is written or loaded. Returns the problems, each naming its key."""
    import torch

    from modeling.target import target_path_problem, target_shape

    problems = missing_inputs(recipe, stages, out)

    def source(key: str, name: str, path: str | None) -> None:
        problem = source_problem(name, path)
        if problem:
            problems.append(f"{key}: {problem}")

    if "regenerate" in stages and not stage.is_done(out / "regen"):  # done: its prompt files are no longer read
        for i, src in enumerate(recipe.data.sources):
            source(f"data.sources[{i}]", src.name, src.path)
    if "eval" in stages:
        source("eval.dataset", recipe.eval.dataset, None)
        problems += eval_overlap_problem(recipe)
    engine = recipe.regen.backend if recipe.regen.backend in ENGINES else None  # a server the stage starts
    if "regenerate" in stages and engine and not stage.is_done(out / "regen"):
        setting = "regen.engine_python" + (" (or $DRAFTSMITH_VLLM_PYTHON)" if engine == "vllm" else "")
        problem = engine_python_problem(engine, recipe.regen.engine_python, f"{setting} to a python with {engine}")
        if problem:
            problems.append(f"regen.backend {engine}: {problem}")
        if engine == "sglang" and not torch.cuda.is_available():
            problems.append("regen.backend sglang: no CUDA device here, and SGLang serves on GPUs (its CPU engine "
                            "needs a CPU build of sgl_kernel that no wheel ships); on a CPU machine --set "
                            "regen.backend=vllm (a vLLM server per rank) or regen.backend=hf (in-process)")
    missing_target = target_path_problem(recipe.target.name_or_path)
    if missing_target:
        return problems + [f"target.name_or_path: {missing_target}"]  # nothing below can read its config
    shape = target_shape(recipe.target.name_or_path) if {"regenerate", "cache", "train", "export"} & set(stages) \
        else None
    layers, vocab = (shape or {}).get("num_layers"), (shape or {}).get("vocab_size")
    if "train" in stages and (shape or {}).get("hidden_size"):
        problems += block_memory_problem(recipe, shape["hidden_size"])
    if (shape or {}).get("hidden_size"):
        problems += cache_disk_problem(recipe, stages, out, shape["hidden_size"])
    bad = [i for i in recipe.target.layer_ids if layers is not None and i >= layers]
    if bad:
        problems.append(f"target.layer_ids {recipe.target.layer_ids}: {bad} out of range for "
                        f"{recipe.target.name_or_path} with {layers} decoder layers (valid ids 0..{layers - 1})")
    mask = recipe.draft.mask_token_id
    if vocab is not None and mask is not None and recipe.family != "eagle3" and not 0 <= mask < vocab:
        problems.append(f"draft.mask_token_id {mask} is outside the target vocabulary (ids 0..{vocab - 1}); "
                        f"null picks the family default")
    if "export" in stages:
        problems += export_problem(recipe, (shape or {}).get("architecture"))
    per_step = recipe.train.micro_batch_size * world_size
    if "train" in stages and recipe.train.global_batch_size % per_step:
        problems.append(f"train.global_batch_size={recipe.train.global_batch_size} must be a multiple of "
                        f"train.micro_batch_size × ranks = {recipe.train.micro_batch_size} × {world_size}")
    return problems


def eval_overlap_problem(recipe) -> list[str]:
    """An eval set holding training prompts measures memory, not drafting: refused unless the recipe asks for it
    (eval.allow_training_prompts). Decided from the sources' names, without reading them."""
    if recipe.eval.allow_training_prompts or source_problem(recipe.eval.dataset):
        return []
    why = training_overlap(recipe.eval.dataset, recipe.data.sources, recipe.data.holdout_fraction)
    if why is None:
        return []
    return [f"eval.dataset {recipe.eval.dataset}: its prompts would be training prompts: {why}; or set "
            f"eval.allow_training_prompts=true to measure how the drafter fits the prompts it trained on"]


def export_problem(recipe, architecture: str | None) -> list[str]:
    """The export stage writes an SGLang checkpoint: a target SGLang cannot serve this family's draft beside
    (export/serving.py unserved_target) is refused before the training that comes first, not after it."""
    from export.serving import serves_as_dflash, unserved_target

    d = recipe.draft
    layout = {"sample_from_anchor": d.sample_from_anchor, "markov_rank": d.markov_rank,
              "enable_confidence_head": d.enable_confidence_head}
    algorithm = "eagle3" if recipe.family == "eagle3" else "dflash" if serves_as_dflash(layout) else "dspark"
    why = unserved_target("sglang", algorithm, architecture)
    return [f"--stages export: {why}. The export stage writes SGLang's checkpoint: leave it out of --stages (and "
            f"export with export/main.py where an engine serves it)"] if why else []


def block_memory_problem(recipe, hidden_size: int) -> list[str]:
    """A block drafter's micro-batch holds micro_batch_size x num_anchors x block-length draft tokens; each draft layer
    keeps at least one fp32 hidden state per token for the backward and, on CPU, SDPA's copy of the block attention
    mask (a bool [tokens, context + tokens] of each sequence, copied per layer in the compute dtype, bf16 at least;
    the GPU's flex attention builds none). Refuse, before regeneration, a block size whose lower bound alone exceeds
    this machine's memory (it used to run out of memory after regenerate and cache, at step 1)."""
    import torch

    from modeling.dspark import block_length

    if recipe.family == "eagle3":
        return []
    draft, sequences = recipe.draft, recipe.train.micro_batch_size
    block_len = block_length(draft.block_size, draft.sample_from_anchor)
    per_sequence = draft.num_anchors * block_len
    tokens = sequences * per_sequence
    activations = tokens * hidden_size * 4 * draft.num_layers
    mask = 0 if torch.cuda.is_available() else sequences * per_sequence**2 * (1 + 2 * draft.num_layers)
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if activations + mask <= have:
        return []
    return [f"draft.block_size {draft.block_size}: train.micro_batch_size {sequences} x draft.num_anchors "
            f"{draft.num_anchors} x the block's {block_len} slots puts {tokens:,} draft tokens "
            f"in one micro-batch: at least {activations / 2**30:,.1f} GiB of activations ({draft.num_layers} layer(s) "
            f"x width {hidden_size} x 4 bytes a token) and {mask / 2**30:,.1f} GiB of block attention mask (tokens x "
            f"tokens, each layer's copy), more than this machine's {have / 2**30:,.1f} GiB: block drafters use 7-16"]


def cache_disk_problem(recipe, stages: list[str], out: Path, hidden_size: int) -> list[str]:
    """A cache that may not fit, refused before regeneration (which takes 5-12 hours on the Qwen3 recipes) rather than
    by the cache stage after it: the most it can take (`most_cache_bytes`) against the free space under --out. Once
    regeneration is done the cache stage checks the real token count itself."""
    from data.capture import ONLINE_ADVICE, most_cache_bytes

    if "cache" not in stages or recipe.train.hidden_states == "online" or stage.is_done(out / "regen") \
            or stage.is_done(out / "cache"):
        return []
    need, per_token = most_cache_bytes(recipe, hidden_size)
    try:
        require_free_space(out / "cache", need, f"the hidden-state cache (at most data.num_prompts "
                           f"{recipe.data.num_prompts:,} x data.max_length {recipe.data.max_length:,} tokens x "
                           f"{per_token:,} B a token)", advice=f"{ONLINE_ADVICE}; or regenerate first (--stages "
                           f"regenerate), after which the cache stage checks the real token count")
    except OSError as exc:
        return [f"train.hidden_states cache: {exc}"]
    return []


def run_stages(recipe, stages: list[str], out: Path, dist) -> None:
    from data.capture import run_cache
    from data.regenerate import run_regenerate
    from eval.run import print_summary, run_eval_stage
    from export.convert import run_export_stage
    from export.serving import SPS_FILENAME, STS_FILENAME
    from modeling.target import load_target, load_tokenizer
    from train.opd import run_opd
    from train.trainer import TrainJob, run_train

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
            run_regenerate(recipe, out / "regen", dist, target, tokenizer)
        elif name == "cache":
            if recipe.train.hidden_states == "online":
                dist.print("[cache] skipped: train.hidden_states is online (the train stage runs the target itself)")
                continue
            run_cache(recipe, out / "regen", out / "cache", dist, target, tokenizer)
        elif name == "train":
            run_train(TrainJob(recipe, training_records(recipe, out, tokenizer, target), out / "train", dist, target))
        elif name == "opd":
            if recipe.opd.rounds == 0:
                dist.print("[opd] skipped: opd.rounds is 0 (on-policy distillation is opt-in)")
                continue
            run_opd(recipe, training_records(recipe, out, tokenizer, target), out / "train" / "final", out / "opd",
                    dist, target, tokenizer.eos_token_id)
        elif name == "eval":
            if dist.is_main:  # batch size 1, on rank 0, with the target the run already holds
                with dist.every_core():  # the other ranks wait meanwhile
                    eval_report = run_eval_stage(recipe, final_draft(recipe, out), out / "eval", target())
                print_summary(eval_report)
            dist.wait()
        elif name == "export":
            if dist.is_main:
                if stage.is_done(out / "eval"):
                    stage.verify_outputs(out / "eval")  # an sts.json edited since the eval wrote it is not shipped
                sts, sps = out / "eval" / STS_FILENAME, out / "eval" / SPS_FILENAME
                done = run_export_stage(final_draft(recipe, out), out / "export", recipe.target.name_or_path,
                                        sts if sts.is_file() else None, sps if sps.is_file() else None)
                print(f"[export] SGLang checkpoint: {done['path']}\n[export] serve it (GPU) with: {done['command']}",
                      flush=True)
            dist.wait()
        dist.print(f"[{name}] stage time {time.perf_counter() - start:.1f} s")
    if eval_report is not None:  # rank 0, eval among the stages
        ngram = eval_report.get("ngram_baseline")
        versus = (f"; n-gram drafter {ngram['accept_len']:.3f} on the same prompts, {eval_report['tau_vs_ngram']:.2f}x"
                  if ngram else "")
        mapped = eval_report.get("token_map")
        served = (f" as served, over the whole vocabulary ({mapped['accept_len']:.3f} with its "
                  f"{mapped['draft_vocab_size']}-token map, which no engine reads)" if mapped else "")
        print(f"[draftsmith] done: accept length tau = {eval_report['accept_len']:.3f}{served} on "
              f"{recipe.eval.dataset}{versus} ({out / 'eval' / 'report.json'})", flush=True)
