"""EAGLE3 drafter: one Llama-style layer over fused target hidden states, trained with test-time training (TTT).

What it is
    The draft head SGLang serves as `LlamaForCausalLMEagle3` (and vLLM as `eagle3`). At position t it reads the
    concatenated hidden states of K target layers (classically 3: low/mid/high; DeepSpec reads 5),
    h_t = fc([a_1; ...; a_K]_t) (H_target*K -> H), plus the embedding of the next token x_{t+1}, and predicts x_{t+2}
    over a pruned draft vocabulary (modeling/vocab.py). Parameter and config names
    are the serving names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), so SGLang export is an identity map
    minus `embed_tokens` (SGLang takes the target's embedding).

How it is used
    config = build_eagle3_config(target, draft_vocab_size=32000, aux_layer_ids=[1, 15, 27])
    counts = count_tokens(((ids, mask) for ids, mask in dataset), config.vocab_size)       # modeling/vocab.py
    d2t, t2d = build_vocab_mapping(counts, config.draft_vocab_size)
    draft = Eagle3Model.from_target(config, target, d2t, t2d)
    hiddens = draft.forward_train(input_ids, aux_hidden, attention_mask)       # ttt_length x [B, T, H]
    valid = ttt_valid_mask(loss_mask, attention_mask, config.ttt_length)      # [K, B, T]
    # step k, position t: draft.step_logits(hiddens[k])[:, t] vs target lm_head(last_hidden[:, t + k + 1])[t2d]

TTT (training-time test)
    At inference the draft runs autoregressively on its own outputs; TTT unrolls that in training. Step 0 is the
    teacher-forced pass above. Step k >= 1 feeds each position its own step-(k-1) pre-norm output hidden state together
    with the embedding of x_{t+k+1}, so step k at position t predicts x_{t+k+2}. Keys/values accumulate over steps: a
    step-k query at t sees step-0 keys at positions <= t (causal) and the step-j keys (1 <= j <= k) at the same t only
    (the "diagonal": at inference those are the drafts made on top of position t). See `ttt_attention_mask`.
    RoPE: every state produced at step k for position t uses position t + k, as SpecForge/DeepSpec do; it matches
    inference, where the k-th draft after position t sits at sequence position t + k.

Layers
    num_layers=1 (what SGLang loads) gives just `midlayer`. With num_layers > 1 the extra layers are ordinary pre-norm
    Llama layers named `layers.1`, `layers.2`, ... (`midlayer` is SGLang's alias of `layers.0`, so the numbering
    continues it); they take the previous layer's output only, and each keeps its own TTT key/value stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from modeling.anatomy import draft_dims, text_config
from modeling.target import COPIED_PROJECTIONS, copied_layer, decoder_layers, draft_rope, init_fc_and_norm
from modeling.vocab import mapping_agrees

# ---------------------------------------------------------------------------------------------------------------------
# Config


def build_eagle3_config(
    target, *, num_layers: int = 1, draft_vocab_size: int, aux_layer_ids: list[int], ttt_length: int = 7
) -> LlamaConfig:
    """A `LlamaConfig` for the draft, dims copied from the target (Llama/SmolLM2 or Qwen3), plus SGLang's EAGLE3 keys.

    `aux_layer_ids` are HF layer-output ids (SGLang's config convention; SGLang adds +1 internally because it captures
    the input of the next layer).
    """
    text = text_config(target.config if isinstance(target, torch.nn.Module) else target)
    dims = draft_dims(target)  # a loaded target or its config (modeling/anatomy.py)
    num_target_layers = dims["num_hidden_layers"]
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if ttt_length < 1:
        raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
    if not 0 < draft_vocab_size <= dims["vocab_size"]:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{dims['vocab_size']} (the target vocab)")
    aux_layer_ids = [int(i) for i in aux_layer_ids]
    bad = [i for i in aux_layer_ids if not 0 <= i < num_target_layers]
    if not aux_layer_ids or bad:
        raise ValueError(
            f"aux_layer_ids {aux_layer_ids}: need at least one id in 0..{num_target_layers - 1} (HF layer-output ids)"
        )
    return LlamaConfig(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"],
        head_dim=dims["head_dim"],
        hidden_act="silu",  # the drafter's own MLP, whatever the target's: the engines' draft classes run silu only
        rms_norm_eps=dims["norm_eps"],
        rope_parameters=draft_rope(text),  # yarn/llama3 scaling carries over
        vocab_size=dims["vocab_size"],
        max_position_embeddings=dims["max_position_embeddings"],
        # SGLang's EAGLE3 head is a plain Llama layer: no q/k norm (Qwen3) and no biases, whatever the target has.
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=dims["hidden_size"],
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True},
        ttt_length=ttt_length,
        num_target_layers=num_target_layers,  # lets the export refuse the last layer, which engines cannot capture
    )


# ---------------------------------------------------------------------------------------------------------------------
# TTT masks


def ttt_attention_mask(
    seq_len: int, step: int, attention_mask: torch.Tensor | None = None, *, device: torch.device | None = None
) -> torch.Tensor:
    """Boolean SDPA mask (True = attend) for the step-`step` queries over the keys of steps 0..step.

    Keys are laid out step-major: [step-0 keys 0..T-1 | step-1 keys 0..T-1 | ... | step-`step` keys]. Query t may see
    step-0 key s when s <= t (causal) and step-j key s (1 <= j <= step) when s == t (the diagonal). For T=3, step=1:

        q\\k   s0 s1 s2 | s0 s1 s2
        t0     1  0  0 |  1  0  0
        t1     1  1  0 |  0  1  0
        t2     1  1  1 |  0  0  1

    With `attention_mask` [B, T] (1 = real token) keys at padding are hidden, except a query's own keys (s == t) stay
    visible so padded query rows are never empty (SDPA would return NaN); padded outputs are garbage and never
    supervised. Returns [T, (step+1)*T], or [B, T, (step+1)*T] with `attention_mask`.
    """
    pos = torch.arange(seq_len, device=device if attention_mask is None else attention_mask.device)
    causal = pos[None, :] <= pos[:, None]
    diagonal = pos[None, :] == pos[:, None]
    mask = torch.cat([causal] + [diagonal] * step, dim=1)
    if attention_mask is None:
        return mask
    key_ok = attention_mask.bool()[:, None, :] | diagonal[None]  # [B, T(query), T(key position)]
    return mask[None] & key_ok.repeat(1, 1, step + 1)


def ttt_valid_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, ttt_length: int) -> torch.Tensor:
    """[ttt_length, B, T] bool: step k at position t is supervised when its target token t+k+2 exists, is loss-masked,
    and both t and t+k+2 are real tokens."""
    loss_mask = loss_mask.bool()
    real = torch.ones_like(loss_mask) if attention_mask is None else attention_mask.bool()
    steps = []
    for k in range(ttt_length):
        target_ok = shift_left(loss_mask & real, k + 2, fill=0).bool()
        steps.append(real & target_ok)
    return torch.stack(steps)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at position t along dim 1 (B, T, ...), `fill` past the end."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Layers


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read `input_size` features (2H in the EAGLE3 midlayer) and whose keys/values
    accumulate across TTT steps in `cache` (a pair of lists the caller owns for one forward_train)."""

    def __init__(self, config: LlamaConfig, input_size: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache: tuple[list, list]) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        cache[0].append(k)
        cache[1].append(v)
        keys = repeat_kv(torch.cat(cache[0], dim=2), self.num_heads // self.num_kv_heads)
        values = repeat_kv(torch.cat(cache[1], dim=2), self.num_heads // self.num_kv_heads)
        assert mask.shape[-1] == keys.shape[2], f"mask covers {mask.shape[-1]} keys, cache holds {keys.shape[2]}"
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class Eagle3DecoderLayer(nn.Module):
    """Pre-norm Llama layer. The first layer (`midlayer`, fuse_embeds=True) normalises the token embedding and the
    incoming hidden state separately and attends over their 2H concat [embeds; hidden] (SGLang's order); its residual
    is the incoming hidden state. Later layers are ordinary and ignore `embeds`."""

    def __init__(self, config: LlamaConfig, fuse_embeds: bool):
        super().__init__()
        self.fuse_embeds = fuse_embeds
        hidden = config.hidden_size
        self.self_attn = Eagle3Attention(config, 2 * hidden if fuse_embeds else hidden)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        if fuse_embeds:
            self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.dropout = 0.0  # on the residual branches while training (train.dropout); not a config key

    def forward(self, embeds, hidden, cos, sin, mask, cache) -> torch.Tensor:
        residual = hidden
        if self.fuse_embeds:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        else:
            x = self.input_layernorm(hidden)
        hidden = residual + F.dropout(self.self_attn(x, cos, sin, mask, cache), self.dropout, self.training)
        return hidden + F.dropout(self.mlp(self.post_attention_layernorm(hidden)), self.dropout, self.training)


# ---------------------------------------------------------------------------------------------------------------------
# Model


class Eagle3Model(nn.Module):
    """EAGLE3 draft head with SGLang `LlamaForCausalLMEagle3` parameter names.

    state_dict: embed_tokens.weight (frozen target copy; dropped on SGLang export), fc.weight, midlayer.*,
    layers.{1..} (num_layers > 1 only), norm.weight, lm_head.weight [Vd, H] (trainable), d2t, t2d.
    """

    def __init__(self, config: LlamaConfig, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        num_aux = len(config.eagle_config["eagle_aux_hidden_state_layer_ids"])
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_tokens.requires_grad_(False)
        self.fc = nn.Linear(num_aux * config.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, fuse_embeds=True)
        # ModuleDict keyed "1", "2", ... so names continue SGLang's `midlayer` == `layers.0`.
        self.layers = nn.ModuleDict(
            {str(i): Eagle3DecoderLayer(config, fuse_embeds=False) for i in range(1, config.num_hidden_layers)}
        )
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)  # non-persistent buffers only: adds nothing to state_dict
        if d2t is None:  # identity prefix until a real mapping is loaded
            d2t = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
        if t2d is None:
            t2d = torch.arange(config.vocab_size) < config.draft_vocab_size
        self._check_mapping(d2t, t2d)
        self.register_buffer("d2t", d2t.to(torch.int64).clone())
        self.register_buffer("t2d", t2d.to(torch.bool).clone())

    def _check_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if d2t.shape != (vd,) or t2d.shape != (v,):
            raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)}: expected ({vd},) / ({v},)")
        if d2t.is_meta or t2d.is_meta:  # a shape-only model (export's key map): there are no values to check
            return
        if int(t2d.sum()) != vd:
            raise ValueError(f"t2d keeps {int(t2d.sum())} ids, draft_vocab_size is {vd}")
        if not mapping_agrees(d2t, t2d):
            raise ValueError("d2t and t2d disagree: arange(Vd) + d2t must be the sorted ids where t2d is True")

    @classmethod
    def from_target(cls, config: LlamaConfig, target_model, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Model:
        """A fresh draft whose embedding is a frozen copy of the target's and whose lm_head starts from the target
        lm_head rows of the kept ids (in draft id order). Weights are copied (never shared) in the draft's dtype."""
        model = cls(config, d2t, t2d)
        embed = target_model.get_input_embeddings().weight
        head = target_model.get_output_embeddings().weight  # the embedding itself for tied targets (SmolLM2)
        if embed.shape != model.embed_tokens.weight.shape:
            raise ValueError(f"target embedding {tuple(embed.shape)} != draft {tuple(model.embed_tokens.weight.shape)}")
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
            model.lm_head.weight.copy_(head[t2d.to(head.device)])
        return model

    @torch.no_grad()
    def init_from_target(self, target_model, *, layers: str = "random", fc: str = "random",
                         norm: str = "ones") -> None:
        """Starts other than PyTorch's default Linear init (the defaults change nothing).

        layers="target": the midlayer starts as the target's last decoder layer on its hidden half: the q/k/v columns
            that read the hidden state get the target's q/k/v weights, the columns that read the embedding are zero;
            o_proj, MLP and post_attention_layernorm are copied, hidden_norm takes the target layer's input_layernorm
            weight. Extra layers (num_layers > 1) copy the target layers before it.
        fc="last": fc is the identity on the last auxiliary target layer and zero on the others.
        norm="target": the output norm starts as the target's final norm weight.
        """
        hidden = self.config.hidden_size
        if layers == "target":
            source = decoder_layers(target_model)
            mine = [self.midlayer, *self.layers.values()]
            for i, layer in enumerate(mine):
                into = {name: layer.get_submodule(name).weight for name in COPIED_PROJECTIONS}
                if i == 0:  # the midlayer's q/k/v read [embeds; hidden]: the hidden half reads like the target layer
                    for name in COPIED_PROJECTIONS[:3]:  # q, k, v
                        into[name] = into[name].zero_()[:, hidden:]
                copied = copied_layer(target_model, len(source) - len(mine) + i, {n: w.shape for n, w in into.items()})
                for name, weight in into.items():
                    weight.copy_(copied[name])
                layer.post_attention_layernorm.weight.copy_(copied["post_attention_layernorm"])
                (layer.hidden_norm if i == 0 else layer.input_layernorm).weight.copy_(copied["input_layernorm"])
        elif layers != "random":
            raise ValueError(f"init layers must be 'random' or 'target', got {layers!r}")
        init_fc_and_norm(self.fc, self.norm, target_model, fc, norm)

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., Vd] from a (normed) hidden state returned by forward_train."""
        return self.lm_head(hidden)

    def forward_train(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        ttt_length: int | None = None,
    ) -> list[torch.Tensor]:
        """Unrolled TTT: `ttt_length` normed hidden states [B, T, H]; step k at t predicts token t+k+2.

        input_ids [B, T], aux_hidden [B, T, num_aux*H_target] (concat of the aux target layers), attention_mask [B, T]
        (1 = real). RoPE positions are arange(T) + k regardless of padding: RoPE only sees relative offsets, and
        real queries never see padded keys, so left or right padding both work.
        """
        ttt_length = self.config.ttt_length if ttt_length is None else ttt_length
        batch, seq_len = input_ids.shape
        if aux_hidden.shape[:2] != (batch, seq_len) or aux_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"aux_hidden {tuple(aux_hidden.shape)}: expected ({batch}, {seq_len}, {self.fc.in_features})"
            )
        hidden = self.fc(aux_hidden.to(self.fc.weight.dtype))
        layers = [self.midlayer, *self.layers.values()]
        caches = [([], []) for _ in layers]
        positions = torch.arange(seq_len, device=input_ids.device)[None].expand(batch, seq_len)
        outputs = []
        for step in range(ttt_length):
            # Step k at t consumes token t+k+1; past the end the id is 0 (such positions are never supervised).
            embeds = self.embed_tokens(shift_left(input_ids, step + 1, fill=0)).to(hidden.dtype)
            cos, sin = self.rotary_emb(hidden, positions + step)
            mask = ttt_attention_mask(seq_len, step, attention_mask, device=input_ids.device)
            mask = mask[:, None] if mask.dim() == 3 else mask  # [B, 1 (heads), T, (k+1)T]
            h = hidden
            for layer, cache in zip(layers, caches):
                h = layer(embeds, h, cos, sin, mask, cache)
            outputs.append(self.norm(h))
            hidden = h  # the pre-norm output feeds the next step, as at inference (SGLang's aux hidden state)
        return outputs
