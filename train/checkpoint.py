"""Training checkpoints: one `step-NNNNNNN` folder per save (the draft, the trainable weights, the optimizer state,
the weight average with train.ema_decay, checksums), published by an atomically written `latest` pointer; resume
refuses a damaged or foreign checkpoint by name instead of training on it or silently starting over."""

from __future__ import annotations

import importlib
import json
import pickle
import re
import shutil
from pathlib import Path

import torch

from core.dist import Dist, fault_point
from core.io import (DamagedFileError, atomic_open, atomic_write_json, atomic_write_text, fresh_dir, require_free_space,
                     sync_tree, verify_checksums, write_checksums, write_failure)
from modeling.registry import read_draft_weights
from train.ema import averaged_weights


CHECKPOINT_NAME = re.compile(r"step-\d{7}")
#: a checkpoint's fp32 average of the trainable draft weights (train.ema_decay > 0; train/ema.py)
AVERAGE_NAME = "ema.pt"
#: how a checkpoint's optimizer state lies over the ranks: {"engine": "ddp" | "deepspeed", "world_size": N}, read by
#: `rank_count_problem` before anything loads (a few bytes of JSON: trainer_state.pt holds the trained weights)
LAYOUT_NAME = "layout.json"


def checkpoint_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"step-{step:07d}"


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint `latest` names, None before the first save. The pointer is only ever a plain step-NNNNNNN
    folder name inside ckpt_root; anything else (a path, a link out, a missing folder) is refused, never guessed
    around: starting over at step 0 would silently throw away the run's progress and its metrics."""
    pointer = ckpt_root / "latest"
    if not pointer.exists() and not pointer.is_symlink():
        return None
    name = pointer.read_text(errors="replace").strip() if pointer.is_file() and not pointer.is_symlink() else None
    if name is None or not CHECKPOINT_NAME.fullmatch(name):
        raise ValueError(f"{pointer} must be a file holding a checkpoint folder name like step-0001000, got "
                         f"{'a link or folder' if name is None else repr(name[:100])}: refusing to resume from it. "
                         f"Write the name of a complete checkpoint folder of {ckpt_root} into it, or delete "
                         f"{ckpt_root} to train from step 0")
    path = ckpt_root / name
    if path.is_symlink() or not path.is_dir():
        raise FileNotFoundError(f"{pointer} names {path}, which is {'a link' if path.is_symlink() else 'missing'}: "
                                f"refusing to restart from step 0 over the run's metrics. Restore that folder, point "
                                f"{pointer} at another complete checkpoint, or delete {ckpt_root} to train from "
                                f"step 0")
    return path


def frozen_names(module) -> set[str]:
    """The state-dict names of `module`'s frozen parameters (the target's embedding and lm_head copies, a frozen copy
    attention): a checkpoint keeps them once, in its draft folder, not again in trainer_state.pt or DeepSpeed's
    model states (an 8B target's embedding and lm_head are 2.4 GB in bf16)."""
    return {name for name, param in module.named_parameters() if not param.requires_grad}


def checkpoint_bytes(module, averaged: bool = False) -> int:
    """About what one checkpoint takes on disk: the draft's weights, the trainable ones again with two AdamW moments
    (fp32) each, and their fp32 average when `averaged`."""
    weights = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return weights + trainable * (4 + 2 * 4 + (4 if averaged else 0))


def save_checkpoint(engine, module, optimizer, step: int, ckpt_root: Path, dist: Dist, extra: dict,
                    average: dict | None = None) -> Path:
    """Write checkpoint `step` and point `latest` at it; `average`: the weight average (train/ema.py) to keep too."""
    path = checkpoint_dir(ckpt_root, step)
    if dist.is_main:
        require_free_space(ckpt_root, checkpoint_bytes(module, average is not None), f"checkpoint {path.name}")
        fresh_dir(path)  # what a killed save left half written there goes first (DeepSpeed writes into it)
    dist.barrier()
    frozen = frozen_names(module)
    try:
        if engine.kind == "deepspeed":
            engine.module.save_checkpoint(str(path), tag="zero", exclude_frozen_parameters=True)
        elif dist.is_main:
            save_tensors({"optimizer": optimizer.state_dict()}, path / "optimizer.pt")
        if dist.is_main:
            atomic_write_json(path / LAYOUT_NAME, {"engine": engine.kind, "world_size": dist.world_size})
            module.save_draft(path / "draft")
            fault_point("train-save", step)  # killed mid-save: the folder is half written, `latest` names the last
            trained = {name: value for name, value in module.state_dict().items() if name not in frozen}
            save_tensors({"step": step, "model": trained, **extra}, path / "trainer_state.pt")
            if average is not None:
                save_tensors(average, path / AVERAGE_NAME)
    except (OSError, RuntimeError) as err:  # torch reports a full disk as a RuntimeError ('iostream error')
        raise write_failure(path, err) from err
    dist.barrier()
    if dist.is_main:
        write_checksums(path)  # a resume refuses a damaged file by name instead of training on it
        # On the disk before `latest` names it (and before pruning deletes the older ones): after a power cut,
        # `latest` never points at files still in the page cache only.
        sync_tree(path)
        atomic_write_text(ckpt_root / "latest", path.name + "\n")
    dist.barrier()
    return path


def rank_count_problem(ckpt_root: Path, world_size: int) -> str | None:
    """The checkpoint `latest` names written by DeepSpeed ZeRO on another number of ranks than `world_size`, said
    before anything loads (DeepSpeed's own load fails only after every rank loaded the target and its records): ZeRO
    splits the optimizer state into one file per data-parallel rank and cannot re-split it (elastic checkpoints are
    off). A DDP checkpoint holds the whole optimizer state (rank 0's optimizer.pt) and the step's global batch is
    cut by rank from the same indices, so it resumes on any count. None too for a checkpoint written before
    LAYOUT_NAME (its count unknown), and for a `latest` or layout the resume itself refuses by name."""
    try:
        path = latest_checkpoint(ckpt_root)
        layout = json.loads((path / LAYOUT_NAME).read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(layout, dict) or layout.get("engine") != "deepspeed":
        return None
    saved = layout.get("world_size")
    if not isinstance(saved, int) or saved == world_size:
        return None
    return (f"{path} was saved by DeepSpeed ZeRO (train.zero_stage > 0) on {saved} rank(s), which splits the "
            f"optimizer state per rank, and this run has {world_size}: resume it on {saved} (torchrun "
            f"--nproc_per_node {saved}, or nodes x processes per node = {saved}), or delete {ckpt_root} to train from "
            f"step 0 on {world_size}")


def save_tensors(obj, path: Path) -> None:
    """torch.save of what load_tensors reads back, through core/io's atomic writer."""
    with atomic_open(path) as handle:
        torch.save(obj, handle)


def prune_checkpoints(ckpt_root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete step folders (0 keeps all): those up to the one `latest` names,
    never that one, never a newer (half-written) one. Called only after `latest` names a complete newer checkpoint,
    so a crash mid-delete still leaves one to resume from; a half-deleted old folder is just deleted again next
    time."""
    latest = latest_checkpoint(ckpt_root)
    if latest is None or keep <= 0:
        return []
    steps = sorted(p for p in ckpt_root.iterdir()
                   if CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir() and p.name <= latest.name)
    stale = steps[:-keep]
    for path in stale:
        shutil.rmtree(path)
    return stale


def load_tensors(path: Path, map_location="cpu") -> dict:
    """torch.load of a file we wrote (tensors, numbers, strings, lists, dicts) without unpickling anything else: a
    checkpoint from a shared or copied run folder must not be able to run code."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise DamagedFileError(f"{path} holds more than tensors and plain values, refused (unpickling it could run "
                               f"code); it is not a checkpoint this trainer wrote. Delete its checkpoint folder and "
                               f"write the name of another one into the checkpoints' `latest` file. "
                               f"({str(err).splitlines()[0]})") from None
    except (RuntimeError, EOFError) as err:  # torch names no file when the zip is cut short or damaged
        raise DamagedFileError(f"{path} is unreadable (truncated or corrupt: {str(err).splitlines()[0]}). Delete "
                               f"its checkpoint folder and write the name of an older one into the checkpoints' "
                               f"`latest` file, or delete the checkpoints to train from step 0") from None


#: the classes DeepSpeed ZeRO-1/2 pickles into its optimizer states besides tensors and plain values
DEEPSPEED_CHECKPOINT_CLASSES = ("deepspeed.utils.tensor_fragment.fragment_address",
                                "deepspeed.runtime.zero.config.ZeroStageEnum",
                                "deepspeed.runtime.fp16.loss_scaler.LossScaler")


def _safe_deepspeed_loads(ds_engine) -> None:
    """DeepSpeed's checkpoint engine unpickles with weights_only=False: load its files with weights_only=True
    instead, allowing only the few DeepSpeed classes its ZeRO-1/2 states hold."""
    classes = [getattr(importlib.import_module(module), name)
               for module, name in (dotted.rsplit(".", 1) for dotted in DEEPSPEED_CHECKPOINT_CLASSES)]

    def load(path, map_location=None):
        with torch.serialization.safe_globals(classes):
            return load_tensors(Path(path), map_location)

    ds_engine.checkpoint_engine.load = load


def read_average(path: Path) -> dict:
    """Checkpoint `path`'s weight average (train.ema_decay > 0), as save_checkpoint wrote it."""
    return load_tensors(path / AVERAGE_NAME)


def published_weights(path: Path) -> dict:
    """Checkpoint `path`'s draft weights as train/final publishes them (what eval and export read): its trainable
    weights replaced by the weight average where train.ema_decay saved one."""
    weights = read_draft_weights(path / "draft")
    if not (path / AVERAGE_NAME).is_file():
        return weights
    return averaged_weights(weights, read_average(path), path / AVERAGE_NAME)


def load_checkpoint(engine, module, optimizer, path: Path) -> dict:
    try:
        verify_checksums(path, required=True)  # save_checkpoint always writes one
    except DamagedFileError as err:
        raise DamagedFileError(f"{err}: refusing to resume from it. Delete {path} and write the name of an older "
                               f"checkpoint into the checkpoints' `latest` file, or delete the checkpoints to train "
                               f"from step 0") from None
    state = load_tensors(path / "trainer_state.pt")
    if engine.kind == "deepspeed":
        _safe_deepspeed_loads(engine.module)
        engine.module.load_checkpoint(str(path), tag="zero", load_optimizer_states=True,
                                      load_lr_scheduler_states=False, load_module_strict=False)
    else:
        missing, unexpected = module.load_state_dict(state["model"], strict=False)
        missing = set(missing) - frozen_names(module)  # the frozen ones come from the draft folder below
        if unexpected or missing:
            raise ValueError(f"{path / 'trainer_state.pt'} does not match this recipe's model: missing "
                             f"{sorted(missing)}, unexpected {sorted(unexpected)}")
        optimizer.load_state_dict(load_tensors(path / "optimizer.pt")["optimizer"])
    _restore_frozen(module, path / "draft")
    return state


def _restore_frozen(module, draft_dir: Path) -> None:
    """The frozen parameters as the checkpoint's draft folder holds them (their one copy in a checkpoint). The rest
    (Eagle3's target lm_head) is the target's own, as built."""
    names = sorted(name for name in frozen_names(module) if name.startswith("draft."))
    if not names:
        return
    weights = read_draft_weights(draft_dir)
    with torch.no_grad():
        for name in names:
            module.get_parameter(name).copy_(weights[name.removeprefix("draft.")])
