"""EAGLE3 drafter (modeling/eagle3.py): TTT mask, causality, no-leak parity, from_target, serving names.

Tiny random models only (hidden 32, vocab 200, draft vocab 64, T <= 24); CPU, a few seconds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from modeling.eagle3 import Eagle3Model, build_eagle3_config, ttt_attention_mask, ttt_valid_mask
from modeling.vocab import build_vocab_mapping

V, VD, H = 200, 64, 32
AUX = [0, 1, 2]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    # head_dim 16 with 4 heads: q width 64 != hidden 32, as in real Qwen3 models.
    config = Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def random_mapping(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return build_vocab_mapping(torch.randint(0, 50, (V,), generator=g), VD)


def make_draft(target=None, num_layers: int = 1, ttt_length: int = 3, seed: int = 0) -> Eagle3Model:
    target = target if target is not None else tiny_llama()
    config = build_eagle3_config(
        target.config, num_layers=num_layers, draft_vocab_size=VD, aux_layer_ids=AUX, ttt_length=ttt_length
    )
    d2t, t2d = random_mapping()
    torch.manual_seed(seed)
    draft = Eagle3Model.from_target(config, target, d2t, t2d)
    # Non-trivial norm weights so a wrong norm placement cannot hide behind all-ones.
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return draft.eval()


def inputs(batch: int = 2, seq_len: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, seq_len), generator=g)
    aux = torch.randn(batch, seq_len, len(AUX) * H, generator=g)
    return ids, aux


# ---------------------------------------------------------------------------------------------------------------------
# TTT masks


def test_ttt_attention_mask_hand_checked():
    c = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]  # causal over step-0 keys
    d = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]  # diagonal over a later step's keys
    for step, blocks in [(0, [c]), (1, [c, d]), (2, [c, d, d])]:
        expected = torch.tensor([sum((b[row] for b in blocks), []) for row in range(4)], dtype=torch.bool)
        got = ttt_attention_mask(4, step)
        assert got.shape == (4, 4 * (step + 1))
        assert torch.equal(got, expected), f"step {step}:\n{got.int()}"

    # left padding on position 0: real queries lose key 0; the padded query keeps only its own keys
    pad = torch.tensor([[0, 1, 1, 1]])
    got = ttt_attention_mask(4, 1, pad)
    expected = torch.tensor(
        [[1, 0, 0, 0, 1, 0, 0, 0],
         [0, 1, 0, 0, 0, 1, 0, 0],
         [0, 1, 1, 0, 0, 0, 1, 0],
         [0, 1, 1, 1, 0, 0, 0, 1]], dtype=torch.bool,
    )  # fmt: skip
    assert got.shape == (1, 4, 8) and torch.equal(got[0], expected)


def test_ttt_valid_mask():
    loss = torch.tensor([[0, 0, 1, 1, 1, 0]])
    real = torch.tensor([[1, 1, 1, 1, 1, 0]])
    valid = ttt_valid_mask(loss, real, 3).int()
    assert valid.shape == (3, 1, 6)
    assert valid[0, 0].tolist() == [1, 1, 1, 0, 0, 0]  # targets t+2 in {2,3,4}
    assert valid[1, 0].tolist() == [1, 1, 0, 0, 0, 0]  # targets t+3
    assert valid[2, 0].tolist() == [1, 0, 0, 0, 0, 0]  # targets t+4
    # a padded query position is never valid even if its target is supervised
    valid = ttt_valid_mask(torch.ones(1, 6), torch.tensor([[0, 1, 1, 1, 1, 1]]), 1)
    assert valid[0, 0].tolist() == [False, True, True, True, False, False]


# ---------------------------------------------------------------------------------------------------------------------
# Forward: references written without the mask builder or the KV stacks


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [..., n, d] at integer positions pos [n] (rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def qkv(layer, x, pos, config):
    """Per-head q, k, v [heads, n, hd] (kv repeated to the query heads), rotated at pos."""
    attn, hd = layer.self_attn, config.head_dim
    n = x.shape[0]
    rep = config.num_attention_heads // config.num_key_value_heads
    q = attn.q_proj(x).view(n, -1, hd).transpose(0, 1)
    k = attn.k_proj(x).view(n, -1, hd).transpose(0, 1).repeat_interleave(rep, 0)
    v = attn.v_proj(x).view(n, -1, hd).transpose(0, 1).repeat_interleave(rep, 0)
    theta = config.rope_parameters["rope_theta"]
    return rope(q, pos, theta), rope(k, pos, theta), v


def layer_input(layer, embeds, hidden):
    if layer.fuse_embeds:
        return torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
    return layer.input_layernorm(hidden)


def layer_finish(layer, residual, attn_heads):
    h = residual + layer.self_attn.o_proj(attn_heads.transpose(0, 1).reshape(residual.shape[0], -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def reference_ttt(model: Eagle3Model, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """One sequence, explicit per-query key lists: query (k, t) sees (0, s<=t) and (j, t) for 1<=j<=k."""
    config = model.config
    seq_len = ids.shape[0]
    layers = [model.midlayer, *model.layers.values()]
    keys = [{} for _ in layers]  # layer -> {(step, pos): (k [heads, hd], v)}
    hidden = model.fc(aux)
    outputs = []
    for k in range(steps):
        tokens = torch.tensor([ids[t + k + 1] if t + k + 1 < seq_len else 0 for t in range(seq_len)])
        embeds = model.embed_tokens(tokens)
        h = hidden
        for li, layer in enumerate(layers):
            q, kk, vv = qkv(layer, layer_input(layer, embeds, h), torch.arange(seq_len) + k, config)
            for t in range(seq_len):
                keys[li][(k, t)] = (kk[:, t], vv[:, t])
            heads = []
            for t in range(seq_len):
                visible = [(0, s) for s in range(t + 1)] + [(j, t) for j in range(1, k + 1)]
                K = torch.stack([keys[li][key][0] for key in visible], 1)  # [heads, n, hd]
                Vv = torch.stack([keys[li][key][1] for key in visible], 1)
                w = torch.softmax(q[:, t : t + 1] @ K.transpose(1, 2) / math.sqrt(config.head_dim), -1)
                heads.append((w @ Vv)[:, 0])
            h = layer_finish(layer, h, torch.stack(heads, 1))
        outputs.append(model.norm(h))
        hidden = h
    return outputs


@pytest.mark.parametrize("num_layers", [1, 2])
def test_forward_train_matches_explicit_reference(num_layers):
    draft = make_draft(num_layers=num_layers)
    ids, aux = inputs(batch=2, seq_len=9)
    with torch.no_grad():
        got = draft.forward_train(ids, aux, torch.ones_like(ids), ttt_length=3)
        assert len(got) == 3 and got[0].shape == (2, 9, H)
        for b in range(2):
            want = reference_ttt(draft, ids[b], aux[b], 3)
            for k in range(3):
                torch.testing.assert_close(got[k][b], want[k], atol=1e-5, rtol=1e-5)


def test_step0_equals_causal_forward_on_prefix():
    """Step 0 at t, recomputed from only the prefix (aux[:t+1], tokens[1:t+2]) with SDPA's own causal mask."""
    draft = make_draft()
    config = draft.config
    ids, aux = inputs(batch=1, seq_len=10)
    with torch.no_grad():
        step0 = draft.forward_train(ids, aux, None, ttt_length=1)[0][0]
        layer = draft.midlayer
        for t in range(ids.shape[1] - 1):
            n = t + 1
            hidden = draft.fc(aux[0, :n])
            x = layer_input(layer, draft.embed_tokens(ids[0, 1 : n + 1]), hidden)
            q, k, v = qkv(layer, x, torch.arange(n), config)
            heads = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
            out = draft.norm(layer_finish(layer, hidden, heads))
            torch.testing.assert_close(step0[t], out[-1], atol=1e-5, rtol=1e-5)


def test_causality_by_perturbation():
    draft = make_draft(ttt_length=3)
    seq_len = 12
    ids, aux = inputs(batch=1, seq_len=seq_len)
    with torch.no_grad():
        base = draft.forward_train(ids, aux, None)
        for k in range(3):
            for t in [0, 3, 7]:
                last_token = t + k + 1  # the latest token step k at t may depend on
                if last_token + 1 < seq_len:  # a later token: no effect
                    ids2 = ids.clone()
                    ids2[0, last_token + 1 :] = (ids2[0, last_token + 1 :] + 1) % V
                    out = draft.forward_train(ids2, aux, None)[k]
                    torch.testing.assert_close(out[0, t], base[k][0, t], atol=1e-6, rtol=0)
                aux2 = aux.clone()  # later aux: no effect
                aux2[0, t + 1 :] += 3.0
                torch.testing.assert_close(draft.forward_train(ids, aux2, None)[k][0, t], base[k][0, t])
                if last_token < seq_len:  # the newest allowed token matters
                    ids3 = ids.clone()
                    ids3[0, last_token] = (ids3[0, last_token] + 1) % V
                    assert (draft.forward_train(ids3, aux, None)[k][0, t] - base[k][0, t]).abs().max() > 1e-4
                for s in {0, t}:  # earlier (and own) aux matters
                    aux3 = aux.clone()
                    aux3[0, s] += 3.0
                    assert (draft.forward_train(ids, aux3, None)[k][0, t] - base[k][0, t]).abs().max() > 1e-4


def test_left_padding_is_invisible():
    """RoPE is relative and real queries never see padded keys, so left padding changes nothing (and makes no NaN)."""
    draft = make_draft(ttt_length=3)
    ids, aux = inputs(batch=1, seq_len=8)
    pad = 3
    ids_p = torch.cat([torch.full((1, pad), 7), ids], 1)
    aux_p = torch.cat([torch.randn(1, pad, aux.shape[-1]) * 5, aux], 1)
    mask_p = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(ids)], 1)
    with torch.no_grad():
        plain = draft.forward_train(ids, aux, torch.ones_like(ids))
        padded = draft.forward_train(ids_p, aux_p, mask_p)
    for k in range(3):
        assert torch.isfinite(padded[k]).all()
        torch.testing.assert_close(padded[k][:, pad:], plain[k], atol=1e-5, rtol=1e-5)


def test_gradients_reach_trainable_parts_only():
    draft = make_draft(ttt_length=2).train()
    ids, aux = inputs(batch=1, seq_len=6)
    hiddens = draft.forward_train(ids, aux, torch.ones_like(ids))
    sum(draft.step_logits(h).logsumexp(-1).sum() for h in hiddens).backward()
    assert draft.embed_tokens.weight.grad is None
    for name in ["fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "lm_head.weight"]:
        assert draft.get_parameter(name).grad.abs().sum() > 0, name
    assert draft.step_logits(hiddens[0]).shape == (1, 6, VD)


# ---------------------------------------------------------------------------------------------------------------------
# from_target, config, serving names


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_qwen3])
def test_from_target_copies_embed_and_head_rows(make_target):
    target = make_target()
    draft = make_draft(target)
    d2t, t2d = random_mapping()
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    assert torch.equal(draft.embed_tokens.weight, embed)
    assert not draft.embed_tokens.weight.requires_grad and draft.lm_head.weight.requires_grad
    kept = torch.arange(VD) + d2t
    assert torch.equal(draft.lm_head.weight, head[kept])
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    # copies, not views: training the draft must not touch the target
    before = head.clone()
    with torch.no_grad():
        draft.lm_head.weight.add_(1.0)
        draft.embed_tokens.weight.add_(1.0)
    assert torch.equal(target.get_output_embeddings().weight, before)
    if target.config.tie_word_embeddings:
        assert target.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    # draft dims follow the target
    tc, dc = target.config, draft.config
    for key in ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"]:
        assert getattr(dc, key) == getattr(tc, key), key
    assert draft.midlayer.self_attn.q_proj.weight.shape == (tc.num_attention_heads * tc.head_dim, 2 * H)
    ids, aux = inputs(batch=1, seq_len=5)
    with torch.no_grad():
        assert torch.isfinite(draft.forward_train(ids, aux)[-1]).all()


def test_from_target_rejects_inconsistent_mapping():
    target = tiny_llama()
    config = build_eagle3_config(target.config, draft_vocab_size=VD, aux_layer_ids=AUX)
    d2t, t2d = random_mapping()
    with pytest.raises(ValueError):
        Eagle3Model.from_target(config, target, d2t + 1, t2d)


def test_config_has_sglang_keys(tmp_path):
    target = tiny_qwen3()
    config = build_eagle3_config(target.config, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3], ttt_length=5)
    d = config.to_dict()
    assert d["architectures"] == ["LlamaForCausalLMEagle3"]
    assert d["model_type"] == "llama"
    assert d["draft_vocab_size"] == VD and d["vocab_size"] == V
    assert d["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    assert d["target_hidden_size"] == H and d["ttt_length"] == 5
    assert d["num_hidden_layers"] == 1 and d["tie_word_embeddings"] is False
    assert d["head_dim"] == 16 and d["rope_parameters"] == target.config.rope_parameters
    assert d["max_position_embeddings"] == 64 and d["rms_norm_eps"] == target.config.rms_norm_eps
    config.save_pretrained(tmp_path)
    again = LlamaConfig.from_pretrained(tmp_path)
    assert again.eagle_config == config.eagle_config and again.draft_vocab_size == VD
    with pytest.raises(ValueError):
        build_eagle3_config(target.config, draft_vocab_size=VD, aux_layer_ids=[1, 4])  # 4 layers: ids 0..3
    with pytest.raises(ValueError):
        build_eagle3_config(target.config, draft_vocab_size=V + 1, aux_layer_ids=AUX)


def test_state_dict_uses_serving_names():
    draft = make_draft()
    sd = draft.state_dict()
    layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]  # fmt: skip
    expected = {f"midlayer.{n}" for n in layer} | {"midlayer.hidden_norm.weight"}
    expected |= {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert set(sd) == expected
    assert sd["fc.weight"].shape == (H, 3 * H) and sd["lm_head.weight"].shape == (VD, H)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)
    two = make_draft(num_layers=2).state_dict()
    assert set(two) == expected | {f"layers.1.{n}" for n in layer}
