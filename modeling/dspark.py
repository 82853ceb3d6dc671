"""DSpark drafter (and DFlash, which is DSpark with markov_rank=0 and the confidence head off; DFlash2 is DFlash plus
the candidate selector of modeling/selector.py, config.selector_rank > 0).

What it is
    A block drafter: one non-causal pass over a block [x_a, MASK, MASK, ...] anchored at position a proposes gamma
    tokens x_{a+1..a+gamma} at once. The block's keys/values are prefixed by the target's own context features:
    H_ctx = hidden_norm(fc([h_l1; ...; h_lK])), the K captured target layer outputs fused into one H-wide state and fed
    to every draft layer ("KV injection"). DSpark adds two small heads on top of the DFlash backbone:
      * a Markov head: a rank-r bigram bias W2 W1[x_{k-1}] added to the logits of prediction k (plus `gated` and `rnn`
        variants), which lets the k-th draft depend on the (sampled) (k-1)-th one;
      * a confidence head: sigma(proj([h_k; W1[x_{k-1}]])) estimates P(draft k accepted | drafts < k accepted).
    Parameter names are the serving names (no `model.` prefix): `embed_tokens`, `layers.{i}.*`, `norm`, `fc`,
    `hidden_norm`, `lm_head`, `markov_head.*`, `confidence_head.proj`, so the state dict is what SGLang's
    `Qwen3DSparkModel` / vLLM's `qwen3_dspark` load. `embed_tokens` and `lm_head` are frozen copies of the target's.

Block layouts (`config.sample_from_anchor`)
    anchor-first (True, DeepSpec, SGLang DSPARK): input [x_a, MASK x (gamma-1)] at positions a..a+gamma-1, every slot
        predicts, slot j -> token a+j+1.
    1+N (False, z-lab DFlash, SGLang DFLASH): input [x_a, MASK x gamma] at positions a..a+gamma, slot 0 only conditions,
        slot j (j >= 1) -> token a+j.
    `forward` always returns the gamma prediction states ordered k = 1..gamma (prediction k targets token a+k), so
    callers never index slots: label_k = input_ids[a+k], distillation target state = last_hidden_state[a+k-1],
    Markov previous token prev_k = input_ids[a+k-1] (k=1: the anchor). `block_targets` builds exactly these.

How it is used (training)
    config = build_dspark_config(target, num_layers=5, block_size=7, target_layer_ids=[1, 9, 17, 25, 33],
                                 mask_token_id=151669, markov_rank=256, markov_head_type="vanilla",
                                 enable_confidence_head=True, sample_from_anchor=True)
    draft = DSparkModel.from_target(config, target)                       # frozen embed/lm_head copies
    anchors = sample_anchor_positions(loss_mask, 512, generator)          # [B, A], -1 = padding
    labels, prev_ids, target_pos, valid = block_targets(input_ids, loss_mask, anchors, config.block_size)
    h = draft(input_ids, target_hidden, anchors, attention_mask)          # [B, A, gamma, H]
    logits = draft.draft_logits(h, prev_ids)                              # teacher-forced Markov bias
    conf = draft.confidence_logits(h, prev_ids)                           # [B, A, gamma]

Attention: a block query sees context kv < a (the anchor's own target state does not exist yet at inference, since
x_a is the token the target just emitted), only real (non-padded) positions, plus its whole block bidirectionally.
Two implementations of that mask: a dense boolean mask for SDPA (CPU, reference) and a flex_attention BlockMask
(GPU). On CPU flex_attention runs eagerly but has no backward, so CPU training uses SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from modeling.cpu_linear import fast_linear
from modeling.selector import CandidateSelector
from modeling.anatomy import draft_dims, text_config
from modeling.target import COPIED_PROJECTIONS, copied_layer, decoder_layers, draft_rope, init_fc_and_norm

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
INIT_STD = 0.02

# ---------------------------------------------------------------------------------------------------------------------
# Config


def build_dspark_config(
    target,
    *,
    num_layers: int,
    block_size: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    markov_rank: int = 0,
    markov_head_type: str = "vanilla",
    enable_confidence_head: bool = False,
    sample_from_anchor: bool = True,
    selector_rank: int = 0,
    selector_top_k: int = 16,
) -> Qwen3Config:
    """A Qwen3Config for the draft: dims from the target (a loaded model, or its config: modeling/anatomy.draft_dims),
    DSpark keys at top level.

    `block_size` is gamma, the number of tokens proposed per round (SGLang DSPARK's meaning, whatever the layout).
    `target_layer_ids` are HF layer-output ids (0-based decoder layer outputs; serving engines add +1 internally).
    """
    src = text_config(target.config if isinstance(target, torch.nn.Module) else target)
    dims = draft_dims(target)
    num_target_layers = dims["num_hidden_layers"]
    if num_layers < 1 or block_size < 1:
        raise ValueError(f"num_layers ({num_layers}) and block_size ({block_size}) must be >= 1")
    ids = [int(i) for i in target_layer_ids]
    if not ids or any(not 0 <= i < num_target_layers for i in ids):
        raise ValueError(f"target_layer_ids {ids} must be non-empty HF layer-output ids in 0..{num_target_layers - 1}")
    if not 0 <= mask_token_id < dims["vocab_size"]:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target vocabulary (size {dims['vocab_size']})")
    if markov_rank < 0 or markov_head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(f"markov_rank must be >= 0 and markov_head_type one of {MARKOV_HEAD_TYPES}")
    config = Qwen3Config(
        vocab_size=dims["vocab_size"],
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"],
        head_dim=dims["head_dim"],
        hidden_act="silu",  # the drafter's own MLP, whatever the target's: the engines' draft classes run silu only
        max_position_embeddings=dims["max_position_embeddings"],
        rms_norm_eps=dims["norm_eps"],
        rope_parameters=draft_rope(src),
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        layer_types=["full_attention"] * num_layers,
        tie_word_embeddings=False,
        bos_token_id=getattr(src, "bos_token_id", None),
        eos_token_id=getattr(src, "eos_token_id", None),
        pad_token_id=getattr(src, "pad_token_id", None),
        architectures=["Qwen3DSparkModel"],
    )
    # Top-level attributes: SGLang's Qwen3DSparkModel constructor reads markov_* at top level (not nested).
    config.block_size = int(block_size)
    config.target_layer_ids = ids
    config.num_target_layers = int(num_target_layers)
    config.mask_token_id = int(mask_token_id)
    config.markov_rank = int(markov_rank)
    config.markov_head_type = markov_head_type
    config.enable_confidence_head = bool(enable_confidence_head)
    config.confidence_head_with_markov = markov_rank > 0
    config.sample_from_anchor = bool(sample_from_anchor)
    config.selector_rank, config.selector_top_k = int(selector_rank), int(selector_top_k)  # DFlash2 (rank 0: none)
    return config


def block_length(gamma: int, sample_from_anchor: bool) -> int:
    """Slots per block of a draft proposing gamma tokens: gamma anchor-first, gamma + 1 in the 1+N layout (the anchor
    slot makes no prediction). The model, and the export's configs that count slots (SGLang DFLASH, speculators)."""
    return gamma if sample_from_anchor else gamma + 1


# ---------------------------------------------------------------------------------------------------------------------
# Attention masks. Query q belongs to block q // block_len; kv index j < T is context position j, j >= T is block slot
# j - T. Padding anchors (-1) are treated as anchor 0, i.e. no context: their own block keeps every row non-empty,
# so SDPA never sees an all-masked row (which would give NaN).


def dense_block_mask(anchor_positions: torch.Tensor, attention_mask: torch.Tensor, block_len: int) -> torch.Tensor:
    """Boolean [B, A*block_len, T + A*block_len]; True = may attend."""
    batch, num_anchors = anchor_positions.shape
    seq = attention_mask.shape[1]
    device = anchor_positions.device
    anchors = anchor_positions.clamp(min=0)
    q_block = torch.arange(num_anchors * block_len, device=device) // block_len  # [Q]
    q_anchor = anchors[:, q_block]  # [B, Q]
    kv = torch.arange(seq, device=device)
    ctx = (kv[None, None, :] < q_anchor[:, :, None]) & attention_mask.bool()[:, None, :]
    own = (q_block[:, None] == q_block[None, :]).expand(batch, -1, -1)
    return torch.cat([ctx, own], dim=-1)


def block_mask_mod(anchor_positions: torch.Tensor, attention_mask: torch.Tensor, block_len: int):
    """The same predicate as `dense_block_mask`, as a flex_attention mask_mod(b, h, q_idx, kv_idx)."""
    anchors = anchor_positions.clamp(min=0)
    real = attention_mask.bool()
    seq, last_block = real.shape[1], max(anchors.shape[1] - 1, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        # create_block_mask may probe indices past Q/KV (it rounds up to its block size): clamp every lookup.
        q_block = (q_idx // block_len).clamp(max=last_block)
        in_ctx = kv_idx < seq
        ctx_ok = in_ctx & (kv_idx < anchors[b, q_block]) & real[b, kv_idx.clamp(max=seq - 1)]
        own_ok = (~in_ctx) & ((kv_idx - seq) // block_len == q_idx // block_len)
        return ctx_ok | own_ok

    return mask_mod


def flex_block_mask(anchor_positions: torch.Tensor, attention_mask: torch.Tensor, block_len: int):
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_anchors = anchor_positions.shape
    q_len = num_anchors * block_len
    mask_mod = block_mask_mod(anchor_positions, attention_mask, block_len)
    return create_block_mask(mask_mod, batch, None, q_len, attention_mask.shape[1] + q_len,
                             device=anchor_positions.device)


_COMPILED_FLEX = None


def _flex_attention(q, k, v, block_mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    if q.device.type != "cuda":  # eager flex (unfused, forward only) is enough for CPU checks
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    if _COMPILED_FLEX is None:  # eager flex materialises the whole score matrix; the fused kernel needs compile
        # torch's default (static first, automatically dynamic after a shape change). Not used on CPU: there,
        # inductor's C++ flex template fails to build once shapes turn dynamic (torch 2.14).
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


# ---------------------------------------------------------------------------------------------------------------------
# Backbone


class DSparkAttention(nn.Module):
    """Qwen3 attention (q/k norm, RoPE, GQA) whose keys/values are [context; block] and whose queries are the block."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        hidden, self.head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor):
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        return k, self.v_proj(x).view(shape).transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor, rope_ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the context features: the block's own k/v projections and k_norm (the paper's KV injection,
        eq. 3), RoPE at the context positions. A position's pair never changes, so inference caches it."""
        k, v = self.project_kv(ctx)
        # apply_rotary_pos_emb rotates a pair with one table; the second copy is thrown away (cheap: T x kv_heads).
        k, _ = apply_rotary_pos_emb(k, k, *rope_ctx)
        return k, v

    def forward(self, x, context_kv, rope_block, mask, attn_impl: str):
        """x: the block [B, Q, H]; context_kv: `context_kv(...)` of the context it may see. mask None = every context
        key is visible (inference, where the cache holds exactly the positions before the anchor)."""
        batch, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k_ctx, v_ctx = context_kv
        k_blk, v_blk = self.project_kv(x)
        q, k_blk = apply_rotary_pos_emb(q, k_blk, *rope_block)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if attn_impl == "flex":
            out = _flex_attention(q, k, v, mask, self.scaling)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                                 scale=self.scaling, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class DSparkDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer; the context features enter only through the attention's keys/values."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DSparkAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.dropout = 0.0  # on the residual branches while training (train.dropout); not a config key

    def forward(self, x, context_kv, rope_block, mask, attn_impl):
        # H_ctx is already normalised by hidden_norm, so only the block goes through input_layernorm.
        attn = self.self_attn(self.input_layernorm(x), context_kv, rope_block, mask, attn_impl)
        x = x + F.dropout(attn, self.dropout, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), self.dropout, self.training)


# ---------------------------------------------------------------------------------------------------------------------
# Heads


def output_rows(linear: nn.Linear, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`linear(x)`, or only its outputs `rows` (a bias-free head's columns: training over a reduced vocabulary)."""
    return linear(x) if rows is None else fast_linear(x, linear.weight[rows])


class MarkovHead(nn.Module):
    """Rank-r bias on the logits of prediction k from the previous token x_{k-1}; e_k = W1[x_{k-1}].

    vanilla: bias_k = W2 e_k.
    gated:   g_k = sigmoid(gate_proj([h_k; e_k])) (r-wide, with bias), bias_k = W2 (g_k * e_k): the draft state decides
             per dimension how much of the bigram signal to trust.
    rnn:     paper Eq. 6, a gated recurrent state over the block, left to right, s_0 = 0:
             [g; c; o] = joint_proj([s_{k-1}; e_k; h_k]) (3r-wide, with bias),
             s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c), bias_k = W2 tanh(o).
             sigmoid(g) is the share of the old state kept. The bias of step k reads s_{k-1} only through `o`; the
             new state s_k feeds step k+1. This is what SGLang's `RNNHead` (and DeepSpec, speculators) compute from
             the same weights, so an exported rnn head drafts from the distribution it was trained on.
    In training prev_ids are the true tokens (teacher forcing); at inference the sampled drafts.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, head_type: str):
        super().__init__()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type '{head_type}' not in {MARKOV_HEAD_TYPES}")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def forward(self, h: torch.Tensor, prev_ids: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[..., gamma, H], [..., gamma] -> bias [..., gamma, V] (or [..., gamma, len(vocab_ids)]: those rows only)."""
        return output_rows(self.markov_w2, self.features(h, prev_ids), vocab_ids)

    def features(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., gamma, H], [..., gamma] -> [..., gamma, r]: what W2 maps to the bias (every head type ends in W2)."""
        e = self.markov_w1(prev_ids)
        if self.head_type == "gated":
            e = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e
        elif self.head_type == "rnn":
            state = e.new_zeros(e.shape[:-2] + (self.rank,))
            outputs = []
            for k in range(e.shape[-2]):
                g, c, o = self.joint_proj(torch.cat([state, e[..., k, :], h[..., k, :]], dim=-1)).chunk(3, dim=-1)
                keep = torch.sigmoid(g)
                state = keep * state + (1 - keep) * torch.tanh(c)
                outputs.append(torch.tanh(o))
            e = torch.stack(outputs, dim=-2)
        return e


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k; W1[x_{k-1}]])) (or proj(h_k) without a Markov head): P(accept k | prefix accepted)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


# ---------------------------------------------------------------------------------------------------------------------
# Model


@dataclass
class ContextCache:
    """Per-layer keys/values of the context positions 0..length-1 (k_norm and RoPE applied), for inference."""

    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    length: int = 0


class DSparkModel(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        hidden, vocab = config.hidden_size, config.vocab_size
        self.block_size = config.block_size  # gamma
        self.block_len = block_length(config.block_size, config.sample_from_anchor)
        self.mask_token_id = config.mask_token_id
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # non-persistent buffers only: nothing in the state dict
        # The target ids drafts are chosen among (None: all): the loss vocabulary a recipe trained over
        # (loss.vocab_size), outside which the head learned nothing. Kept beside the weights as token_map.pt
        # (modeling/registry.py), not in the state dict the serving engines load.
        self.register_buffer("draft_vocab", None, persistent=False)
        rank = config.markov_rank
        # DFlash (rank 0, no confidence head) must have no extra parameters at all, so the heads are None, not empty.
        self.markov_head = MarkovHead(hidden, vocab, rank, config.markov_head_type) if rank > 0 else None
        self.confidence_head = (
            ConfidenceHead(hidden + (rank if config.confidence_head_with_markov else 0))
            if config.enable_confidence_head else None
        )
        rank = getattr(config, "selector_rank", 0)  # configs from before DFlash2 have no key: no selector
        self.candidate_selector = (CandidateSelector(hidden, vocab, rank, config.selector_top_k) if rank > 0
                                   else None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, 0.02) for every Linear/Embedding weight, zero biases, unit norms; draws from the global RNG."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, INIT_STD)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, Qwen3RMSNorm):
                module.weight.fill_(1.0)
        if self.candidate_selector is not None:  # its tables are parameters, not modules
            self.candidate_selector.reset_parameters()

    @classmethod
    def from_target(cls, config: Qwen3Config, target_model) -> "DSparkModel":
        """A fresh draft whose embed_tokens/lm_head are frozen copies of the target's (tied or not)."""
        model = cls(config)
        embed = target_model.get_input_embeddings().weight
        head = target_model.get_output_embeddings().weight
        if embed.shape != model.embed_tokens.weight.shape or head.shape != model.lm_head.weight.shape:
            raise ValueError(f"target embed {tuple(embed.shape)} / lm_head {tuple(head.shape)} do not match the draft "
                             f"config (vocab {config.vocab_size}, hidden {config.hidden_size})")
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
            model.lm_head.weight.copy_(head)
        # Frozen: serving engines use the target's own embedding and head, so training must not move ours.
        model.embed_tokens.weight.requires_grad_(False)
        model.lm_head.weight.requires_grad_(False)
        return model

    @torch.no_grad()
    def init_from_target(self, target_model, *, layers: str = "random", fc: str = "random", norm: str = "ones",
                         markov: str = "normal") -> None:
        """Starts other than N(0, 0.02) (the defaults change nothing); the draft's tensor names and shapes stay.

        layers="target": draft layer i starts as a copy of target decoder layer L - num_layers + i (q/k/v/o, MLP and
            both RMSNorm weights; Qwen3 q_norm/k_norm, which a Llama target lacks, stay ones), and hidden_norm takes
            the first copied layer's input_layernorm weight (the context enters its k/v as that layer's input did).
        fc="last": fc is the identity on the last captured target layer and zero on the others.
        norm="target": the output norm starts as the target's final norm (what the frozen lm_head is used to).
        markov="zero_w2": markov_w1 ~ N(0, 1) and markov_w2 = 0: the bias starts at 0 with a full-size gradient (both
            factors at N(0, 0.02) give a bias of ~0.003 logits that Adam cannot grow within a short schedule).
        """
        if layers == "target":
            first = len(decoder_layers(target_model)) - len(self.layers)
            for i, layer in enumerate(self.layers):
                shapes = {name: layer.get_submodule(name).weight.shape for name in COPIED_PROJECTIONS}
                for name, weight in copied_layer(target_model, first + i, shapes).items():
                    layer.get_submodule(name).weight.copy_(weight)
                    if i == 0 and name == "input_layernorm":
                        self.hidden_norm.weight.copy_(weight)
                layer.self_attn.q_norm.weight.fill_(1.0)
                layer.self_attn.k_norm.weight.fill_(1.0)
        elif layers != "random":
            raise ValueError(f"init layers must be 'random' or 'target', got {layers!r}")
        init_fc_and_norm(self.fc, self.norm, target_model, fc, norm)
        if markov == "zero_w2":
            if self.markov_head is not None:
                self.markov_head.markov_w1.weight.normal_(0.0, 1.0)
                self.markov_head.markov_w2.weight.zero_()
        elif markov != "normal":
            raise ValueError(f"markov init must be 'normal' or 'zero_w2', got {markov!r}")

    def context_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """H_ctx = hidden_norm(fc([h_l1; ...; h_lK])): [..., K*H] -> [..., H]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        anchor_positions: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attn_impl: str | None = None,
    ) -> torch.Tensor:
        """[B, T], [B, T, K*H], [B, A] (-1 = padding) -> draft hidden [B, A, gamma, H] after `norm`, ordered k=1..gamma.

        Padding anchors give zero rows. attn_impl: "sdpa" | "flex" | None (flex on CUDA, sdpa elsewhere).
        """
        batch, seq = input_ids.shape
        num_anchors, gamma, block_len = anchor_positions.shape[1], self.block_size, self.block_len
        device = input_ids.device
        attn_impl = attn_impl or ("flex" if device.type == "cuda" else "sdpa")
        if attn_impl not in ("sdpa", "flex"):
            raise ValueError(f"attn_impl must be 'sdpa' or 'flex', got {attn_impl!r}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if num_anchors == 0:
            return self.norm.weight.new_zeros(batch, 0, gamma, self.config.hidden_size)
        if not torch.compiler.is_compiling() and bool((anchor_positions >= seq).any()):
            raise ValueError(f"anchor positions must be < the sequence length {seq}")
        keep = anchor_positions >= 0
        anchors = anchor_positions.clamp(min=0)

        block_ids = torch.full((batch, num_anchors, block_len), self.mask_token_id, dtype=input_ids.dtype,
                               device=device)
        block_ids[..., 0] = input_ids.gather(1, anchors)
        x = self.embed_tokens(block_ids).view(batch, num_anchors * block_len, -1)
        ctx = self.context_features(target_hidden)

        block_pos = (anchors[..., None] + torch.arange(block_len, device=device)).view(batch, -1)
        ctx_pos = torch.arange(seq, device=device).expand(batch, -1)
        rope_block = self.rotary_emb(x, block_pos)
        rope_ctx = self.rotary_emb(ctx, ctx_pos)
        if attn_impl == "flex":
            mask = flex_block_mask(anchors, attention_mask, block_len)
        else:
            mask = dense_block_mask(anchors, attention_mask, block_len)

        for layer in self.layers:
            x = layer(x, layer.self_attn.context_kv(ctx, rope_ctx), rope_block, mask, attn_impl)
        x = self.norm(x).view(batch, num_anchors, block_len, -1)
        # Prediction k (target a+k) lives in slot k-1 (anchor-first) or slot k (1+N): the last gamma slots either way.
        x = x[:, :, block_len - gamma:]
        return x * keep[..., None, None].to(x.dtype)

    # --- inference: the context's keys/values cached, one block per round ------------------------------------------

    @torch.no_grad()
    def extend_context(self, cache: "ContextCache", target_hidden: torch.Tensor) -> None:
        """Add the next verified positions (target layer outputs [m, K*H]) to every layer's cached context keys/values,
        exactly what `forward` computes for them."""
        ctx = self.context_features(target_hidden.to(self.fc.weight.device))[None]  # [1, m, H]
        pos = torch.arange(cache.length, cache.length + ctx.shape[1], device=ctx.device)[None]
        rope_ctx = self.rotary_emb(ctx, pos)
        new = [layer.self_attn.context_kv(ctx, rope_ctx) for layer in self.layers]
        cache.layers = new if cache.layers is None else [
            (torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2)) for (k0, v0), (k1, v1) in zip(cache.layers, new)]
        cache.length += ctx.shape[1]

    @torch.no_grad()
    def cached_block(self, anchor_token: int, cache: "ContextCache") -> torch.Tensor:
        """[gamma, H] prediction states of the block anchored at position `cache.length` (the pending token, whose
        own target state does not exist yet), from the cached context: `forward` for that one anchor."""
        device = self.fc.weight.device
        ids = torch.full((1, self.block_len), self.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor_token
        x = self.embed_tokens(ids)
        rope_block = self.rotary_emb(x, cache.length + torch.arange(self.block_len, device=device)[None])
        for layer, context_kv in zip(self.layers, cache.layers):
            x = layer(x, context_kv, rope_block, None, "sdpa")
        return self.norm(x)[0, self.block_len - self.block_size:]

    def draft_logits(self, draft_hidden: torch.Tensor, prev_ids: torch.Tensor,
                     vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[..., gamma, H], [..., gamma] -> [..., gamma, V]: lm_head(h_k) + Markov bias from x_{k-1}.
        vocab_ids: only those tokens' columns (training over a reduced vocabulary, loss.vocab_size)."""
        logits = output_rows(self.lm_head, draft_hidden, vocab_ids)
        if self.markov_head is not None:
            logits = logits + self.markov_head(draft_hidden, prev_ids, vocab_ids)
        return logits

    def greedy_drafts(self, draft_hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., gamma] the argmax drafts (target ids, among draft_vocab) given the previous tokens (teacher-forced);
        DFlash2: the selector's pick among the top K, which is its walk's wherever the previous picks were right."""
        logits = self.draft_logits(draft_hidden, prev_ids, self.draft_vocab)
        ids = None if self.draft_vocab is None else self.draft_vocab.expand(*logits.shape[:-1], -1)
        if self.candidate_selector is not None:
            unary, places = logits.topk(self.candidate_selector.top_k, dim=-1)
            ids = places if ids is None else ids.gather(-1, places)
            logits = unary + self.candidate_selector.transition(draft_hidden, prev_ids, ids).to(unary)
        drafts = logits.argmax(-1)
        return drafts if ids is None else ids.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)

    def confidence_logits(self, draft_hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., gamma, H], [..., gamma] -> [..., gamma] logits of P(accept k | drafts < k accepted)."""
        if self.confidence_head is None:
            raise RuntimeError("this draft has no confidence head (config.enable_confidence_head is False)")
        features = draft_hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([draft_hidden, self.markov_head.markov_w1(prev_ids)], dim=-1)
        return self.confidence_head.proj(features).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------------
# Training helpers: where blocks sit and what they are supervised with


def sample_anchor_positions(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to `num_anchors` anchors per row, uniform without replacement among a >= 1 with loss_mask[a+1] == 1.

    Returns [B, A] long, ascending per row, padded with -1; A = the largest count in the batch (<= num_anchors).
    a >= 1 because anchor 0 would see no context at all. Draws come from `generator` (global RNG if None), one
    uniform key per position, so the result depends only on the seed and the mask.
    """
    mask = loss_mask.bool()
    batch, seq = mask.shape
    eligible = torch.zeros_like(mask)
    if seq > 2:
        eligible[:, 1:-1] = mask[:, 2:]
    gen_device = generator.device if generator is not None else mask.device
    keys = torch.rand(batch, seq, generator=generator, device=gen_device).to(mask.device)
    keys = keys.masked_fill(~eligible, 2.0)  # ineligible positions sort after every eligible one (keys < 1)
    counts = eligible.sum(dim=1).clamp(max=num_anchors)
    width = int(counts.max()) if batch else 0
    chosen = keys.argsort(dim=1)[:, :width]
    taken = torch.arange(width, device=mask.device)[None, :] < counts[:, None]
    chosen = chosen.masked_fill(~taken, seq).sort(dim=1).values  # seq sorts last, then becomes the -1 padding
    return chosen.masked_fill(chosen == seq, -1)


def block_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchor_positions: torch.Tensor, gamma: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per prediction k = 1..gamma of each block: (labels, prev_ids, target_pos, valid), each [B, A, gamma].

    labels = input_ids[a+k], prev_ids = input_ids[a+k-1] (k=1: the anchor), target_pos = a+k-1 (index into the
    target's last_hidden_state whose lm_head gives the target distribution for token a+k). valid = a+k < T and
    loss_mask[a+k] and a real anchor, cut to its contiguous prefix (a draft after a rejected one never matters).
    Entries where valid is False hold clamped, in-range values so gathers and embeddings stay safe.
    """
    batch, seq = input_ids.shape
    num_anchors = anchor_positions.shape[1]
    keep = anchor_positions >= 0
    pos = anchor_positions.clamp(min=0)[..., None] + torch.arange(1, gamma + 1, device=input_ids.device)
    in_range = pos < seq

    def gather(source, index):
        return source.gather(1, index.clamp(max=seq - 1).reshape(batch, -1)).view(batch, num_anchors, gamma)

    labels = gather(input_ids, pos)
    prev_ids = gather(input_ids, pos - 1)
    target_pos = (pos - 1).clamp(max=seq - 1)
    valid = in_range & gather(loss_mask.bool(), pos) & keep[..., None]
    valid = valid.long().cumprod(dim=-1).bool()
    return labels, prev_ids, target_pos, valid
