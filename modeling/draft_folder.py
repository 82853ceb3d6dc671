"""What a draft folder is, without torch: its two files, its config and the architectures the registry knows.

`modeling.registry` builds on this file; the command lines check a `--draft` folder with it before anything imports
torch (~12 s on a small machine), so a wrong path is answered at once.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# optional: a block draft's drafting vocabulary, a torch-saved 1-D tensor of target ids (the form of SGLang's
# --speculative-token-map files); absent = the whole vocabulary
TOKEN_MAP_NAME = "token_map.pt"
# config.json's architectures[0] of each draft the registry loads (modeling.registry.ARCHITECTURES, checked there)
ARCHITECTURE_NAMES = ("Qwen3DSparkModel", "LlamaForCausalLMEagle3")


def read_config(draft_dir) -> dict:
    path = Path(draft_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected a draft folder written by training "
                                f"({CONFIG_NAME} + {WEIGHTS_NAME})")
    return json.loads(path.read_text())


def architecture_name(config: dict, where="config.json") -> str:
    """config.json's architectures[0]; ValueError naming the known architectures when it is not one of them."""
    name = (config.get("architectures") or [None])[0]
    if name not in ARCHITECTURE_NAMES:
        raise ValueError(f"unknown draft architecture {name!r} in {where}; known: {', '.join(ARCHITECTURE_NAMES)}")
    return name


def is_draft_dir(path) -> bool:
    path = Path(path)
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        return False
    try:
        architecture_name(read_config(path))
    except (ValueError, json.JSONDecodeError):
        return False
    return True


def max_drafts(draft_dir) -> int | None:
    """The most drafts a round of the draft in `draft_dir` can propose: a block draft's (DSpark, DFlash) block_size,
    the positions one forward predicts; None for an Eagle3 chain, which drafts as many steps as asked."""
    config = read_config(draft_dir)
    return int(config["block_size"]) if architecture_name(config) == "Qwen3DSparkModel" else None
