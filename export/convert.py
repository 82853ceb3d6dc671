"""Export a trained DraftSmith draft folder to a serving checkpoint (SGLang 0.5.23 or vLLM/speculators).

    export_draft(ExportJob("runs/x/train/final", "sglang", "exported/x"))                   (export.convert)
    python export/main.py --checkpoint runs/x/train/final --to sglang --out exported/x      (the CLI)

Input: a draft folder (modeling/registry.py): `config.json`, whose `architectures[0]` is `Qwen3DSparkModel` for
DSpark/DFlash or `LlamaForCausalLMEagle3` for Eagle3, and `model.safetensors` with the model's own state-dict keys.

Which serving algorithm a draft maps to (SGLang names; export/serving.py `detect_algorithm`, `serves_as_dflash`):
    LlamaForCausalLMEagle3                              -> EAGLE3  (LlamaForCausalLMEagle3)
    Qwen3DSparkModel, 1+N layout (sample_from_anchor=False), markov_rank=0, no confidence head
                                                        -> DFLASH  (DFlashDraftModel; dflash_config.block_size=gamma+1)
    Qwen3DSparkModel with a candidate selector (selector_rank > 0; 1+N layout, markov_rank=0, no confidence head)
                                                        -> DFLASH2 (DFlash2DraftModel, served by SGLang's and vLLM's
                                                           DFLASH worker; vLLM's layers also get identity grouped
                                                           convolutions, `identity_convolutions`)
    Qwen3DSparkModel, anything else                     -> DSPARK  (Qwen3DSparkModel; block_size=gamma)

Strictness: the expected tensors are the registry's model built on the meta device from the draft's own config
(every name, shape and dtype), renamed or dropped per (engine, architecture) by `SERVING_NAMES`. A missing key, a
wrong shape or dtype, or a stray key raises ValueError naming the key, and nothing is left at `out`: the export is
written into a temporary folder next to `out` and moved into place only when complete.

Serving: the export declares the target's dtype and stores its weights in it (`serving_dtype`), and ships beside a
DSpark draft the STS calibration and an SPS table that covers SGLang's verify batches, given or found in the draft's
run (`_serving_files`); export/serving.py prints the command that serves it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from core import stage
from core.dist import fault_point
from core.io import LinkedPathError, link_problem, publish_dir, sha256_file
from core.server import ENGINES, SERVING_ALGORITHMS, sglang_selector_top_k_problem
from export.serving import (SERVING_DTYPES, SPS_FILENAME, STS_FILENAME, SpsTable, check_sps_range, check_sts_length,
                            covers_sglang_batches, detect_algorithm, load_sts, run_folder, run_recipe, serve_command,
                            serve_notes, serves_as_dflash, trained_chat_template, unserved_target)
from modeling.dspark import block_length
from modeling.registry import (CONFIG_NAME, WEIGHTS_NAME, detect, draft_digest, meta_model, read_config,
                               read_draft_weights)
from modeling.target import resolve_target, target_shape
from modeling.vocab import mapping_agrees

# Parameter dtypes a draft may be stored in; all floating tensors of one draft must share one of them.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Serving name of each draft tensor, per (engine, architecture); a name not listed keeps its own name. None = dropped
# (the engine uses the target's copy, so the draft may lack it); a key ending in "." renames a prefix.
SERVING_NAMES = {
    ("sglang", "Qwen3DSparkModel"): {"embed_tokens.weight": None, "lm_head.weight": None},
    ("vllm", "Qwen3DSparkModel"): {},  # speculators checkpoints keep the frozen copies
    ("sglang", "LlamaForCausalLMEagle3"): {"embed_tokens.weight": None},
    ("vllm", "LlamaForCausalLMEagle3"): {"midlayer.": "layers.0."},  # speculators numbers SGLang's midlayer 0
}


@dataclass(frozen=True)
class Entry:
    """One tensor of the key map: its name in the trained draft, its name in the export (None = dropped: the serving
    engine uses the target's copy), its shape, and its dtype ("float" = the draft's floating dtype)."""

    src: str
    dst: str | None
    shape: tuple[int, ...]
    dtype: object = "float"
    required: bool = True  # a dropped tensor may be absent from the source (it is checked when present)


def _serving_name(name: str, names: dict) -> str | None:
    if name in names:
        return names[name]
    for prefix, new in names.items():
        if prefix.endswith(".") and name.startswith(prefix):
            return new + name[len(prefix):]
    return name


def key_map(cfg: dict, engine: str) -> list[Entry]:
    """Every tensor a draft with this config.json must hold, with its serving name for `engine`."""
    arch = detect(cfg)
    try:
        model = meta_model(cfg)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"config.json cannot describe a {arch.name}: {err}") from err
    names = SERVING_NAMES[(engine, arch.name)]
    entries = []
    for name, tensor in model.state_dict().items():
        dst = _serving_name(name, names)
        dtype = "float" if tensor.is_floating_point() else tensor.dtype
        entries.append(Entry(name, dst, tuple(tensor.shape), dtype, required=dst is not None))
    return entries


# ---------------------------------------------------------------------------------------------------------------------
# Config checks


def _block_layer_ids(cfg: dict) -> list[int]:
    ids = cfg.get("target_layer_ids") or (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if not ids:
        raise ValueError("config has no target_layer_ids (HF layer-output ids of the captured target layers)")
    return [int(i) for i in ids]


def _eagle3_layer_ids(cfg: dict) -> list[int]:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError("config has no eagle_config.eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids]


def _require(cfg: dict, *keys: str) -> None:
    for key in keys:
        if cfg.get(key) is None:
            raise ValueError(f"config.json is missing required key {key!r}")


def _anchor_first_refusal(cfg: dict) -> str:
    return (f"this draft uses the anchor-first block layout (sample_from_anchor={cfg.get('sample_from_anchor')!r}, "
            f"markov_rank={cfg.get('markov_rank', 0)}, enable_confidence_head={cfg.get('enable_confidence_head')}); "
            "SGLang DFLASH reads the 1+N layout (block_size = gamma+1, the anchor slot predicts nothing), so it would "
            "load and silently accept nothing. Anchor-first drafts export as DSPARK (Qwen3DSparkModel, "
            "block_size = gamma), with markov_rank=0 for a plain DFlash draft; only drafts trained with "
            "sample_from_anchor=False, markov_rank=0 and no confidence head may export as DFLASH")


def _check_serving_support(cfg: dict, algorithm: str, target: str) -> None:
    if algorithm in ("dflash", "dflash2") and cfg.get("architectures", [None])[0] == "Qwen3DSparkModel":
        if not serves_as_dflash(cfg):
            raise ValueError(f"cannot export as {algorithm.upper()}: {_anchor_first_refusal(cfg)}")
    if algorithm == "dflash2":
        _require(cfg, "mask_token_id", "block_size", "selector_rank", "selector_top_k")
        if target == "sglang" and (problem := sglang_selector_top_k_problem(int(cfg["selector_top_k"]))) is not None:
            # vLLM's walk pads K to a power of two and masks the rest (triton.next_power_of_2 in its
            # v1/worker/gpu/spec_decode/dflash2/speculator.py): --to vllm stays open
            raise ValueError(f"cannot export to SGLang: selector_top_k={problem}. Retrain with draft.selector_top_k a "
                             f"power of two such as 16, or serve this draft with vLLM (--to vllm)")
    if algorithm == "dspark":
        _require(cfg, "mask_token_id", "block_size")
        if target == "sglang" and int(cfg.get("markov_rank", 0) or 0) <= 0:
            raise ValueError("cannot export as SGLang DSPARK: markov_rank=0, and SGLang 0.5.23's Qwen3DSparkModel "
                             "raises 'DSpark draft requires markov_rank > 0'. A markov_rank=0 draft serves in SGLang "
                             "only as DFLASH, which needs the 1+N layout (sample_from_anchor=False)")
    if algorithm == "dflash":
        _require(cfg, "mask_token_id", "block_size")
    if algorithm == "dspark" and target == "vllm":
        head = cfg.get("markov_head_type", "vanilla")
        if head != "vanilla":
            raise ValueError(f"cannot export to vLLM: markov_head_type={head!r}, and vLLM 0.32's DSpark drafter has "
                             "only the vanilla Markov head (it would load the weights it knows and silently draft "
                             f"without the {head} part). Serve this draft with SGLang (--to sglang), or train with "
                             "draft.markov_head_type: vanilla for vLLM")
    _check_aux_layers(cfg, algorithm)


#: config.json keys a block draft's training set from the recipe's draft section, by that section's key
_TRAINED_DRAFT_KEYS = {"num_layers": "num_hidden_layers", "block_size": "block_size", "markov_rank": "markov_rank",
                       "markov_head_type": "markov_head_type", "enable_confidence_head": "enable_confidence_head",
                       "sample_from_anchor": "sample_from_anchor", "selector_rank": "selector_rank",
                       "selector_top_k": "selector_top_k"}


def _check_trained_settings(checkpoint_dir: Path, cfg: dict, algorithm: str) -> None:
    """A run's block draft (train/final, opd/final) is served as its train stage built it: a config.json edited since
    (a block_size of 3 for a draft trained at 7, with checksums.json re-sealed to match) would load and draft
    wrongly, so each key the recipe's draft section set is compared with the train stage's pinned settings."""
    run = run_folder(checkpoint_dir)
    trained = stage.pinned(run / "train").get("draft", {}) if run is not None else {}
    if algorithm == "eagle3" or not isinstance(trained, dict):
        return
    changed = [f"{name} {cfg[name]!r} (trained with draft.{key} {trained[key]!r})"
               for key, name in _TRAINED_DRAFT_KEYS.items() if key in trained and name in cfg
               and cfg[name] != trained[key]]
    if changed:
        raise ValueError(f"{checkpoint_dir / CONFIG_NAME} has {', '.join(changed)}: it was edited after training "
                         f"({run / 'train'} pins the settings the weights were trained with); restore it or retrain")


def _check_aux_layers(cfg: dict, algorithm: str) -> None:
    """Refuse a captured layer equal to the target's last decoder layer. Both engines capture HF layer-output id k
    as the input of layer k+1, and there is no layer L for k = L-1: SGLang and vLLM never fill that slot, and
    speculators' DFlash converter drops it as the verifier's final state, so fc would read the wrong width."""
    if algorithm == "eagle3":
        ids, key = _eagle3_layer_ids(cfg), "eagle_config.eagle_aux_hidden_state_layer_ids"
    else:
        ids, key = _block_layer_ids(cfg), "target_layer_ids"
    num_target_layers = cfg.get("num_target_layers")
    if num_target_layers is None:  # older Eagle3 drafts do not record it: nothing to check against
        return
    last = int(num_target_layers) - 1
    if last in ids:
        raise ValueError(f"cannot export: {key} {ids} includes {last}, the target's last decoder layer (it has "
                         f"{num_target_layers}). Serving engines capture layer k as the input of layer k+1, which "
                         f"does not exist for the last layer, so the draft would get {len(ids) - 1} of its "
                         f"{len(ids)} context features. Retrain with target.layer_ids below {last}")


# ---------------------------------------------------------------------------------------------------------------------
# Serving configs


def _base_transformer_config(cfg: dict, drop: tuple[str, ...]) -> dict:
    return {k: v for k, v in cfg.items() if k not in drop and not k.startswith("_") and k != "transformers_version"}


_BLOCK_KEYS = ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id", "markov_rank",
               "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor",
               "dflash_config", "auto_map", "selector_rank", "selector_top_k")


def sglang_config(cfg: dict, algorithm: str) -> dict:
    if algorithm == "eagle3":
        out = _base_transformer_config(cfg, ("ttt_length",))
        out["architectures"] = ["LlamaForCausalLMEagle3"]
        out["model_type"] = "llama"
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": _eagle3_layer_ids(cfg),  # HF layer-output ids
                               "use_aux_hidden_state": True}
        out["draft_vocab_size"] = int(cfg["draft_vocab_size"])
        out["tie_word_embeddings"] = False
        return out
    out = _base_transformer_config(cfg, _BLOCK_KEYS)
    out["model_type"] = "qwen3"
    gamma = int(cfg["block_size"])
    layer_ids = _block_layer_ids(cfg)
    dflash = {"target_layer_ids": layer_ids, "mask_token_id": int(cfg["mask_token_id"])}
    if cfg.get("num_target_layers") is not None:
        dflash["num_target_layers"] = int(cfg["num_target_layers"])
        out["num_target_layers"] = int(cfg["num_target_layers"])
    if algorithm in ("dflash", "dflash2"):
        out["architectures"] = ["DFlashDraftModel" if algorithm == "dflash" else "DFlash2DraftModel"]
        # SGLang DFLASH: block_size is the full verify width of the 1+N block, gamma + 1
        dflash["block_size"] = out["block_size"] = block_length(gamma, sample_from_anchor=False)
        if algorithm == "dflash2":  # parse_dflash_draft_config reads the selector from dflash_config only
            dflash.update(selector_rank=int(cfg["selector_rank"]), selector_top_k=int(cfg["selector_top_k"]))
        out["dflash_config"] = dflash
        return out
    rank = int(cfg.get("markov_rank", 0) or 0)
    out["architectures"] = ["Qwen3DSparkModel"]
    out.update(block_size=gamma, mask_token_id=int(cfg["mask_token_id"]), markov_rank=rank,
               markov_head_type=cfg.get("markov_head_type", "vanilla"),
               sample_from_anchor=bool(cfg.get("sample_from_anchor", True)),
               enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
               confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", rank > 0)),
               target_layer_ids=layer_ids)
    dflash["block_size"] = gamma  # SGLang DSPARK: block_size is gamma
    out["dflash_config"] = dflash
    return out


def _vllm_layer_ids(hf_output_ids: list[int]) -> list[int]:
    """vLLM numbers an aux hidden state by how many decoder layers produced it (id k = the input of layer k), so
    its ids are our HF layer-output ids + 1. Its speculators reader maps dflash/dspark ids back with k - 1."""
    return [i + 1 for i in hf_output_ids]


def vllm_config(cfg: dict, algorithm: str, verifier: str | None) -> dict:
    """A speculators-format config.json (vLLM reads `speculators_config` + `transformer_layer_config`)."""
    if algorithm == "eagle3":
        layer = _base_transformer_config(cfg, ("ttt_length", "eagle_config", "draft_vocab_size", "target_hidden_size",
                                               "architectures"))
        layer["architectures"] = ["LlamaForCausalLM"]
        layer["model_type"] = "llama"
        # vLLM 0.32 captures the top-level layer ids, but its Eagle3 class sizes fc from the layer config's
        # num_aux_hidden_states (or eagle_config), else 3 (model_executor/models/llama_eagle3.py)
        layer["num_aux_hidden_states"] = len(_eagle3_layer_ids(cfg))
        out = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": layer, "draft_vocab_size": int(cfg["draft_vocab_size"]),
               "target_hidden_size": int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
               "eagle_aux_hidden_state_layer_ids": _vllm_layer_ids(_eagle3_layer_ids(cfg)),
               "norm_before_residual": False}
        speculative_tokens = int(cfg.get("ttt_length", 3) or 3)
    else:
        layer = _base_transformer_config(cfg, _BLOCK_KEYS + ("architectures",))
        layer["architectures"] = ["Qwen3ForCausalLM"]
        layer["model_type"] = "qwen3"
        name = {"dflash": "DFlashSpeculator", "dflash2": "DFlash2Speculator"}.get(algorithm, "DSparkSpeculator")
        rank = int(cfg.get("markov_rank", 0) or 0)
        out = {"architectures": [name], "speculators_model_type": algorithm, "transformer_layer_config": layer,
               "draft_vocab_size": int(cfg["vocab_size"]),
               "aux_hidden_state_layer_ids": _vllm_layer_ids(_block_layer_ids(cfg)),
               # speculators' block_size is the block's slot count: gamma anchor-first, gamma+1 in the 1+N layout
               # (it drafts block_size - 1 tokens there, and its own DFlash converter writes gamma+1).
               "block_size": block_length(int(cfg["block_size"]), cfg.get("sample_from_anchor", True)),
               "mask_token_id": int(cfg["mask_token_id"]),
               "sample_from_anchor": bool(cfg.get("sample_from_anchor", True))}
        if algorithm == "dspark":
            out.update(markov_rank=rank, markov_head_type=cfg.get("markov_head_type", "vanilla"),
                       enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
                       confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", rank > 0)))
        if algorithm == "dflash2":  # vLLM's update_dflash2 copies these four into dflash_config
            out.update(selector_rank=int(cfg["selector_rank"]), selector_top_k=int(cfg["selector_top_k"]),
                       conv_kernel_size=1, conv_group_size=int(cfg["hidden_size"]))
        speculative_tokens = int(cfg["block_size"])
    out["speculators_config"] = {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": []},
    }
    out["speculators_version"] = "draftsmith"
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The dtype an export declares, and the files that serve beside it


def target_config_dtype(target: str) -> str | None:
    """The dtype the target's config.json names; None when it names none or the config cannot be read here (a hub
    id not in the local cache while offline)."""
    return (target_shape(target) or {}).get("dtype")


def serving_dtype(dtype: str | None, target: str | None, weights_dtype: torch.dtype) -> str:
    """The dtype an export declares and stores its weights in: `dtype` when given, else the target's own (SGLang
    builds the draft in the server's --dtype, and its DSpark/DFlash/Eagle3 fc takes the target's hidden states as they
    come: a float16 draft beside a bfloat16 target fails its first request), else the draft's as trained when no
    target config is readable (the printed command then runs target and draft in it: slower, never mismatched)."""
    dtype = dtype or (target_config_dtype(target) if target else None) or str(weights_dtype).removeprefix("torch.")
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"cannot serve in dtype {dtype!r}: expected one of {', '.join(SERVING_DTYPES)}")
    return dtype


def declare_dtype(config: dict, dtype: str) -> None:
    """Name `dtype` in an export's config.json where serving.declared_dtype reads it: the way SGLang's
    `_get_and_verify_dtype` and transformers 5 read it (`dtype`) and the way older readers do (`torch_dtype`), on
    a speculators config's transformer_layer_config. A config naming none is float32 to SGLang, which `--dtype auto`
    then runs in float16."""
    config = config.get("transformer_layer_config") or config
    config["dtype"] = config["torch_dtype"] = dtype


def run_target(checkpoint_dir) -> str | None:
    """The target of the run a draft folder belongs to (its recipe.yaml), None outside a run."""
    recipe = run_recipe(checkpoint_dir)
    return None if recipe is None else recipe.target.name_or_path


def _eval_of(checkpoint_dir: Path) -> Path | None:
    """The eval folder of the draft's run when that eval finished on this very draft: its settings pin the digest
    of the draft it measured, and an eval of another draft (train/final when opd ran) calibrated something else."""
    run = run_folder(checkpoint_dir)
    if run is None or not stage.is_done(run / "eval") \
            or stage.pinned(run / "eval").get("draft_sha256") != draft_digest(checkpoint_dir):
        return None
    stage.verify_outputs(run / "eval")  # an sts.json edited since that eval wrote it is refused, not shipped
    return run / "eval"


def found_serving_files(checkpoint_dir) -> tuple[Path | None, Path | None]:
    """(sts.json, sps_table.json) a DSpark export takes when none is given: each from the draft folder itself, else
    from its run's eval of this draft (`_eval_of`), where the eval stage writes them."""
    own = [Path(checkpoint_dir) / name for name in (STS_FILENAME, SPS_FILENAME)]
    if all(p.is_file() for p in own):
        return own[0], own[1]
    eval_dir = _eval_of(Path(checkpoint_dir))
    places = [[p] + ([eval_dir / p.name] if eval_dir is not None else []) for p in own]
    sts, sps = (next((p for p in paths if p.is_file()), None) for paths in places)
    return sts, sps


def shippable_sps(path: Path | None, cfg: dict) -> Path | None:
    """A found SPS table (one the user did not name) ships only when it reaches SGLang's largest verify batch;
    otherwise it is left out, and the export's printed note (serving.sps_profile_note) says why and how to profile
    one on the serving GPU. The eval's table, timed by DraftSmith's own loop up to 128 tokens, is left out so."""
    if path is None or cfg.get("block_size") is None:  # an Eagle3 draft: no SPS scheduler to feed
        return path
    return path if covers_sglang_batches(SpsTable.load(path), int(cfg["block_size"])) else None


def _serving_files(checkpoint_dir: Path, cfg: dict, algorithm: str, sts_path, sps_path
                   ) -> tuple[Path | None, Path | None]:
    """The STS and SPS files a DSpark export ships (None, None for other algorithms), each read with the reader
    that refuses what SGLang would misread, naming the file. Given ones must exist and fit this draft; found ones
    (`found_serving_files`) too, except an SPS table short of SGLang's range, which is left out (`shippable_sps`)."""
    for path, what in ((sts_path, "sts file"), (sps_path, "sps table")):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{what} {path} not found")
    found_sts, found_sps = found_serving_files(checkpoint_dir) if algorithm == "dspark" else (None, None)
    sts = Path(sts_path) if sts_path is not None else found_sts
    sps = Path(sps_path) if sps_path is not None else found_sps
    calibration = load_sts(sts) if sts is not None else None
    table = SpsTable.load(sps) if sps is not None else None
    if algorithm != "dspark":
        return None, None
    gamma = int(cfg["block_size"])
    if calibration is not None:
        check_sts_length(calibration, gamma, sts)
    if sps_path is None:
        return sts, shippable_sps(sps, cfg)
    check_sps_range(table, gamma, sps)
    return sts, sps


# ---------------------------------------------------------------------------------------------------------------------
# Export


def _validate(state: dict[str, torch.Tensor], entries: list[Entry]) -> dict[str, torch.Tensor]:
    """Check `state` against the key map; return {serving name: tensor}. Raises ValueError naming the key."""
    known = {e.src: e for e in entries}
    stray = sorted(set(state) - set(known))
    if stray:
        raise ValueError(f"unexpected key {stray[0]!r} in the checkpoint (not in the key map)"
                         + (f"; {len(stray) - 1} more: {stray[1:6]}" if len(stray) > 1 else ""))
    float_dtype = None
    out = {}
    for e in entries:
        if e.src not in state:
            if e.required:
                raise ValueError(f"missing key {e.src!r} (expected shape {list(e.shape)})")
            continue
        t = state[e.src]
        if tuple(t.shape) != e.shape:
            raise ValueError(f"key {e.src!r} has shape {list(t.shape)}, expected {list(e.shape)}")
        if e.dtype == "float":
            if t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"key {e.src!r} has dtype {t.dtype}, expected one of {FLOAT_DTYPES}")
            float_dtype = float_dtype or t.dtype
            if t.dtype != float_dtype:
                raise ValueError(f"key {e.src!r} has dtype {t.dtype}, the draft's other weights are {float_dtype}")
        elif t.dtype != e.dtype:
            raise ValueError(f"key {e.src!r} has dtype {t.dtype}, expected {e.dtype}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):  # no engine serves a NaN or inf weight
            raise ValueError(f"key {e.src!r} holds non-finite values (NaN or inf): the draft is damaged; export an "
                             f"earlier checkpoint or retrain")
        if e.dst is not None:
            out[e.dst] = t.contiguous()
    return out


def identity_convolutions(cfg: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The grouped causal convolutions vLLM 0.32's DFlash2 layer always builds around attention and MLP (its
    DFlash2Qwen3DecoderLayer reads dflash_config.conv_kernel_size / conv_group_size, and would run uninitialised
    tensors without weights), as the identity: one tap, one group, base kernel 1, no token-dependent part. Our DFlash2
    has no convolutions (SGLang builds them only when asked), so this is exactly our backbone."""
    hidden = int(cfg["hidden_size"])
    out = {}
    for i in range(int(cfg["num_hidden_layers"])):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = torch.ones(2, 1, hidden, dtype=dtype)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = torch.zeros(2, hidden, dtype=dtype)
    return out


def _check_eagle3_mapping(cfg: dict, state: dict[str, torch.Tensor]) -> None:
    if not mapping_agrees(state["d2t"], state["t2d"]):
        raise ValueError("key 'd2t' disagrees with 't2d': arange(draft_vocab_size) + d2t must be the ids where t2d")


@dataclass(frozen=True)
class ExportJob:
    """One export (export/main.py's flags, or the pipeline's export stage built from the recipe): the trained draft
    folder `checkpoint`, the engine format `to` ("sglang" | "vllm"), the folder `out` to write, and what ships or
    decides beside them (see export_draft)."""

    checkpoint: Path
    to: str
    out: Path
    algorithm: str | None = None
    sts_path: Path | None = None
    sps_path: Path | None = None
    verifier: str | None = None
    dtype: str | None = None
    overwrite: bool = False


def export_draft(job: ExportJob) -> Path:
    """Export `job.checkpoint`, a trained draft folder, to `job.to` at `job.out`; returns the output path.

    algorithm: None picks it from the config (see module docstring); "dflash"/"dspark"/"eagle3" forces one (and is
    refused when the draft cannot serve that way). sts_path: a DSpark confidence calibration JSON to copy as sts.json,
    one temperature per draft position. sps_path: the target's SPS cost table for SGLang's DSpark verify scheduler,
    copied as sps_table.json; refused unless it reaches SGLang's largest verify batch (`check_sps_range`). Without
    them a DSpark export takes `found_serving_files` (the draft folder's, else its run's eval of this draft), leaving
    out an SPS table short of that range. verifier: the target model id/path, written into vLLM's
    speculators_config; its config's dtype is the export's unless `dtype` names one (`serving_dtype`). Raises
    ValueError on any mismatch; `job.out` is then left untouched.
    """
    checkpoint_dir, to, out_dir, algorithm = Path(job.checkpoint), job.to, Path(job.out), job.algorithm
    sts_path, sps_path, verifier, dtype, overwrite = job.sts_path, job.sps_path, job.verifier, job.dtype, job.overwrite
    if to not in ENGINES:
        raise ValueError(f"--to must be one of {ENGINES}, got {to!r}")
    weights_path = checkpoint_dir / WEIGHTS_NAME
    cfg = read_config(checkpoint_dir)
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} not found: expected a draft folder written by training "
                                f"({CONFIG_NAME} + {WEIGHTS_NAME})")
    if out_dir.is_symlink():
        raise LinkedPathError(link_problem(out_dir))
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True / --overwrite)")
    if out_dir.exists() or out_dir.is_symlink():
        _check_replaceable(out_dir)
    detected = detect_algorithm(cfg)
    algorithm = algorithm or detected
    if algorithm not in SERVING_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {SERVING_ALGORITHMS}, got {algorithm!r}")
    if (algorithm == "eagle3") != (detected == "eagle3"):
        raise ValueError(f"a {cfg['architectures'][0]} draft cannot export as {algorithm.upper()}")
    if (algorithm == "dflash2") != (detected == "dflash2"):  # the selector would be dropped, or there is none
        has = "with" if detected == "dflash2" else "without"
        raise ValueError(f"a draft {has} a candidate selector (selector_rank {cfg.get('selector_rank', 0)}) cannot "
                         f"export as {algorithm.upper()}; export it as "
                         f"{detected.upper()} (leave out --algorithm)")
    _check_serving_support(cfg, algorithm, to)
    _check_trained_settings(checkpoint_dir, cfg, algorithm)
    unserved = unserved_target(to, algorithm, (target_shape(verifier) or {}).get("architecture") if verifier else None)
    if unserved:
        raise ValueError(f"cannot export: {unserved}")
    if algorithm == "eagle3":
        _require(cfg, "draft_vocab_size", "hidden_size", "vocab_size", "num_hidden_layers")
        _eagle3_layer_ids(cfg)
    else:
        _require(cfg, "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size")
        _block_layer_ids(cfg)

    state = read_draft_weights(checkpoint_dir)  # checked against training's checksums, or refused by name
    tensors = _validate(state, key_map(cfg, to))  # shapes/dtypes first, so the mapping check sees well-formed tensors
    if algorithm == "eagle3":
        _check_eagle3_mapping(cfg, state)
    out_cfg = sglang_config(cfg, algorithm) if to == "sglang" else vllm_config(cfg, algorithm, verifier)
    dtype = serving_dtype(dtype, verifier, next(t.dtype for t in tensors.values() if t.is_floating_point()))
    tensors = {k: t.to(getattr(torch, dtype)) if t.is_floating_point() else t for k, t in tensors.items()}
    if to == "vllm" and algorithm == "dflash2":
        tensors.update(identity_convolutions(cfg, getattr(torch, dtype)))
    declare_dtype(out_cfg, dtype)
    sts, sps = _serving_files(checkpoint_dir, cfg, algorithm, sts_path, sps_path)

    # overwrite: the old export is moved aside only once the new one is complete
    with publish_dir(out_dir, if_exists="replace" if overwrite else "error") as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        fault_point("export", 0)  # killed mid-export: only the temporary folder beside out_dir is half written
        for src, name in ((sts, STS_FILENAME), (sps, SPS_FILENAME)):
            if src is not None:
                shutil.copyfile(src, tmp / name)
        for name in _COPIED_FILES:
            if (checkpoint_dir / name).is_file():
                shutil.copyfile(checkpoint_dir / name, tmp / name)
    return out_dir


_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
#: everything an export folder can hold: --overwrite replaces a folder holding nothing else.
EXPORT_FILES = frozenset((CONFIG_NAME, WEIGHTS_NAME, STS_FILENAME, SPS_FILENAME) + _COPIED_FILES)


class NotAnExportError(FileExistsError):
    """The folder an export would replace holds more than an earlier export: nothing is deleted."""


def _check_replaceable(out_dir: Path) -> None:
    """An export (export/main.py --overwrite, the pipeline's export stage) replaces an earlier export, never anything
    else its folder happens to be (a run folder with its cache and checkpoints, a home directory, a user's notes):
    those hold files an export never writes."""
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise NotAnExportError(f"an export replaces only an export folder, and {out_dir} is "
                               f"{'a link' if out_dir.is_symlink() else 'not a folder'}: export to another folder, or "
                               f"remove it yourself if it really is to go")
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()
                     if p.name not in EXPORT_FILES or not p.is_file() or p.is_symlink())
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise NotAnExportError(f"an export replaces only an export folder ({', '.join(sorted(EXPORT_FILES))}), "
                               f"and {out_dir} also holds {shown}: not deleting it. Move those out of it, export to "
                               f"another folder, or remove it yourself if it really is to go")


def run_export_stage(job: ExportJob) -> dict:
    """The pipeline's `export` stage (rank 0): `job.checkpoint`, the trained draft, as an SGLang checkpoint in
    `job.out` (the stage's folder is its parent), in the target's dtype (`job.verifier`: the recipe's target), with the
    eval's STS calibration and (when it covers SGLang's verify batches, `shippable_sps`) SPS table beside a DSpark
    draft. Pinned to the draft's and those files' digests and the target's dtype: a retrained draft or a new
    calibration exports again. Returns {"path", "command"} (the command that serves it) and "note" (what is missing,
    and how to make it) when there is one; the note is printed each time."""
    draft_dir, export_dir, sts_path, sps_path = job.checkpoint, Path(job.out).parent, job.sts_path, job.sps_path
    target = resolve_target(job.verifier)
    settings = {"draft_sha256": draft_digest(draft_dir), "target": job.verifier,
                "target_dtype": target_config_dtype(target),
                "sts_sha256": sha256_file(sts_path) if sts_path is not None else None,
                "sps_sha256": sha256_file(sps_path) if sps_path is not None else None,
                **({"chat_template": template} if (template := trained_chat_template(draft_dir)) else {})}
    done = stage.start(export_dir, settings, "export", on_change="rerun")
    if done is None:
        path = export_draft(replace(job, sps_path=shippable_sps(sps_path, read_config(draft_dir)), verifier=target,
                                    overwrite=True))
        done = {"path": str(path), "command": serve_command(draft_dir, job.to, path, target)}
        notes = serve_notes(draft_dir, job.to, path, target)
        if notes:
            done["note"] = "\n".join(notes)
        stage.mark_done(export_dir, done)
    if done.get("note"):
        print(f"[export] {done['note']}", flush=True)
    return done
