"""Your own target in one command: what `train/main.py --target PATH_OR_ID --prompts FILE --family F` derives from the
target's config and tokenizer in place of a hand-written recipe's target-specific keys, each with its reason.

    picks = pick_for_target("meta-llama/Llama-3.2-1B-Instruct", "dspark", overrides=[], on_gpu=False)
    picks.fields     # {"target": {"layer_ids": [...], "dtype": ...}, "draft": {...}}: merged under the --set overrides
    picks.lines      # one printed line per pick: "target.layer_ids = [1, 4, 7, 10, 13]: ..."
    picks.refusals   # what could not be picked, each naming the --set that fixes it

The rules are the hand-written recipes' own, so that a known target gets what its recipe chose (tests/test_target_picks
checks SmolLM2's and Qwen3's): captured layers spread over 1..L-3 (DeepSpec's Qwen3 layers, z-lab DFlash's
`build_target_layer_ids`, SGLang's Eagle3 [2, L/2, L-3]); a MASK id no chat ever contains; the checkpoint's dtype
under the CPU rule load_target already has; a draft sized by the target's non-embedding parameters. A key a --set names
is not picked (and not refused): the user's value wins.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from core.recipe import BLOCK_FAMILIES, overridden
from modeling.anatomy import draft_dims
from modeling.target import chat_template_problem, load_tokenizer, resolve_target

#: block drafters capture DeepSpec's five target layers; Eagle3 three (low, middle, high), SGLang's convention.
BLOCK_LAYERS, EAGLE3_LAYERS = 5, 3
#: a target with at least this many non-embedding parameters gets DeepSpec's draft (5 layers, Markov rank 256: chosen
#: for Qwen3-4B..14B; DFlash2's selector rank alike, speculators' default); a smaller one the SmolLM2 recipes' (2
#: layers, rank 64, Eagle3 vocabulary 8192), so the draft stays a small share of the target's cost (DSpark paper
#: Fig. 3: a 2-layer DSpark beats a 5-layer DFlash).
LARGE_TARGET_PARAMS = 1_000_000_000
LARGE_DRAFT = {"num_layers": 5, "rank": 256, "draft_vocab_size": 32000}
SMALL_DRAFT = {"num_layers": 2, "rank": 64, "draft_vocab_size": 8192}
#: the family's low-rank table over the vocabulary, sized by the rank above
RANK_KEYS = {"dspark": "markov_rank", "dflash2": "selector_rank"}
_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
          {"role": "user", "content": "v"}]


@dataclass
class Picks:
    fields: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    def pick(self, key: str, value, why: str) -> None:
        section, name = key.split(".")
        self.fields.setdefault(section, {})[name] = value
        self.lines.append(f"{key} = {value}: {why}")


def spread(lo: int, hi: int, count: int) -> list[int]:
    """`count` ids evenly spaced over lo..hi, both ends included, rounded half up (the recipes' rounding: SmolLM2's
    30 layers give [1, 8, 14, 21, 27]; Python's round() would give 20 for 20.5)."""
    if count == 1:
        return [(lo + hi) // 2]
    return sorted({math.floor(lo + i * (hi - lo) / (count - 1) + 0.5) for i in range(count)})


def pick_layer_ids(num_layers: int, family: str) -> tuple[list[int] | None, str]:
    """The captured layers and why; None when the target is too shallow. Never the last decoder layer: the engines
    capture layer k as layer k+1's input, and the export refuses it."""
    if num_layers < 2:
        return None, f"the target has {num_layers} decoder layer(s); a drafter reads a layer below the last"
    count = BLOCK_LAYERS if family in BLOCK_FAMILIES else EAGLE3_LAYERS
    lo, hi = (1, num_layers - 3) if family in BLOCK_FAMILIES else (2, num_layers - 3)
    if hi - lo + 1 >= count:
        if family in BLOCK_FAMILIES:
            return spread(lo, hi, count), (f"{count} layers evenly over 1..L-3 of the target's {num_layers} decoder "
                                           f"layers (DeepSpec's Qwen3 layers, z-lab DFlash's rule)")
        return [lo, num_layers // 2, hi], (f"low, middle, high: [2, L/2, L-3] of the target's {num_layers} decoder "
                                           f"layers (SGLang's Eagle3 convention, the Qwen3 recipes')")
    ids = spread(0, num_layers - 2, min(count, num_layers - 1))
    return ids, (f"the target's {num_layers} decoder layers are too few for {count} over 1..L-3: {len(ids)} evenly "
                 f"over 0..L-2 (never the last layer, which the engines cannot capture)")


def pick_mask_token(tokenizer, vocab_size: int, eos_ids: set[int]) -> tuple[int | None, str]:
    """A block drafter's MASK id, and why: an id inside the target's vocabulary (SGLang reads its embedding from the
    target's embed_tokens) that no chat contains. In order: the tokenizer's own mask token (Gemma's <mask>, DeepSpec's
    Gemma4 choice); the first embedding row past the tokenizer (no text produces it; DeepSpec's 151669 for Qwen3); a
    reserved special token; another special token the chat template never renders (SmolLM2's <|endoftext|>, 0)."""
    mask = tokenizer.mask_token_id
    if mask is not None and 0 <= mask < vocab_size:
        return mask, f"the tokenizer's own mask token {tokenizer.mask_token!r}"
    if len(tokenizer) < vocab_size:
        return len(tokenizer), (f"the first embedding row past the tokenizer's {len(tokenizer)} tokens (vocabulary "
                                f"{vocab_size}): no text produces it (DeepSpec's choice for Qwen3)")
    try:
        rendered = set(tokenizer.apply_chat_template(_PROBE, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False))
    except Exception:  # a template that refuses a system turn: without it
        rendered = set(tokenizer.apply_chat_template(_PROBE[1:], tokenize=True, add_generation_prompt=True,
                                                     return_dict=False))
    special = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    unused = sorted(i for i in special if i < vocab_size and i not in rendered and i not in eos_ids
                    and i != tokenizer.pad_token_id)
    reserved = [i for i in unused if re.search(r"reserved|unused", special[i], re.IGNORECASE)]
    if reserved:
        return reserved[0], f"a reserved special token, {special[reserved[0]]!r}: no chat contains it"
    if unused:
        return unused[0], (f"special token {special[unused[0]]!r}, which the chat template never renders and is not "
                           f"an end-of-turn token (the SmolLM2 recipes' choice)")
    return None, "the tokenizer has no mask token, no reserved row past it and no special token a chat leaves unused"


def pick_dtype(checkpoint_dtype: str | None, on_gpu: bool) -> tuple[str, str]:
    """target.dtype: the checkpoint's own half precision on a GPU; float32 on a CPU (load_target's rule: a CPU
    without bf16 matrix units emulates bf16; training's precision auto still autocasts to bf16 where it has them)."""
    if on_gpu and checkpoint_dtype in ("bfloat16", "float16"):
        return checkpoint_dtype, "the checkpoint's own dtype"
    if on_gpu:
        return "bfloat16", f"the checkpoint is {checkpoint_dtype or 'of no declared dtype'}; bf16 on a GPU (SGLang's " \
                           f"kernels run no float32)"
    return "float32", (f"the checkpoint is {checkpoint_dtype or 'of no declared dtype'}; on a CPU the target runs in "
                       f"float32 (train.precision auto autocasts to bf16 where the CPU has bf16 matrix units)")


def non_embedding_params(config) -> int:
    """The target's parameter count without its embedding and head, counted on the meta device (no memory, any
    architecture, experts included)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError):  # an architecture transformers does not build: the dense estimate
        dims = draft_dims(config)
        return 12 * (dims["num_hidden_layers"] or 1) * dims["hidden_size"] ** 2
    embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
                  for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)


def pick_draft_size(params: int, num_layers: int, hidden: int, family: str, vocab_size: int) -> dict:
    """{draft key: (value, why)} for the draft's size."""
    large = params >= LARGE_TARGET_PARAMS
    size, tier = (LARGE_DRAFT, "DeepSpec's, for a target of >= 1B") if large else \
        (SMALL_DRAFT, "the SmolLM2 recipes', for a target under 1B")
    why = f"the target has {params / 1e6:,.1f}M non-embedding parameters: {tier}"
    if family == "eagle3":
        vocab = min(size["draft_vocab_size"], vocab_size)
        return {"draft_vocab_size": (vocab, f"{why} (at most the target's vocabulary {vocab_size})")}
    picked = {"num_layers": (min(size["num_layers"], num_layers), f"{why} (at most the target's {num_layers} layers)")}
    if family in RANK_KEYS:
        picked[RANK_KEYS[family]] = (min(size["rank"], hidden), f"{why} (at most the target's width {hidden})")
    return picked


def _eos_ids(config, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(config, "text_config", config), "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return {i for i in ids if i is not None}


def pick_for_target(name_or_path: str, family: str, overrides: list[str], on_gpu: bool) -> Picks:
    """Every pick for `family` beside this target, skipping the keys `overrides` (--set) name."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_target(name_or_path))
    text = getattr(config, "text_config", config)
    dims = draft_dims(config)  # under whatever keys the config names them (GPT-2's n_layer, n_embd)
    picks = Picks()

    def free(key: str) -> bool:
        return not overridden(overrides, key)

    template = next((item.split("=", 1)[1] for item in reversed(overrides)  # the last --set wins, as in the recipe
                     if item.split("=", 1)[0].strip() == "target.chat_template"), None)
    try:
        template = yaml.safe_load(template) if template and template.strip() else None
    except yaml.YAMLError as exc:
        picks.refusals.append(f"--set target.chat_template: the value is not valid YAML ({exc.problem}); quote it")
        template = None
    if template is not None and (problem := chat_template_problem(template)):
        picks.refusals.append(f"target.chat_template: {problem}")
        template = None
    try:
        tokenizer = load_tokenizer(name_or_path, template)
    except (OSError, ValueError) as exc:  # transformers' "...sentencepiece or tiktoken installed" names no file
        picks.refusals.append(f"{name_or_path}: no tokenizer can be loaded from it ({str(exc).splitlines()[0]}): "
                              f"a target folder holds its tokenizer's files (tokenizer.json, tokenizer_config.json)")
        return picks
    if template:
        picks.lines.append(f"target.chat_template = {template}: from --set (the tokenizer's own is replaced)")
    elif tokenizer.chat_template:
        picks.lines.append(f"chat template: the tokenizer's own ({len(tokenizer.chat_template):,} characters)")
    else:
        picks.refusals.append(f"{name_or_path}'s tokenizer has no chat template (a base model?): use its instruct "
                              f"model, or --set target.chat_template=FILE (a Jinja chat template file)")
    if free("target.layer_ids"):
        ids, why = pick_layer_ids(dims["num_hidden_layers"], family)
        if ids is None:
            picks.refusals.append(f"target.layer_ids: {why}: --set target.layer_ids=[...] names the layers to read")
        else:
            picks.pick("target.layer_ids", ids, why)
    if free("target.dtype"):
        checkpoint = getattr(text, "dtype", None)
        picks.pick("target.dtype", *pick_dtype(None if checkpoint is None else str(checkpoint).removeprefix("torch."),
                                               on_gpu))
    if family in BLOCK_FAMILIES and free("draft.mask_token_id") and tokenizer.chat_template:
        mask, why = pick_mask_token(tokenizer, dims["vocab_size"], _eos_ids(config, tokenizer))
        if mask is None:
            picks.refusals.append(f"draft.mask_token_id: {why}: --set draft.mask_token_id=ID names an id of the "
                                  f"target's vocabulary (0..{dims['vocab_size'] - 1}) that no chat contains")
        else:
            picks.pick("draft.mask_token_id", mask, why)
    picks.lines.append(f"draft width = {dims['hidden_size']}: the target's own (the draft reads its states and shares its "
                       f"embedding and lm_head)")
    params = non_embedding_params(config)
    for key, (value, why) in pick_draft_size(params, dims["num_hidden_layers"], dims["hidden_size"], family,
                                             dims["vocab_size"]).items():
        if free(f"draft.{key}"):
            picks.pick(f"draft.{key}", value, why)
    return picks
