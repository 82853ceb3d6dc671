"""Where a loaded causal LM keeps what DraftSmith reads of it, found on the model itself, not by one attribute name or
config key: its backbone (the module that returns the final-norm state), its decoder stack (Llama's `.model.layers`,
GPT-NeoX's `.gpt_neox.layers`, GPT-2's `.transformer.h`, OPT's `.model.decoder.layers`), its final norm (`norm`,
`final_layer_norm`, `ln_f`, LFM2's `embedding_norm`, or none), that norm's kind and epsilon read off the module, and
the dimensions a drafter takes from the target (`draft_dims`).

    layers = decoder_layers(model)          # the stack, wherever the base model keeps it
    norm = final_norm(model)                # None: the last layer's output is the final state (no final norm)
    dims = draft_dims(model)                # or draft_dims(config): what a draft's config copies

What is found here by structure is checked by behaviour in modeling/preflight.py: the norm turns the last layer's output
into the backbone's output, the model attends only backwards, its cache reproduces an uncached forward.
"""

from __future__ import annotations

import torch

# The attribute names a final norm goes by, in the order they are preferred when a module holds more than one norm.
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm", "out_norm", "ln_out",
                    "layer_norm", "layernorm", "embedding_norm")
# Where a norm module keeps its epsilon, and the config keys that name it when the module does not.
_EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")
_EPS_CONFIG_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps")
DEFAULT_NORM_EPS = 1e-6


class AnatomyError(ValueError):
    """The model lacks a part DraftSmith reads, or holds it where it cannot be told apart; the message names it."""


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def backbone(model) -> torch.nn.Module:
    """The base model under a causal LM's head: the module whose output's `last_hidden_state` is the final-norm state
    (`base_model_prefix` names it: `model`, `gpt_neox`, `transformer`, `backbone`, ...)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, torch.nn.Module) or base is model:
        base = getattr(model, "model", None)
    return base if isinstance(base, torch.nn.Module) else model


def _layer_count(model) -> int | None:
    value = getattr(text_config(model.config), "num_hidden_layers", None) if hasattr(model, "config") else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def stack_name(model) -> str:
    """The dotted name, under the backbone, of the decoder stack: the shallowest ModuleList as long as the config's
    layer count (the longest one when none is). AnatomyError when there is none, or two at one depth."""
    base = backbone(model)
    lists = [(name, module) for name, module in base.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) and name]
    count = _layer_count(model)
    fits = [(name, m) for name, m in lists if len(m) == count] if count else []
    if not fits:  # a config that counts its layers under another key (BART's decoder_layers)
        longest = max((len(m) for _, m in lists), default=0)
        fits = [(name, m) for name, m in lists if len(m) == longest]
    if not fits:
        raise AnatomyError(f"{type(model).__name__} has no decoder stack: no list of layers under "
                           f"{type(base).__name__}")
    depth = min(name.count(".") for name, _ in fits)
    shallowest = [name for name, _ in fits if name.count(".") == depth]
    if len(shallowest) > 1:
        raise AnatomyError(f"{type(model).__name__} has {len(shallowest)} stacks of {len(fits[0][1])} layers "
                           f"({', '.join(shallowest)}): which one carries the residual stream cannot be told")
    return shallowest[0]


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers, in order: layer i's output is HF layer-output id i (the residual stream)."""
    return backbone(model).get_submodule(stack_name(model))


def _is_norm(module: torch.nn.Module, width: int | None) -> bool:
    """A norm module of the model's width (OLMo's LayerNorm has no weight: a norm all the same)."""
    weight = getattr(module, "weight", None)
    named = "norm" in type(module).__name__.lower() or isinstance(module, torch.nn.LayerNorm)
    return named and (weight is None or isinstance(weight, torch.Tensor) and weight.dim() == 1
                      and (width is None or weight.shape[0] == width))


def final_norm(model) -> torch.nn.Module | None:
    """The norm the backbone applies after its last layer, beside the stack in the module that holds it: the one with
    a final norm's name (FINAL_NORM_NAMES order), else the last norm registered after the stack; None when there is
    none (GPT-1's post-norm blocks end in their own norm). modeling/preflight.py checks it on a forward."""
    base = backbone(model)
    name = stack_name(model)
    parent = base.get_submodule(name.rpartition(".")[0]) if "." in name else base
    leaf = name.rpartition(".")[2]
    width = getattr(text_config(model.config), "hidden_size", None) if hasattr(model, "config") else None
    children = list(parent.named_children())
    after = [n for n, _ in children[[n for n, _ in children].index(leaf) + 1:]]
    norms = {n: m for n, m in children if _is_norm(m, width)}
    for wanted in FINAL_NORM_NAMES:
        if wanted in norms:
            return norms[wanted]
    later = [n for n in after if n in norms]
    return norms[later[-1]] if later else None


def norm_eps(norm: torch.nn.Module | None, config=None) -> float:
    """The epsilon a norm module adds to the variance (its own attribute, whatever it is called), else the config's
    (rms_norm_eps, layer_norm_eps, layer_norm_epsilon, norm_epsilon), else DEFAULT_NORM_EPS."""
    for attribute in _EPS_ATTRIBUTES:
        value = getattr(norm, attribute, None) if norm is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    text = text_config(config) if config is not None else None
    for key in _EPS_CONFIG_KEYS:
        value = getattr(text, key, None) if text is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return DEFAULT_NORM_EPS


@torch.no_grad()
def norm_kind(norm: torch.nn.Module | None, width: int) -> str:
    """"layernorm" when the norm subtracts the mean (its output does not move when every input moves by one constant),
    "rmsnorm" when it does not, "none" without one: read off what the module does, not its class name."""
    if norm is None:
        return "none"
    param = next(norm.parameters(), None)
    x = torch.linspace(-2.0, 3.0, width, dtype=param.dtype if param is not None else torch.float32,
                       device=param.device if param is not None else "cpu")
    return "layernorm" if torch.allclose(norm(x), norm(x + 5.0), rtol=1e-2, atol=1e-2) else "rmsnorm"


@torch.no_grad()
def norm_scale(norm: torch.nn.Module) -> torch.Tensor:
    """The per-channel factor a target's norm multiplies the normalised state by, read off the module itself: its
    weight for Llama's, Qwen3's and a LayerNorm's, 1 + weight for Gemma 3's and Qwen3-Next's (zero-centred weights).
    An input of +-1e4 in turn has mean 0 and normalises to +-1 under an RMSNorm and a LayerNorm alike (the eps beside
    its square is lost), and half the difference of the outputs for it and its negation is the factor (a LayerNorm's
    bias cancels), up to rounding: the weight itself where that is what it is (Llama's, bit for bit)."""
    weight = norm.weight
    signs = torch.ones(weight.shape, dtype=weight.dtype, device=weight.device)
    signs[1::2] = -1
    scale = ((norm(signs * 1e4) - norm(signs * -1e4)) / (2 * signs)).to(weight.dtype)
    return weight if torch.allclose(scale, weight, rtol=1e-3, atol=1e-3) else scale


def _first(config, *keys):
    for key in keys:
        try:
            value = getattr(config, key, None)
        except RuntimeError:  # Gemma 4's head_dim differs by layer: no one value to give
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def draft_dims(target) -> dict:
    """What a drafter's config takes from the target (a loaded model, or its config alone): widths and vocabulary
    from the config (and the embedding, where a config does not say), the layer count from the stack, the norm's
    epsilon from the final norm module. Keys a target's config may lack get what a drafter needs: attention heads of
    64 (a state-space model has none), an MLP 4x the width, 32,768 positions."""
    model = target if isinstance(target, torch.nn.Module) else None
    config = text_config(model.config if model is not None else target)
    embed = model.get_input_embeddings() if model is not None else None
    hidden = _first(config, "hidden_size") or (embed.embedding_dim if embed is not None else None)
    vocab = _first(config, "vocab_size") or (embed.num_embeddings if embed is not None else None)
    if hidden is None or vocab is None:
        raise AnatomyError(f"{type(config).__name__} names no hidden_size or vocab_size, and no embedding says them")
    heads = _first(config, "num_attention_heads")
    if heads is None or hidden % heads:
        heads = max(1, hidden // 64)
    kv_heads = _first(config, "num_key_value_heads") if heads == _first(config, "num_attention_heads") else None
    head_dim = _first(config, "head_dim") or hidden // heads
    norm = final_norm(model) if model is not None else None
    layers = len(decoder_layers(model)) if model is not None else _first(config, "num_hidden_layers")
    mlp = _first(config, "intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim") or 4 * hidden
    return {"hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": layers, "intermediate_size": mlp,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads if kv_heads and heads % kv_heads == 0 else heads, "head_dim": head_dim,
            "max_position_embeddings": _first(config, "max_position_embeddings") or 32768,
            "norm_eps": norm_eps(norm, config)}
