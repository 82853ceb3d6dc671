"""Export a trained DraftSmith draft folder to a serving checkpoint (SGLang 0.5.23 or vLLM/speculators).

    python export/main.py --checkpoint runs/x/draft --to sglang --out exported/x
    from export.main import export_draft; export_draft("runs/x/draft", "sglang", "exported/x")

Input: a draft folder written by `train.algorithms._save`: `config.json` (a transformers config whose
`architectures[0]` is `Qwen3DSparkModel` for DSpark/DFlash or `LlamaForCausalLMEagle3` for Eagle3) and
`model.safetensors` with the model's own state-dict keys (see modeling/dspark.py, modeling/eagle3.py).

Which serving algorithm a draft maps to (SGLang names):
    LlamaForCausalLMEagle3                              -> EAGLE3  (LlamaForCausalLMEagle3)
    Qwen3DSparkModel, 1+N layout (sample_from_anchor=False), markov_rank=0, no confidence head
                                                        -> DFLASH  (DFlashDraftModel; dflash_config.block_size=gamma+1)
    Qwen3DSparkModel, anything else                     -> DSPARK  (Qwen3DSparkModel; block_size=gamma)

Strictness: every tensor is checked against one declarative key map per architecture (name, shape, dtype). A missing
key, a wrong shape or dtype, or a stray key raises ValueError naming the key, and nothing is left at `out`: the export
is written into a temporary folder next to `out` and moved into place with os.replace only when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eval.calibration import load_sts

TARGETS = ("sglang", "vllm")
ALGORITHMS = ("eagle3", "dflash", "dspark")
STS_FILENAME = "sts.json"

# Parameter dtypes a draft may be stored in; all floating tensors of one draft must share one of them.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Entry:
    """One tensor of the key map: its name in the trained draft, its name in the export (None = dropped: the serving
    engine uses the target's copy), its shape, and its dtype ("float" = the draft's floating dtype)."""

    src: str
    dst: str | None
    shape: tuple[int, ...]
    dtype: object = "float"
    required: bool = True  # a dropped tensor may be absent from the source (it is checked when present)


# ---------------------------------------------------------------------------------------------------------------------
# Key maps: (config) -> list[Entry]. One table per architecture; the serving names are the names the loaders read.


def _qwen3_layer_entries(cfg: dict, i: int, dst_prefix: str = "layers") -> list[Entry]:
    h, hd = cfg["hidden_size"], _head_dim(cfg)
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    table = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    return [Entry(f"layers.{i}.{k}", f"{dst_prefix}.{i}.{k}", s) for k, s in table.items()]


def block_key_map(cfg: dict, algorithm: str, *, keep_embed_head: bool = False) -> list[Entry]:
    """DFlash/DSpark (modeling/dspark.py names == SGLang DFlashDraftModel / Qwen3DSparkModel names)."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    k = len(_block_layer_ids(cfg))
    entries = [e for i in range(cfg["num_hidden_layers"]) for e in _qwen3_layer_entries(cfg, i)]
    entries += [Entry("fc.weight", "fc.weight", (h, k * h)), Entry("hidden_norm.weight", "hidden_norm.weight", (h,)),
                Entry("norm.weight", "norm.weight", (h,))]
    # Frozen target copies: SGLang shares the target's embedding and head; speculators checkpoints keep them.
    keep = "embed_tokens.weight" if keep_embed_head else None
    entries += [Entry("embed_tokens.weight", keep, (vocab, h), required=keep_embed_head),
                Entry("lm_head.weight", "lm_head.weight" if keep_embed_head else None, (vocab, h),
                      required=keep_embed_head)]
    rank = int(cfg.get("markov_rank", 0) or 0)
    if algorithm == "dflash":
        return entries
    if rank > 0:
        entries += [Entry("markov_head.markov_w1.weight", "markov_head.markov_w1.weight", (vocab, rank)),
                    Entry("markov_head.markov_w2.weight", "markov_head.markov_w2.weight", (vocab, rank))]
        head_type = cfg.get("markov_head_type", "vanilla")
        if head_type == "gated":
            entries += [Entry("markov_head.gate_proj.weight", "markov_head.gate_proj.weight", (rank, h + rank)),
                        Entry("markov_head.gate_proj.bias", "markov_head.gate_proj.bias", (rank,))]
        elif head_type == "rnn":
            entries += [Entry("markov_head.joint_proj.weight", "markov_head.joint_proj.weight",
                              (3 * rank, 2 * rank + h)),
                        Entry("markov_head.joint_proj.bias", "markov_head.joint_proj.bias", (3 * rank,))]
        elif head_type != "vanilla":
            raise ValueError(f"config markov_head_type {head_type!r} is not one of vanilla/gated/rnn")
    if cfg.get("enable_confidence_head"):
        with_markov = bool(cfg.get("confidence_head_with_markov", rank > 0))
        width = h + (rank if with_markov else 0)
        entries += [Entry("confidence_head.proj.weight", "confidence_head.proj.weight", (1, width)),
                    Entry("confidence_head.proj.bias", "confidence_head.proj.bias", (1,))]
    return entries


def eagle3_key_map(cfg: dict, *, target: str) -> list[Entry]:
    """Eagle3 (modeling/eagle3.py names == SGLang LlamaForCausalLMEagle3 names; speculators calls midlayer layers.0)."""
    h, hd, vocab = cfg["hidden_size"], _head_dim(cfg), cfg["vocab_size"]
    draft_vocab = cfg["draft_vocab_size"]
    target_h = cfg.get("target_hidden_size") or h
    num_aux = len(_eagle3_layer_ids(cfg))
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    first = "midlayer" if target == "sglang" else "layers.0"

    def layer(src_prefix: str, dst_prefix: str, in_features: int, fused: bool) -> list[Entry]:
        table = {
            "self_attn.q_proj.weight": (q, in_features), "self_attn.k_proj.weight": (kv, in_features),
            "self_attn.v_proj.weight": (kv, in_features), "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        }
        if fused:
            table["hidden_norm.weight"] = (h,)
        return [Entry(f"{src_prefix}.{k}", f"{dst_prefix}.{k}", s) for k, s in table.items()]

    entries = layer("midlayer", first, 2 * h, True)
    for i in range(1, cfg["num_hidden_layers"]):
        entries += layer(f"layers.{i}", f"layers.{i}", h, False)
    entries += [
        Entry("fc.weight", "fc.weight", (h, num_aux * target_h)),
        Entry("norm.weight", "norm.weight", (h,)),
        Entry("lm_head.weight", "lm_head.weight", (draft_vocab, h)),
        Entry("d2t", "d2t", (draft_vocab,), torch.int64),
        Entry("t2d", "t2d", (vocab,), torch.bool),
        # SGLang takes the target's embedding; speculators checkpoints carry it.
        Entry("embed_tokens.weight", "embed_tokens.weight" if target == "vllm" else None, (vocab, h),
              required=target == "vllm"),
    ]
    return entries


# ---------------------------------------------------------------------------------------------------------------------
# Config helpers


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


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


def detect_algorithm(cfg: dict) -> str:
    """eagle3 | dflash | dspark from config `architectures[0]` and the block-draft flags."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch == "LlamaForCausalLMEagle3":
        return "eagle3"
    if arch in ("Qwen3DSparkModel", "DFlashDraftModel"):
        rank = int(cfg.get("markov_rank", 0) or 0)
        one_plus_n = cfg.get("sample_from_anchor") is False
        if one_plus_n and rank == 0 and not cfg.get("enable_confidence_head"):
            return "dflash"
        return "dspark"
    raise ValueError(f"config architectures[0]={arch!r}: expected LlamaForCausalLMEagle3 or Qwen3DSparkModel")


def _anchor_first_refusal(cfg: dict) -> str:
    return (f"this draft uses the anchor-first block layout (sample_from_anchor={cfg.get('sample_from_anchor')!r}, "
            f"markov_rank={cfg.get('markov_rank', 0)}, enable_confidence_head={cfg.get('enable_confidence_head')}); "
            "SGLang DFLASH reads the 1+N layout (block_size = gamma+1, the anchor slot predicts nothing), so it would "
            "load and silently accept nothing. Anchor-first drafts export as DSPARK (Qwen3DSparkModel, "
            "block_size = gamma), with markov_rank=0 for a plain DFlash draft; only drafts trained with "
            "sample_from_anchor=False, markov_rank=0 and no confidence head may export as DFLASH")


def _check_serving_support(cfg: dict, algorithm: str, target: str) -> None:
    if algorithm == "dflash" and cfg.get("architectures", [None])[0] == "Qwen3DSparkModel":
        if cfg.get("sample_from_anchor") is not False or int(cfg.get("markov_rank", 0) or 0) != 0 \
                or cfg.get("enable_confidence_head"):
            raise ValueError(f"cannot export as DFLASH: {_anchor_first_refusal(cfg)}")
    if algorithm == "dspark":
        _require(cfg, "mask_token_id", "block_size")
        if target == "sglang" and int(cfg.get("markov_rank", 0) or 0) <= 0:
            raise ValueError("cannot export as SGLang DSPARK: markov_rank=0, and SGLang 0.5.23's Qwen3DSparkModel "
                             "raises 'DSpark draft requires markov_rank > 0'. A markov_rank=0 draft serves in SGLang "
                             "only as DFLASH, which needs the 1+N layout (sample_from_anchor=False)")
    if algorithm == "dflash":
        _require(cfg, "mask_token_id", "block_size")


# ---------------------------------------------------------------------------------------------------------------------
# Serving configs


def _base_transformer_config(cfg: dict, drop: tuple[str, ...]) -> dict:
    return {k: v for k, v in cfg.items() if k not in drop and not k.startswith("_") and k != "transformers_version"}


_BLOCK_KEYS = ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id", "markov_rank",
               "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor",
               "dflash_config", "auto_map")


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
    if algorithm == "dflash":
        out["architectures"] = ["DFlashDraftModel"]
        dflash["block_size"] = gamma + 1  # SGLang DFLASH: the full verify width of the 1+N block
        out["block_size"] = gamma + 1
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
        name = "DFlashSpeculator" if algorithm == "dflash" else "DSparkSpeculator"
        rank = int(cfg.get("markov_rank", 0) or 0)
        out = {"architectures": [name], "speculators_model_type": algorithm, "transformer_layer_config": layer,
               "draft_vocab_size": int(cfg["vocab_size"]),
               "aux_hidden_state_layer_ids": _vllm_layer_ids(_block_layer_ids(cfg)),
               "block_size": int(cfg["block_size"]), "mask_token_id": int(cfg["mask_token_id"]),
               "sample_from_anchor": bool(cfg.get("sample_from_anchor", True))}
        if algorithm == "dspark":
            out.update(markov_rank=rank, markov_head_type=cfg.get("markov_head_type", "vanilla"),
                       enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
                       confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", rank > 0)))
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
        if e.dst is not None:
            out[e.dst] = t.contiguous()
    return out


def _check_eagle3_mapping(cfg: dict, state: dict[str, torch.Tensor]) -> None:
    d2t, t2d = state["d2t"], state["t2d"]
    kept = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
    if int(t2d.sum()) != d2t.numel() or not torch.equal(kept, torch.nonzero(t2d).reshape(-1)):
        raise ValueError("key 'd2t' disagrees with 't2d': arange(draft_vocab_size) + d2t must be the ids where t2d")


def export_draft(checkpoint_dir, to: str, out_dir, *, algorithm: str | None = None, sts_path=None,
                 verifier: str | None = None, overwrite: bool = False) -> Path:
    """Export a trained draft folder to `to` ("sglang" | "vllm") at `out_dir`; returns the output path.

    algorithm: None picks it from the config (see module docstring); "dflash"/"dspark"/"eagle3" forces one (and is
    refused when the draft cannot serve that way). sts_path: a DSpark confidence calibration JSON to copy as sts.json
    (default: the checkpoint folder's sts.json when present). verifier: target model id written into vLLM's
    speculators_config. Raises ValueError on any mismatch; `out_dir` is then left untouched.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if to not in TARGETS:
        raise ValueError(f"--to must be one of {TARGETS}, got {to!r}")
    config_path, weights_path = checkpoint_dir / "config.json", checkpoint_dir / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: expected a draft folder written by training (config.json + "
                                    "model.safetensors)")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True / --overwrite)")
    cfg = json.loads(config_path.read_text())
    detected = detect_algorithm(cfg)
    algorithm = algorithm or detected
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if (algorithm == "eagle3") != (detected == "eagle3"):
        raise ValueError(f"a {cfg['architectures'][0]} draft cannot export as {algorithm.upper()}")
    _check_serving_support(cfg, algorithm, to)

    if algorithm == "eagle3":
        _require(cfg, "draft_vocab_size", "hidden_size", "vocab_size", "num_hidden_layers")
        entries = eagle3_key_map(cfg, target=to)
    else:
        _require(cfg, "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size")
        entries = block_key_map(cfg, algorithm, keep_embed_head=to == "vllm")
    state = load_file(str(weights_path))
    tensors = _validate(state, entries)  # shapes/dtypes first, so the mapping check sees well-formed tensors
    if algorithm == "eagle3":
        _check_eagle3_mapping(cfg, state)
    out_cfg = sglang_config(cfg, algorithm) if to == "sglang" else vllm_config(cfg, algorithm, verifier)

    sts = Path(sts_path) if sts_path is not None else checkpoint_dir / STS_FILENAME
    if sts_path is not None and not sts.is_file():
        raise FileNotFoundError(f"sts file {sts} not found")
    if sts.is_file():
        load_sts(sts)  # the eval stage's own reader: refuses what SGLang would misread, naming the file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if sts.is_file() and algorithm == "dspark":
            shutil.copyfile(sts, tmp / STS_FILENAME)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (checkpoint_dir / name).is_file():
                shutil.copyfile(checkpoint_dir / name, tmp / name)
        if out_dir.exists():  # overwrite=True: move the old export aside only once the new one is complete
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def serve_command(checkpoint_dir, to: str, out_dir, target: str | None = None, algorithm: str | None = None) -> str:
    """The command line that serves the export at `out_dir` (made from the trained draft in `checkpoint_dir`, as
    `algorithm`: the one export_draft was given, None when it detected it)."""
    from eval.live import sglang_command, vllm_command

    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    algorithm = algorithm or detect_algorithm(cfg)
    gamma = int(cfg.get("ttt_length", 7) if algorithm == "eagle3" else cfg["block_size"])
    target = target or "<target model path or id>"
    if to == "vllm":
        argv = vllm_command("python", target, Path(out_dir), algorithm, gamma, 8000, dtype="auto")
    else:
        sts = Path(out_dir) / "sts.json"
        argv = sglang_command("python", target, Path(out_dir), algorithm, gamma, 30000,
                              sts_path=sts if sts.is_file() else None)
    return " ".join(shlex.quote(a) for a in argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="export/main.py",
        description="Export a trained DraftSmith draft (config.json + model.safetensors) to a serving checkpoint. "
                    "SGLang 0.5.23: Eagle3 -> EAGLE3 (LlamaForCausalLMEagle3); DFlash with the 1+N layout -> DFLASH "
                    "(DFlashDraftModel, block_size = gamma+1); other block drafts -> DSPARK (Qwen3DSparkModel, "
                    "block_size = gamma). vLLM: a speculators-format folder (speculators_config). Every tensor is "
                    "checked by name, shape and dtype; on any error nothing is written to --out.")
    parser.add_argument("--checkpoint", required=True, type=Path, help="trained draft folder (config.json + "
                        "model.safetensors), e.g. runs/<name>/draft")
    parser.add_argument("--to", required=True, choices=TARGETS, help="serving engine format")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist unless --overwrite)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default=None,
                        help="force the serving algorithm (default: from the config; DFLASH only for 1+N drafts)")
    parser.add_argument("--sts", type=Path, default=None, help="DSpark confidence calibration JSON to ship as "
                        "sts.json (default: <checkpoint>/sts.json when present)")
    parser.add_argument("--verifier", default=None, help="target model id/path recorded in vLLM's speculators_config")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    try:
        out = export_draft(args.checkpoint, args.to, args.out, algorithm=args.algorithm, sts_path=args.sts,
                           verifier=args.verifier, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 2
    print(out)
    print(f"serve it with:\n  {serve_command(args.checkpoint, args.to, out, args.verifier, args.algorithm)}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
