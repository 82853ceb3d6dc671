"""The drafter registry: one entry per draft architecture, keyed by config.json's `architectures[0]`.

A draft folder is `config.json` (a transformers config) + `model.safetensors` (the model's own state-dict keys), and
for a block draft trained over a reduced vocabulary `token_map.pt`, the target ids it drafts among.
Training writes it (`save_draft`), eval and the live check load it (`load_draft_model`), export reads its expected
tensor names and shapes from the registry's model built on the meta device (`meta_model`): every place that saves,
detects or loads a draft goes through this file.

    arch = architecture_for_family("dspark")          # -> the Qwen3DSparkModel entry
    save_draft(model, run / "train" / "final")
    model = load_draft_model(run / "train" / "final", target)   # frozen copies filled from the target if absent
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config

from core.io import DamagedFileError, publish_dir, sha256_file
from core.stage import verify_published
from core.recipe import BLOCK_FAMILIES, FAMILIES
from modeling.draft_folder import (ARCHITECTURE_NAMES, CONFIG_NAME, TOKEN_MAP_NAME, WEIGHTS_NAME, architecture_name,
                                   read_config)
from modeling.dspark import DSparkModel
from modeling.eagle3 import Eagle3Model
from modeling.target import weights_fingerprint

TARGET_WEIGHTS_KEY = "draftsmith_target_weights"  # config.json: modeling.target.weights_fingerprint of its target


@dataclass(frozen=True)
class DraftArchitecture:
    """name: `architectures[0]`; families: the recipe families trained as it; target_weights: weight name ->
    "embed" | "head", the frozen copies of the target's embedding / lm_head, which serving exports may drop and
    loading then takes back from the target."""

    name: str
    model_class: type
    config_class: type
    families: tuple[str, ...]
    target_weights: dict = field(default_factory=dict)


ARCHITECTURES = {a.name: a for a in (
    DraftArchitecture("Qwen3DSparkModel", DSparkModel, Qwen3Config, BLOCK_FAMILIES,
                      {"embed_tokens.weight": "embed", "lm_head.weight": "head"}),
    # Eagle3's lm_head is its own (trained, draft vocabulary): only the embedding is the target's.
    DraftArchitecture("LlamaForCausalLMEagle3", Eagle3Model, LlamaConfig, ("eagle3",),
                      {"embed_tokens.weight": "embed"}),
)}
assert sorted(f for a in ARCHITECTURES.values() for f in a.families) == sorted(FAMILIES), "a family has no drafter"
assert tuple(ARCHITECTURES) == ARCHITECTURE_NAMES, "modeling/draft_folder.py names other architectures"


def architecture_for_family(family: str) -> DraftArchitecture:
    for arch in ARCHITECTURES.values():
        if family in arch.families:
            return arch
    raise ValueError(f"unknown drafter family {family!r}; known: {', '.join(FAMILIES)}")


def detect(config: dict, where="config.json") -> DraftArchitecture:
    """The registry entry of a draft config (a config.json dict); ValueError naming the known architectures."""
    return ARCHITECTURES[architecture_name(config, where)]


def draft_digest(draft_dir) -> str:
    """sha256 over the draft's config.json and weights: what a stage that reads a draft pins (a retrained draft
    changes it). A folder damaged since training wrote it is refused first, naming the file (verify_published)."""
    verify_published(draft_dir)
    digest = hashlib.sha256()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        digest.update(name.encode() + b"\0" + sha256_file(Path(draft_dir) / name).encode())
    return digest.hexdigest()


def build_model(config: dict, device=None) -> nn.Module:
    """A fresh model of the config's architecture (randomly initialised; on `device`, e.g. "meta")."""
    arch = detect(config)
    with torch.device(device or "cpu"):
        return arch.model_class(arch.config_class.from_dict(config))


def meta_model(config: dict) -> nn.Module:
    """The architecture's model on the meta device: its state dict gives every expected name, shape and dtype
    without allocating a byte (an 8B target's embedding would be gigabytes)."""
    return build_model(config, "meta")


def save_draft(model: nn.Module, path) -> Path:
    """Publish `model` (its config + state dict, on CPU) as a draft folder at `path`, replacing what was there."""
    config: PretrainedConfig = model.config
    detect(config.to_dict())  # only registered architectures are written
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    with publish_dir(path) as tmp:
        config.save_pretrained(tmp)
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        if getattr(model, "draft_vocab", None) is not None:
            torch.save(model.draft_vocab.detach().to("cpu"), tmp / TOKEN_MAP_NAME)
    return Path(path)


def read_token_map(draft_dir, vocab_size: int) -> torch.Tensor | None:
    """The draft folder's drafting vocabulary (sorted distinct target ids < vocab_size), or None without one."""
    path = Path(draft_dir) / TOKEN_MAP_NAME
    if not path.is_file():
        return None
    fix = "delete it to draft over the whole vocabulary, or train the draft again"
    try:
        ids = torch.as_tensor(torch.load(path, weights_only=True)).long()
    except pickle.UnpicklingError as err:  # torch's own message names no file and suggests weights_only=False
        raise ValueError(f"{path} holds more than a tensor of token ids, refused (unpickling it could run code); "
                         f"{fix} ({str(err).splitlines()[0]})") from None
    except (RuntimeError, EOFError, TypeError, ValueError) as err:  # cut short, not a torch file, not numbers
        raise ValueError(f"{path} is unreadable as a token map ({str(err).splitlines()[0]}); {fix}") from None
    if ids.dim() != 1 or not len(ids) or ids.min() < 0 or ids.max() >= vocab_size or len(ids.unique()) != len(ids):
        raise ValueError(f"{path}: expected a 1-D list of distinct target ids in [0, {vocab_size}); {fix}")
    return ids.sort().values


def read_draft_weights(draft_dir) -> dict[str, torch.Tensor]:
    """The state dict in `draft_dir`'s model.safetensors, once every file of the folder matches the checksums
    training recorded (a flipped byte, a cut or a removed file is refused naming it). Eval and export read a draft's
    weights through here; an unreadable file is named too (safetensors' own error names none)."""
    draft_dir = Path(draft_dir)
    verify_published(draft_dir)
    path = draft_dir / WEIGHTS_NAME
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: expected a draft folder written by training "
                                f"({CONFIG_NAME} + {WEIGHTS_NAME})") from None
    except Exception as err:  # safetensors raises its own SafetensorError (and OSError) on a cut or foreign file
        raise DamagedFileError(f"{path} is unreadable (truncated or not a safetensors file: {err}); export or "
                               f"train it again") from None


class TargetMismatchError(ValueError):
    """A draft meets a target other than the one whose hidden states it was trained on."""


def check_target_weights(config: dict, target_model, where) -> None:
    """Refuse a target whose weights differ from the ones the draft was trained on (`TARGET_WEIGHTS_KEY`, written by
    training from the cache's manifest or the online target): same name and shape, other weights, reads as a
    mysteriously low accept length otherwise. Drafts from before the key are not checked."""
    trained_on = config.get(TARGET_WEIGHTS_KEY)
    if trained_on is None or target_model is None:
        return
    have = weights_fingerprint(target_model)
    if have != trained_on:
        raise TargetMismatchError(
            f"{where} was trained on a target whose weights fingerprint is {trained_on}; this target's is {have} "
            f"(same shape, other weights: a fine-tune, another checkpoint at the same path). Evaluate with the target "
            f"it was trained on, or pass --any-target (eval.py) to measure it on this one anyway.")


def load_draft_model(draft_dir, target_model=None, *, dtype: torch.dtype | None = None,
                     any_target: bool = False) -> nn.Module:
    """The model saved in `draft_dir`, frozen, on the target's device in `dtype` (default: the target's dtype, or
    as saved without a target). Weights a serving export dropped (`target_weights`) are copied from the target.
    A target other than the draft's own is refused (`check_target_weights`) unless `any_target`."""
    draft_dir = Path(draft_dir)
    config = read_config(draft_dir)
    arch = detect(config, draft_dir / CONFIG_NAME)
    if not any_target:
        check_target_weights(config, target_model, draft_dir)
    model = arch.model_class(arch.config_class.from_dict(config))
    missing, unexpected = model.load_state_dict(read_draft_weights(draft_dir), strict=False)
    if unexpected or set(missing) - set(arch.target_weights) or (missing and target_model is None):
        raise ValueError(f"{draft_dir / WEIGHTS_NAME} does not match {arch.name}: missing {sorted(missing)}"
                         f"{' (a target model supplies them)' if missing and target_model is None else ''}, "
                         f"unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for name in missing:
            source = target_model.get_input_embeddings() if arch.target_weights[name] == "embed" \
                else target_model.get_output_embeddings()
            model.get_parameter(name).copy_(source.weight)
    if isinstance(model, DSparkModel):
        model.draft_vocab = read_token_map(draft_dir, model.config.vocab_size)
    if target_model is not None:
        param = next(target_model.parameters())
        model.to(device=param.device, dtype=dtype or param.dtype)
    elif dtype is not None:
        model.to(dtype=dtype)
    return model.eval().requires_grad_(False)
