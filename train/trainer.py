"""The one Trainer: fits a DSpark, DFlash or Eagle3 drafter on the target's hidden states (from the cache stage, or
computed per step by the target itself: train.hidden_states online, data/states/online.py).

    torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m --stages train

What differs between families lives in train/algorithms.py (build the drafter, cut a batch, compute the loss);
this file is the loop: data order, gradient accumulation, optimizer, schedule, logging (checkpoints: train/checkpoint.py).

Exactness rules, so a run killed at any step and rerun continues with the very same losses (bit-exact on CPU):
  * the data order of step s is a function of (seed, s) only: a seeded permutation per epoch of the cache;
  * every random choice inside a batch (anchor positions) uses a generator seeded by (seed, step, sample index);
  * the loss of a step is normalised by the weight sum of the whole GLOBAL batch (all micro-batches, all ranks),
    so 1 rank × 8 sequences and 2 ranks × 4 sequences compute the same gradient;
  * checkpoints hold the full optimizer state (and the weight average, train.ema_decay) and are published by an
    atomically written `latest` pointer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from core import stage
from core.io import (CHECKSUMS_NAME, DamagedFileError, atomic_write_text, make_dir, open_append, publish_dir,
                     require_free_space, write_checksums)
from data.states.capture import TARGET_WEIGHTS_META
from modeling import cpu_linear
from modeling.draft_folder import WEIGHTS_NAME
from modeling.registry import TARGET_WEIGHTS_KEY, draft_digest, load_draft_model, read_config
from train.checkpoint import (AVERAGE_NAME, latest_checkpoint, load_checkpoint, prune_checkpoints, published_weights,
                              read_average, save_checkpoint)
from train.ema import WeightAverage
from train.algorithms import (add_feature_noise, attach_hidden, get_algorithm, input_scale, seeded_dropout,
                              set_dropout)
from core.dist import Dist, fault_point, init_process_group, process_group_backend
from core.recipe import Recipe, shareable_recipe_dict
from core.server import free_port


# --- data order ---------------------------------------------------------------------------------------------------


def step_indices(step: int, num_records: int, global_batch: int, seed: int) -> list[int]:
    """Record indices of the global batch of optimizer step `step` (epochs are seeded permutations)."""
    indices, perms = [], {}
    for position in range(step * global_batch, (step + 1) * global_batch):
        epoch, offset = divmod(position, num_records)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_records, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        indices.append(int(perms[epoch][offset]))
    return indices


def lr_at(step: int, recipe) -> float:
    """Linear warmup then cosine decay to zero, by optimizer step."""
    train = recipe.train
    warmup = max(1, int(train.warmup_ratio * train.max_steps))
    if step < warmup:
        return train.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, train.max_steps - warmup)
    return train.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# --- engine: plain DDP or DeepSpeed ZeRO ------------------------------------------------------------------------


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). Elsewhere torch emulates bf16 matmuls, tens of
    times slower than fp32 (measured: an AMD EPYC with AVX2 only ran a SmolLM2 DSpark step ~100x slower)."""
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check() for check in checks if check is not None)


def precision(recipe, dist: Dist) -> str:
    """train.precision, with auto = bf16 on GPU and on CPUs with bf16 matrix units, fp32 on other CPUs."""
    if recipe.train.precision != "auto":
        return recipe.train.precision
    return "bf16" if dist.device.type == "cuda" or cpu_has_bf16_matmul() else "fp32"


def bf16_weights(recipe, dist: Dist) -> bool:
    """DeepSpeed on GPU in bf16 keeps bf16 weights; every other bf16 run autocasts over fp32 weights."""
    return precision(recipe, dist) == "bf16" and dist.device.type == "cuda" and recipe.train.zero_stage > 0


def deepspeed_config(recipe, dist: Dist, grad_accum: int) -> dict:
    """The DeepSpeed config of a ZeRO run (train.zero_stage > 0)."""
    train = recipe.train
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": train.micro_batch_size * grad_accum * dist.world_size,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": bf16_weights(recipe, dist)},
        # The micro-batches' gradients are summed in fp32. Left out, DeepSpeed sums them in the weights' dtype: with
        # bf16 weights (a GPU run) each of dspark_qwen3_8b's 64 micro-batches adds ~1/64 of the sum to an 8-bit
        # mantissa and keeps 2-3 of its own bits (tests/test_gpu_numerics.py measures it). Costs 4 bytes a trainable
        # parameter per rank's partition (~0.56 GB a rank for the 8B draft on 8 ranks).
        "data_types": {"grad_accum_dtype": "fp32"},
        # torch_adam: DeepSpeed's fused CPU Adam would JIT-compile a C++ op first.
        "optimizer": {"type": "AdamW", "params": {"lr": train.lr, "weight_decay": train.weight_decay,
                                                  "betas": [train.adam_beta1, train.adam_beta2], "eps": train.adam_eps,
                                                  "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class Engine:
    """One interface over DDP and DeepSpeed: forward module, backward, optimizer step."""

    def __init__(self, module, recipe, dist: Dist, grad_accum: int):
        self.kind = "deepspeed" if recipe.train.zero_stage > 0 else "ddp"
        self.dist, self.recipe = dist, recipe
        self.params = [p for p in module.parameters() if p.requires_grad]
        train = recipe.train
        if self.kind == "deepspeed":
            import deepspeed

            config = deepspeed_config(recipe, dist, grad_accum)
            if not torch.distributed.is_initialized():
                # A plain `python train/main.py` run: DeepSpeed still wants a (one-process) torchrun-like setup.
                for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                                   ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
                    os.environ.setdefault(key, value)
                # Our group, not DeepSpeed's own NCCL-only one with its own timeout: CPU collectives need gloo too.
                init_process_group(dist.device)
            deepspeed.init_distributed(dist_backend=process_group_backend(dist.device))
            self.module, self.optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=self.params,
                                                                     config=config)
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=train.lr, weight_decay=train.weight_decay,
                                               betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                                               **({"fused": True} if train.fused_optimizer else {}))
            self.module = module
            if dist.world_size > 1:
                self.module = torch.nn.parallel.DistributedDataParallel(
                    module, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                    find_unused_parameters=module.has_idle_params())

    def sync_context(self, last_micro: bool):
        if self.kind == "ddp" and self.dist.world_size > 1 and not last_micro:
            return self.module.no_sync()
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.kind == "deepspeed":
            # The loss is already normalised over the global batch: no extra 1/grad_accum.
            self.module.backward(loss, scale_wrt_gas=False)
        else:
            loss.backward()

    def step(self, lr: float, last_micro: bool) -> float | None:
        """Called after every micro-batch; updates the weights after the last one. Returns the grad norm."""
        if self.kind == "deepspeed":
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.module.step()
            return float(self.module.get_global_grad_norm() or 0.0) if last_micro else None
        if not last_micro:
            return None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.recipe.train.max_grad_norm)
        if not torch.isfinite(norm):
            return float(norm)  # the caller stops the run before these gradients touch the weights
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


# --- logging ------------------------------------------------------------------------------------------------------


def wandb_run_id(recipe_name: str, out_dir: Path) -> str:
    """The same id in every process for one run folder (Python's hash() of a str is salted per process), so a
    resumed run continues its wandb run instead of starting a new one."""
    digest = hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:8]
    return f"{recipe_name}-{digest}"


def read_metrics_lines(path: Path) -> list[str]:
    """The rows of metrics.jsonl. A last line cut short (a kill or a full disk mid-append) is dropped: its step is
    recomputed after the checkpoint anyway. A broken line before the end is corruption, named with its line."""
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a {\"step\": N, ...} row")
        except ValueError as err:
            if number == len(lines):
                print(f"[train] {path}: dropping its cut-off last line {number} ({line[:60]!r})", flush=True)
                break
            raise DamagedFileError(f"{path}: line {number} is not a metrics row ({err}): the file is corrupt; delete "
                                   f"it (the run resumes from its checkpoint and logs the steps from there)") from None
        rows.append(line)
    return rows


class Logger:
    """metrics.jsonl (every step) + tensorboard + wandb (offline unless WANDB_MODE says otherwise), rank 0 only."""

    def __init__(self, out_dir: Path, recipe, dist: Dist, resume_step: int):
        self.enabled = dist.is_main
        self.path = out_dir / "metrics.jsonl"
        self.tb = self.wandb = None
        if not self.enabled:
            return
        # Drop steps after the checkpoint we resume from: they are about to be recomputed.
        if self.path.is_file():
            kept = [line for line in read_metrics_lines(self.path) if json.loads(line)["step"] <= resume_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(make_dir(out_dir / "tensorboard")))  # its event files get unique names
        if recipe.train.wandb_project:
            import wandb

            self.wandb = wandb.init(project=recipe.train.wandb_project, name=recipe.name, dir=str(out_dir),
                                    mode=os.environ.get("WANDB_MODE", "offline"), config=shareable_recipe_dict(recipe),
                                    resume="allow", id=wandb_run_id(recipe.name, out_dir))

    def log(self, step: int, metrics: dict, to_dashboards: bool) -> None:
        if not self.enabled:
            return
        with open_append(self.path) as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        if not to_dashboards:
            return
        flat = {}
        for key, value in metrics.items():
            if isinstance(value, list):
                flat.update({f"{key}/{i + 1}": v for i, v in enumerate(value)})
            else:
                flat[key] = value
        for key, value in flat.items():
            self.tb.add_scalar(f"train/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in flat.items()}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# --- the stage ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainJob:
    """What one train stage runs: the recipe, the records (an opened TargetCache, data/states/online.py's OnlineRecords or
    train/opd.py's RolloutRecords: one interface), the folder it writes, its ranks, the target (loaded on first call),
    and a draft folder to start from instead of the recipe's initialisation (`init_from`: opd's rounds)."""

    recipe: Recipe
    cache: object
    out_dir: Path
    dist: Dist
    get_target: Callable[[], torch.nn.Module]
    init_from: Path | None = None


def pinned_settings(job: TrainJob) -> dict:
    """What a train folder is pinned to (core/stage.py): a rerun with other settings is refused, not resumed."""
    recipe, train = job.recipe, job.recipe.train
    # what only logs or disk use depends on may change between runs of one folder; ema_decay 0 is left out as in
    # every folder made before the key existed, so those still match
    unpinned = ("log_every", "wandb_project", "keep_checkpoints") + (("ema_decay",) if train.ema_decay == 0 else ())
    return {"family": recipe.family, "seed": recipe.seed, "draft": vars(recipe.draft), "loss": vars(recipe.loss),
            "train": {k: v for k, v in vars(train).items() if k not in unpinned},
            "cache_index_sha256": job.cache.manifest.get("index_sha256"),
            **({"init_from_sha256": draft_digest(job.init_from)} if job.init_from else {})}


def grad_accum_steps(recipe, dist: Dist) -> int:
    """Micro-batches per rank in one optimizer step."""
    train, per_step = recipe.train, recipe.train.micro_batch_size * dist.world_size
    if train.global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size={train.global_batch_size} must be a multiple of "
                         f"train.micro_batch_size × ranks = {per_step}")
    return train.global_batch_size // per_step


def build_module(job: TrainJob, algo) -> torch.nn.Module:
    """The drafter plus what its loss needs (frozen target head, ...), on the job's device; its forward(batch, step)
    returns the loss sums, so DDP and DeepSpeed see one ordinary forward per micro-batch."""
    recipe, init_from = job.recipe, job.init_from
    torch.manual_seed(recipe.seed)
    module = algo.build(recipe, job.get_target(), job.cache)
    if init_from is not None:
        module.draft.load_state_dict(load_draft_model(init_from, job.get_target(), dtype=torch.float32).state_dict())
    # The draft names the weights its hidden states came from; eval refuses a target with others (same shape).
    trained_on = job.cache.manifest.get("meta", {}).get(TARGET_WEIGHTS_META) or (
        read_config(init_from).get(TARGET_WEIGHTS_KEY) if init_from is not None else None)
    if trained_on:
        setattr(module.draft.config, TARGET_WEIGHTS_KEY, trained_on)
    set_dropout(module, recipe.train.dropout)
    module = module.to(job.dist.device)
    cpu_linear.pack_linears(module, prepack=False)  # fp32 on a CPU: oneDNN products (modeling/cpu_linear.py)
    return module


def resume(engine, module, average: WeightAverage | None, ckpt_root: Path,
           dist: Dist) -> tuple[int, dict | None, dict]:
    """(step to start at, first and last step metrics) from the checkpoint `latest` names, its weight average loaded
    into `average`; (0, None, {}) without."""
    path = latest_checkpoint(ckpt_root)
    if path is None:
        return 0, None, {}
    state = load_checkpoint(engine, module, engine.optimizer, path)  # its checksums cover the average too
    if average is not None:
        average.load_state_dict(read_average(path), path / AVERAGE_NAME)
    dist.print(f"[train] resuming from {path} (step {state['step']})")
    # killed after the final save: the loop does not run, and these are the stage's stats
    return state["step"], state.get("first_metrics"), state.get("last_metrics") or {}


def numerics(recipe, dist: Dist) -> tuple[torch.dtype, object]:
    """(the dtype a batch's hidden states are fed in, the autocast context of every forward)."""
    # DeepSpeed's bf16 mode keeps bf16 weights (fp32 masters inside): feed it bf16. Everywhere else bf16 is autocast
    # over fp32 weights (DDP on GPU; CPUs with bf16 matrix units, where it is several times faster than fp32).
    if precision(recipe, dist) == "bf16" and dist.device.type == "cpu" and not cpu_has_bf16_matmul():
        dist.print("[train] warning: train.precision is bf16 but this CPU has no bf16 matrix units (AVX512-BF16/AMX): "
                   "torch emulates them, tens of times slower than fp32. Set train.precision=auto or fp32.")
    weights_bf16 = bf16_weights(recipe, dist)
    input_dtype = torch.bfloat16 if weights_bf16 else torch.float32
    autocast = (torch.autocast(dist.device.type, dtype=torch.bfloat16)
                if precision(recipe, dist) == "bf16" and not weights_bf16 else nullcontext())
    return input_dtype, autocast


def cut_batches(job: TrainJob, algo, step: int) -> tuple[list, list, list]:
    """This rank's micro-batches of step `step`'s global batch: (records, each sample's seed, hidden-less batches)."""
    recipe, dist, train = job.recipe, job.dist, job.recipe.train
    indices = step_indices(step, len(job.cache), train.global_batch_size, recipe.seed)
    positions = list(range(dist.rank, len(indices), dist.world_size))  # this rank's places in the global batch
    parts = [positions[i: i + train.micro_batch_size] for i in range(0, len(positions), train.micro_batch_size)]
    # Each record is read (and its crc checked) once per step; its hidden states stay memory-map views until
    # attach_hidden copies them for the micro-batch's forward.
    records = [[job.cache[indices[p]] for p in part] for part in parts]
    # a sample's seed: its anchors, and its feature noise (train.feature_noise)
    seeds = [[(recipe.seed, step, p) for p in part] for part in parts]
    micro = [algo.make_batch(recipe, recs, seeds=part_seeds, device=dist.device)
             for part_seeds, recs in zip(seeds, records)]
    return records, seeds, micro


def describe(job: TrainJob, module, engine: Engine, grad_accum: int) -> str:
    """The line a run starts with: what trains, on what, how."""
    recipe, dist, train = job.recipe, job.dist, job.recipe.train
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return (f"[train] {recipe.family}: {trainable / 1e6:.2f}M trainable parameters, {len(job.cache)} conversations "
            f"(hidden states: {train.hidden_states}), {train.max_steps} steps × {train.global_batch_size} sequences "
            f"({dist.world_size} rank(s) × {train.micro_batch_size} × {grad_accum} accumulation), "
            f"engine {engine.kind}{'' if engine.kind == 'ddp' else f' ZeRO-{train.zero_stage}'}")


def step_metrics(algo, totals: dict, micro: list[dict], dist: Dist, weight_total: float, *, optimizer: dict,
                 started: float, hidden_s: float) -> dict:
    """The step's metrics over every rank: the family's (loss, tau, ...), then the optimizer's (`optimizer`: lr and
    grad norm, the same on every rank) and speed."""
    metrics = algo.summarize(totals, dist, weight_total)
    tokens, = dist.sum(sum(int(b["attention_mask"].sum()) for b in micro))
    elapsed = dist.max(time.perf_counter() - started)
    metrics.update(optimizer)
    metrics.update(tokens_per_s=tokens / elapsed, step_s=elapsed, hidden_s=dist.max(hidden_s))
    return metrics


def run_train(job: TrainJob) -> dict:
    """The `train` stage: `job.recipe`'s drafter fitted on `job.cache` in `job.out_dir`, resumed from its latest
    checkpoint. Returns the stats written to DONE.json."""
    recipe, cache, dist, train = job.recipe, job.cache, job.dist, job.recipe.train
    done = stage.start(job.out_dir, pinned_settings(job), "train", dist.is_main)
    if done is not None:
        return done
    grad_accum = grad_accum_steps(recipe, dist)
    algo = get_algorithm(recipe.family)
    module = build_module(job, algo)
    engine = Engine(module, recipe, dist, grad_accum)
    # from the weights as the engine holds them (DeepSpeed bf16: cast); a resume overwrites it with the checkpoint's
    average = WeightAverage(module.draft, train.ema_decay) if train.ema_decay > 0 else None
    ckpt_root = job.out_dir / "checkpoints"
    start_step, first, last = resume(engine, module, average, ckpt_root, dist)
    dist.print(describe(job, module, engine, grad_accum))
    logger = Logger(job.out_dir, recipe, dist, start_step)
    input_dtype, autocast = numerics(recipe, dist)
    noise_std = train.feature_noise * input_scale(cache, max_records=64) if train.feature_noise > 0 else None
    bar = tqdm(total=train.max_steps, initial=start_step, desc="train", unit="step", disable=not dist.is_main)
    states_where = ("the target's states computed per step (train.hidden_states online: its dtype, its weights)"
                    if train.hidden_states == "online" else "the cache (cache/, its hidden states)")
    for step in range(start_step, train.max_steps):
        t0 = time.perf_counter()
        # --- cut this rank's micro-batches of the global batch, and the global loss denominator
        records, seeds, micro = cut_batches(job, algo, step)
        weight_total, = dist.sum(sum(b["weight_sum"] for b in micro))
        if weight_total <= 0:
            raise RuntimeError(f"step {step}: no supervised prediction in the global batch; check the records' loss "
                               f"masks ({states_where})")
        # --- forward/backward every micro-batch, then one optimizer step
        totals, grad_norm, lr = {}, None, lr_at(step, recipe)
        hidden_s = 0.0  # reading (cache) or computing (online) the hidden states
        for i, (recs, batch) in enumerate(zip(records, micro)):
            last_micro = i == len(micro) - 1
            t_hidden = time.perf_counter()
            batch = attach_hidden(batch, cache.with_hidden(recs), dist.device, input_dtype)
            if noise_std is not None:
                batch = add_feature_noise(batch, noise_std, seeds[i])
            hidden_s += time.perf_counter() - t_hidden
            with engine.sync_context(last_micro), autocast, \
                    seeded_dropout(train.dropout, (recipe.seed, step, dist.rank, i), dist.device):
                out = engine.module(batch, step)  # the step: step-dependent losses (loss.ce_warmup_steps)
                # DDP and DeepSpeed average gradients over ranks: × world size undoes that.
                loss = out.loss_sum / weight_total * dist.world_size
            # Collective check, so every rank stops together instead of one waiting in an all-reduce.
            if dist.max(0.0 if torch.isfinite(loss.detach()) else 1.0) > 0:
                raise FloatingPointError(
                    f"non-finite loss at step {step} (micro-batch {i}): stopping; the last good checkpoint is "
                    f"{latest_checkpoint(ckpt_root) or 'none yet'}. Lower train.lr or check {states_where}.")
            with engine.sync_context(last_micro):
                engine.backward(loss)
            norm = engine.step(lr, last_micro)
            grad_norm = norm if norm is not None else grad_norm
            algo.accumulate(totals, out)
        if not math.isfinite(grad_norm if grad_norm is not None else 0.0):
            raise FloatingPointError(f"non-finite gradient norm at step {step}: stopping; the last good checkpoint "
                                     f"is {latest_checkpoint(ckpt_root) or 'none yet'}")
        if average is not None:
            average.update(step)
        # --- metrics (global), log, checkpoint
        metrics = step_metrics(algo, totals, micro, dist, weight_total, optimizer={"lr": lr, "grad_norm": grad_norm},
                               started=t0, hidden_s=hidden_s)
        first, last = first or metrics, metrics
        logger.log(step + 1, metrics, to_dashboards=(step + 1) % train.log_every == 0 or step == 0)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics.get('tau', 0):.2f}",
                        tok_s=f"{metrics['tokens_per_s']:.0f}")
        if (step + 1) % train.save_every == 0 or step + 1 == train.max_steps:
            save_checkpoint(engine, module, engine.optimizer, step + 1, ckpt_root, dist,
                            {"first_metrics": first, "last_metrics": last},
                            average.state_dict() if average is not None and dist.is_main else None)
            if dist.is_main:
                prune_checkpoints(ckpt_root, train.keep_checkpoints)
        fault_point("train", step + 1)
    bar.close()
    logger.close()
    return finish(job, ckpt_root, first, last)


def finish(job: TrainJob, ckpt_root: Path, first: dict | None, last: dict) -> dict:
    """Copy the last checkpoint's draft folder to out/train/final, with train.ema_decay > 0 its trainable weights
    replaced by the checkpoint's average (the last step's own weights stay in checkpoints/step-<max_steps>/draft,
    which pruning keeps), and mark the stage done; returns its stats."""
    train, dist = job.recipe.train, job.dist
    final = latest_checkpoint(ckpt_root)
    stats = {"steps": train.max_steps, "first": first, "last": last, "checkpoint": str(final)}
    if dist.is_main:
        draft = sum(p.stat().st_size for p in (final / "draft").rglob("*") if p.is_file())  # ema: the same tensors
        require_free_space(job.out_dir, draft, "the final draft train/final")
        with publish_dir(job.out_dir / "final") as tmp:  # what eval and export read
            shutil.copytree(final / "draft", tmp, dirs_exist_ok=True)
            if train.ema_decay > 0:
                save_file(published_weights(final), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            write_checksums(tmp)  # eval and export refuse a damaged file by name (read_draft_weights)
        stage.mark_done(job.out_dir, stats, outputs=[f"final/{CHECKSUMS_NAME}"])  # its deletion is refused too
        tau = "tau" in (first or {}) and "tau" in last
        loss = f"loss {first['loss']:.4f} -> {last['loss']:.4f}" if first and last else "no step metrics kept"
        print(f"[train] done: {loss}"
              + (f", training tau estimate {first['tau']:.3f} -> {last['tau']:.3f}" if tau else ""), flush=True)
    dist.barrier()
    return stats
