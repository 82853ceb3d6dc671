"""The driver: run a recipe's stages in order. Users type `train/main.py`, which calls `main` here.

    torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m --stages regenerate,cache --set data.num_prompts=64
    python train/main.py --list-recipes
    python train/main.py --target PATH_OR_ID --prompts FILE --family dspark   # your own target, no recipe

Stages (STAGE_TABLE: each row's folder, outputs, job object and runner): regenerate (the target answers the prompts)
-> cache (target hidden states; skipped when train.hidden_states is online) -> train -> opd (on-policy distillation;
when opd.rounds > 0) -> eval -> export (an SGLang checkpoint in runs/<recipe>/export/sglang, with the eval's STS
calibration beside a DSpark draft). `draftsmith train` runs the same main.
Each stage writes into --out (default runs/<recipe>) and is skipped when its output is already complete
(core/stage.py), so rerunning the same command after a crash resumes where it stopped.

This file sits on top of the import graph: core/ and modeling/ at the bottom, then data/, train/, export/, eval/
(tests/test_layout.py checks it); only the driver sees every stage.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from core import stage
from core.io import (DamagedFileError, LinkedPathError, LockedError, atomic_write_bytes, atomic_write_text, link_problem,
                     links_under, lock_for_process, own_root, remove_own_temps, require_free_space)
from core.malloc import keep_freed_memory
from core.recipe import (FAMILIES, RecipeError, compose_recipe, list_recipes, load_recipe, overridden,
                         shareable_recipe_dict)
from core.server import ENGINES, engine_python_problem
from data.sources.registry import source_problem

# The stages' modules (torch, transformers: ~12 s to import on a small machine) are imported where they are first
# needed, so that --help, --list-recipes and a bad recipe, stage or input answer within a second.

LOCK_NAME, RECIPE_NAME = stage.RUN_LOCK_NAME, stage.RUN_RECIPE_NAME  # the run's lock; the recipe it last started with


def parse_args(argv=None, prog="train/main.py") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a speculative-decoding drafter: regenerate -> cache -> train -> opd -> eval -> export.",
        epilog="Example: torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m "
               "--stages regenerate,cache --set data.num_prompts=64",
    )
    parser.add_argument("--recipe", help="recipe name (see --list-recipes) or path to a recipe .yaml")
    parser.add_argument("--target", help="without --recipe: your own target (Hugging Face id or model folder); the "
                        "target-specific keys are picked from its config and tokenizer, each printed with its reason")
    parser.add_argument("--prompts", help="with --target: the training prompts (.jsonl/.json rows; .txt: one a line)")
    parser.add_argument("--family", choices=FAMILIES, help="with --target: the drafter family (default dspark)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated stages to run, in order, from {','.join(STAGES)} (default: all)")
    parser.add_argument("--out", help="output folder for every stage (default: runs/<recipe>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set data.num_prompts=64 (repeatable; values are YAML; "
                             "`draftsmith recipes --keys` lists every key with its type, default and bound)")
    parser.add_argument("--list-recipes", action="store_true", help="print every recipe name, one a line, and exit")
    args = parser.parse_args(argv)
    if not args.list_recipes and not args.recipe and not args.target:
        parser.error("--recipe or --target is required (see --list-recipes)")
    if args.recipe and (args.target or args.prompts or args.family):  # the recipe's would silently win
        parser.error("--target, --prompts and --family pick a generic recipe (a recipe names its family); with "
                     "--recipe use --set target.name_or_path=... and --set \"data.sources=[{name: FILE}]\"")
    args.family = args.family or "dspark"  # no default above: a --family given is told from one left out
    return args


def own_recipe(args):
    """The generic recipe for --target (recipes/base/own.yaml and the family's base): the target-specific keys picked
    from the target (modeling/target_picks.py), one printed line each, the --set overrides winning over them; None
    after printing why when something cannot be picked."""
    import torch

    from modeling.target import target_path_problem
    from modeling.target_picks import pick_for_target

    problem = target_path_problem(args.target)
    if problem:
        print(f"error: --target: {problem}", file=sys.stderr)
        return None
    picks = pick_for_target(args.target, args.family, args.overrides, torch.cuda.is_available())
    fields = {**picks.fields, "family": args.family}
    fields.setdefault("target", {})["name_or_path"] = args.target
    if args.prompts:
        fields["data"] = {"sources": [{"name": args.prompts}]}
    elif not overridden(args.overrides, "data.sources"):
        picks.refusals.append("no training prompts: --prompts FILE (.jsonl/.json rows, or .txt: one a line), or "
                              "--set \"data.sources=[{name: ...}]\"")
    if picks.refusals:
        print(f"error: cannot pick a recipe for --target {args.target}:\n  " + "\n  ".join(picks.refusals),
              file=sys.stderr)
        return None
    slug = re.sub(r"[^a-z0-9._-]+", "-", Path(args.target.rstrip("/")).name.lower()).strip(".-") or "target"
    recipe = compose_recipe([args.family, "own"], fields, args.overrides, f"{args.family}_{slug}")
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(f"[pick] {line}" for line in picks.lines), flush=True)
    return recipe


def main(argv=None, prog="train/main.py") -> int:
    args = parse_args(argv, prog)
    if args.list_recipes:
        print("\n".join(list_recipes()))
        return 0
    try:
        recipe = load_recipe(args.recipe, args.overrides) if args.recipe else own_recipe(args)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if recipe is None:
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
    from data.states.cache import CacheCorruptedError, CacheMismatchError
    from data.regen.regenerate import SourcesError
    from data.states.engine import EngineStatesError
    from eval.run import TrainedPromptsError
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
            NotAnExportError, EngineStatesError, TrainedPromptsError, SourcesError) as exc:
        # a folder made with other settings, a damaged or malformed file, a link, an engine's bad answer, an eval
        # set of training prompts, too few prompts or none: the user's to mend, not a bug, so its message alone (once,
        # not a traceback from every rank)
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


def training_records(recipe, out: Path, tokenizer, target, dist=None):
    """What train and opd read: the cache stage's cache, or the regenerated records with the target computing the
    hidden states per step (train.hidden_states online)."""
    from data.states.capture import open_cache
    from data.states.online import OnlineRecords
    from modeling.target import target_hidden_size

    if recipe.train.hidden_states == "online":
        return OnlineRecords(recipe, out / "regen", tokenizer, target, dist, out / "train")
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
    online, opd = recipe.train.hidden_states == "online", recipe.opd.rounds > 0
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
    from data.regen.backends import choose_backend

    backend, why = choose_backend(recipe.regen)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[draftsmith] regen.backend auto: {why}", flush=True)
    return backend


def check_inputs(recipe, stages: list[str], out: Path, world_size: int) -> list[str]:
    """What the recipe schema cannot see and a stage would find only hours later (an eval set named wrong is found
    after training): checked before anything is written or loaded. Returns the problems, each naming its key."""
    import torch

    from modeling.target import chat_template_problem, target_path_problem, target_shape
    from train.checkpoint import rank_count_problem

    problems = missing_inputs(recipe, stages, out)

    def source(key: str, name: str, path: str | None) -> None:
        problem = source_problem(name, path)
        if problem:
            problems.append(f"{key}: {problem}")

    if "regenerate" in stages and not stage.is_done(out / "regen"):  # done: its prompt files are no longer read
        for i, src in enumerate(recipe.data.sources):
            source(f"data.sources[{i}]", src.name, src.path)
    if "eval" in stages and not source_problem(recipe.eval.dataset):
        from eval.run import eval_set_problem

        problems += eval_set_problem(recipe, sources_read=not stage.is_done(out / "regen"))
    elif "eval" in stages:
        source("eval.dataset", recipe.eval.dataset, None)
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
    if recipe.target.chat_template is not None and (why := chat_template_problem(recipe.target.chat_template)):
        problems.append(f"target.chat_template: {why}, or null for the tokenizer's own")
    if "cache" in stages and recipe.cache.backend == "engine" and not recipe.cache.server_urls \
            and not stage.is_done(out / "cache"):
        problem = engine_python_problem("vllm", recipe.regen.engine_python,
                                        "regen.engine_python (or $DRAFTSMITH_VLLM_PYTHON) to a python with vllm")
        if problem:
            problems.append(f"cache.backend engine (a vLLM server the cache stage starts): {problem}")
    missing_target = target_path_problem(recipe.target.name_or_path)
    if missing_target:
        return problems + [f"target.name_or_path: {missing_target}"]  # nothing below can read its config
    shape = target_shape(recipe.target.name_or_path) if {"regenerate", "cache", "train", "export"} & set(stages) \
        else None
    layers, vocab = (shape or {}).get("num_layers"), (shape or {}).get("vocab_size")
    if "train" in stages and (shape or {}).get("hidden_size"):
        problems += block_memory_problem(recipe, shape["hidden_size"], vocab or 0)
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
    runs = [("train", out / "train")] + [("opd", run) for run in sorted((out / "opd").glob("round-*"))]
    problems += [f"--stages {name}: {why}" for name, run in runs if recipe.train.zero_stage and name in stages
                 and not stage.is_done(run) and (why := rank_count_problem(run / "checkpoints", world_size))]
    if problems:
        return problems
    from eval.preflight import preflight_problems  # only now (~3 s of imports): last, it runs the target
    return preflight_problems(recipe, stages, out)


def export_problem(recipe, architecture: str | None) -> list[str]:
    """The export stage writes an SGLang checkpoint: a target SGLang cannot serve this family's draft beside
    (export/serving.py unserved_target) is refused before the training that comes first, not after it."""
    from export.serving import detect_algorithm, unserved_target

    d = recipe.draft
    layout = {"architectures": ["LlamaForCausalLMEagle3" if recipe.family == "eagle3" else "Qwen3DSparkModel"],
              "sample_from_anchor": d.sample_from_anchor, "markov_rank": d.markov_rank,
              "enable_confidence_head": d.enable_confidence_head, "selector_rank": d.selector_rank}
    algorithm = detect_algorithm(layout)
    why = unserved_target("sglang", algorithm, architecture)
    return [f"--stages export: {why}. The export stage writes SGLang's checkpoint: leave it out of --stages (and "
            f"export with export/main.py where an engine serves it)"] if why else []


def block_memory_problem(recipe, hidden_size: int, vocab: int) -> list[str]:
    """A block drafter's micro-batch holds micro_batch_size x num_anchors x block-length draft tokens; each draft layer
    keeps at least one fp32 hidden state per token for the backward and, on CPU, SDPA's copy of the block attention
    mask (a bool [tokens, context + tokens] of each sequence, copied per layer in the compute dtype, bf16 at least;
    the GPU's flex attention builds none); DFlash2's selector tables (2 x vocab x selector_rank fp32 parameters) keep
    a gradient and Adam's two moments. Refuse, before regeneration, sizes whose lower bound alone exceeds this
    machine's memory (it used to run out of memory after regenerate and cache, at step 1)."""
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
    tables = 2 * vocab * draft.selector_rank * 16 if recipe.family == "dflash2" else 0
    if tables > have:
        return [f"draft.selector_rank {draft.selector_rank}: DFlash2's tables hold 2 x {vocab:,} tokens x the rank "
                f"parameters, {tables / 2**30:,.1f} GiB with their gradients and Adam's state (16 bytes each), more "
                f"than this machine's {have / 2**30:,.1f} GiB: the [dflash2] base sets 256"]
    if activations + mask + tables <= have:
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
    from data.states.capture import ONLINE_ADVICE, most_cache_bytes

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


# --- the stage table ------------------------------------------------------------------------------------------------
# One row a stage, in pipeline order: its folder under --out, what it leaves there for the stages after it, why a
# recipe skips it (None: it runs), the builder of its job object (from the recipe and what the run shares) and its
# runner. `--stages` picks rows; run_stages walks them. The builders and runners import their stage's modules when
# called (torch and the models: ~12 s), so that --help and a refused recipe answer at once.


@dataclass
class RunState:
    """What the stages of one run share: the recipe, --out, the ranks, the target's tokenizer, the target (loaded
    on first need, once), what a stage that does not run the target reads of it (`get_target_parts`: the drafter's
    embedding, final norm and lm_head; whole where train computes online states with it) and the eval's report."""

    recipe: object
    out: Path
    dist: object
    tokenizer: object
    get_target: Callable
    get_target_parts: Callable
    eval_report: dict | None = None


@dataclass(frozen=True)
class EvalStageJob:
    """The eval stage's job: the draft it measures and the folder it writes (eval/run.py's run_eval_stage takes the
    recipe and the run's target beside them)."""

    draft_dir: Path
    eval_dir: Path


@dataclass(frozen=True)
class Stage:
    name: str
    folder: str
    outputs: str
    skip: Callable[[object], str | None]
    job: Callable[[RunState], object]
    run: Callable[[object, RunState], None]


def _never(recipe) -> None:
    return None


def _regenerate_job(run: RunState):
    from data.regen.regenerate import RegenJob

    return RegenJob(run.recipe, run.out / "regen", run.dist, run.get_target, run.tokenizer)


def _run_regenerate(job, run: RunState) -> None:
    from data.regen.regenerate import run_regenerate

    run_regenerate(job)


def _cache_skip(recipe) -> str | None:
    return ("train.hidden_states is online (the train stage runs the target itself)"
            if recipe.train.hidden_states == "online" else None)


def _cache_job(run: RunState):
    from data.states.capture import CacheJob

    target = run.get_target if run.recipe.cache.backend == "hf" else run.get_target_parts  # hf: it runs the target
    return CacheJob(run.recipe, run.out / "regen", run.out / "cache", run.dist, target, run.tokenizer)


def _run_cache(job, run: RunState) -> None:
    from data.states.capture import run_cache

    run_cache(job)


def _train_job(run: RunState):
    from train.trainer import TrainJob

    records = training_records(run.recipe, run.out, run.tokenizer, run.get_target_parts, run.dist)
    return TrainJob(run.recipe, records, run.out / "train", run.dist, run.get_target_parts)


def _closing(records):
    """Online hidden states from an engine hold its server: stopped however the stage ends."""
    return contextlib.closing(records) if hasattr(records, "close") else contextlib.nullcontext()


def _run_train(job, run: RunState) -> None:
    from train.trainer import run_train

    with _closing(job.cache):
        run_train(job)


def _opd_skip(recipe) -> str | None:
    return "opd.rounds is 0 (on-policy distillation is opt-in)" if recipe.opd.rounds == 0 else None


def _opd_job(run: RunState):
    from train.opd import OpdJob

    # its rollouts replay the records' answers (no target step): it reads what train reads of the target
    records = training_records(run.recipe, run.out, run.tokenizer, run.get_target_parts, run.dist)
    return OpdJob(run.recipe, records, run.out / "train" / "final", run.out / "opd", run.dist, run.get_target_parts,
                  run.tokenizer.eos_token_id)


def _run_opd(job, run: RunState) -> None:
    from train.opd import run_opd

    with _closing(job.records):
        run_opd(job)


def _eval_job(run: RunState) -> EvalStageJob:
    return EvalStageJob(final_draft(run.recipe, run.out), run.out / "eval")


def _run_eval(job: EvalStageJob, run: RunState) -> None:
    from eval.report import print_summary
    from eval.run import run_eval_stage

    if run.dist.is_main:  # batch size 1, on rank 0, with the target the run already holds
        with run.dist.every_core():  # the other ranks wait meanwhile
            run.eval_report = run_eval_stage(run.recipe, job.draft_dir, job.eval_dir, run.get_target())
        print_summary(run.eval_report)
    run.dist.wait()


def _export_job(run: RunState):
    from export.convert import ExportJob
    from export.serving import SPS_FILENAME, STS_FILENAME

    sts, sps = run.out / "eval" / STS_FILENAME, run.out / "eval" / SPS_FILENAME
    return ExportJob(final_draft(run.recipe, run.out), "sglang", run.out / "export" / "sglang",
                     sts_path=sts if sts.is_file() else None, sps_path=sps if sps.is_file() else None,
                     verifier=run.recipe.target.name_or_path)


def _run_export(job, run: RunState) -> None:
    from export.convert import run_export_stage

    if run.dist.is_main:
        if stage.is_done(run.out / "eval"):
            stage.verify_outputs(run.out / "eval")  # an sts.json edited since the eval wrote it is not shipped
        done = run_export_stage(job)
        print(f"[export] SGLang checkpoint: {done['path']}\n[export] serve it (GPU) with: {done['command']}",
              flush=True)
    run.dist.wait()


STAGE_TABLE = (
    Stage("regenerate", "regen", "records.jsonl (the target's answers), DONE.json (their sha256)",
          _never, _regenerate_job, _run_regenerate),
    Stage("cache", "cache", "shard-*.bin, index.bin, manifest.json (the target's hidden states)",
          _cache_skip, _cache_job, _run_cache),
    Stage("train", "train", "final/ (the draft, checksums.json), checkpoints/, metrics.jsonl",
          _never, _train_job, _run_train),
    Stage("opd", "opd", "final/ (the on-policy distilled draft)", _opd_skip, _opd_job, _run_opd),
    Stage("eval", "eval", "report.json, report.md, sts.json, sps_table.json", _never, _eval_job, _run_eval),
    Stage("export", "export", "sglang/ (the serving checkpoint)", _never, _export_job, _run_export),
)
STAGES = tuple(row.name for row in STAGE_TABLE)
STAGE_DIRS = {row.name: row.folder for row in STAGE_TABLE}  # each stage's folder under --out


def run_stages(recipe, stages: list[str], out: Path, dist) -> None:
    from modeling.target import cut_to_parts, load_target, load_target_parts, load_tokenizer

    model = None

    def target():
        nonlocal model
        if model is None or getattr(model, "draftsmith_fingerprint", None):  # the whole target, over its parts
            model = load_target(recipe.target.name_or_path, dist.device, recipe.target.dtype)
        return model

    def target_parts():
        """What the drafter reads of the target (embedding, final norm, lm_head, the layers draft.init_layers copies),
        for the stages that do not run it; a whole target an earlier stage loaded is cut down to them."""
        nonlocal model
        if recipe.train.hidden_states == "online" and recipe.cache.backend == "hf":
            return target()  # train and opd compute the hidden states with it
        copied = recipe.draft.num_layers if recipe.draft.init_layers == "target" else 0
        if model is None:
            model = load_target_parts(recipe.target.name_or_path, dist.device, recipe.target.dtype, last_layers=copied)
        elif not getattr(model, "draftsmith_fingerprint", None):
            model = cut_to_parts(model, last_layers=copied)
        return model

    tokenizer = load_tokenizer(recipe.target.name_or_path, recipe.target.chat_template)
    run = RunState(recipe, out, dist, tokenizer, target, target_parts)
    for row in (row for row in STAGE_TABLE if row.name in stages):
        start = time.perf_counter()
        why = row.skip(recipe)
        if why is not None:
            dist.print(f"[{row.name}] skipped: {why}")
            continue
        row.run(row.job(run), run)
        dist.print(f"[{row.name}] stage time {time.perf_counter() - start:.1f} s")
    if run.eval_report is not None:  # rank 0, eval among the stages
        report = run.eval_report
        ngram = report.get("ngram_baseline")
        versus = (f"; n-gram drafter {ngram['accept_len']:.3f} on the same prompts, {report['tau_vs_ngram']:.2f}x"
                  if ngram else "")
        mapped = report.get("token_map")
        served = (f" as served, over the whole vocabulary ({mapped['accept_len']:.3f} with its "
                  f"{mapped['draft_vocab_size']}-token map, which no engine reads)" if mapped else "")
        print(f"[draftsmith] done: accept length tau = {report['accept_len']:.3f}{served} on "
              f"{recipe.eval.dataset}{versus} ({out / 'eval' / 'report.json'})", flush=True)
