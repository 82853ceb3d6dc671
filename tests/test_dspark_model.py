"""Tests for modeling/dspark.py: masks, flex/SDPA agreement, DFlash == DSpark with heads off, anchors and targets,
block layouts and context visibility, from_target, Markov heads."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from modeling.dspark import (
    DSparkModel,
    block_mask_mod,
    block_targets,
    build_dspark_config,
    dense_block_mask,
    flex_block_mask,
    sample_anchor_positions,
)

VOCAB, HIDDEN, LAYER_IDS, MASK_ID = 128, 32, [0, 2], 3


def target_config(**kw) -> Qwen3Config:
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return Qwen3Config(**(base | kw))


def draft_config(*, gamma=3, markov_rank=0, head="vanilla", confidence=False, anchor_first=True, num_layers=2):
    return build_dspark_config(target_config(), num_layers=num_layers, block_size=gamma, target_layer_ids=LAYER_IDS,
                               mask_token_id=MASK_ID, markov_rank=markov_rank, markov_head_type=head,
                               enable_confidence_head=confidence, sample_from_anchor=anchor_first)


def make_model(seed=0, **kw) -> DSparkModel:
    torch.manual_seed(seed)
    return DSparkModel(draft_config(**kw)).eval()


def make_batch(batch=2, seq=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    hidden = torch.randn(batch, seq, len(LAYER_IDS) * HIDDEN, generator=g)
    attn = torch.ones(batch, seq, dtype=torch.long)
    attn[-1, seq - 5:] = 0  # right padding on the last row
    return ids, hidden, attn


def quiet_flex(fn):
    with warnings.catch_warnings():  # eager flex on CPU warns that it is unfused
        warnings.simplefilter("ignore")
        return fn()


# --- masks -----------------------------------------------------------------------------------------------------------


def rows(*specs: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in s.replace(" ", "")] for s in specs])


@pytest.mark.parametrize("block_len", [3, 4])  # gamma 3: anchor-first uses 3 slots, 1+N uses 4
def test_block_mask_hand_checked(block_len):
    anchors, attn = torch.tensor([[2, 4]]), torch.ones(1, 6, dtype=torch.long)
    b0, b1 = "1" * block_len + "0" * block_len, "0" * block_len + "1" * block_len
    expected = rows(*(["110000 " + b0] * block_len + ["111100 " + b1] * block_len))
    got = dense_block_mask(anchors, attn, block_len)
    assert got.shape == (1, 2 * block_len, 6 + 2 * block_len)
    assert torch.equal(got[0], expected)
    # A padded context position is invisible; a padding anchor (-1) sees no context, only its own block.
    anchors, attn = torch.tensor([[3, -1]]), torch.tensor([[1, 0, 1, 1, 1, 1]])
    expected = rows(*(["101000 " + b0] * block_len + ["000000 " + b1] * block_len))
    assert torch.equal(dense_block_mask(anchors, attn, block_len)[0], expected)


def test_flex_mask_mod_matches_dense():
    g = torch.Generator().manual_seed(0)
    anchors = torch.tensor([[2, 5, 9, -1], [1, 3, 4, 11]])
    attn = (torch.rand(2, 13, generator=g) > 0.2).long()
    for block_len in (3, 4):
        mod = block_mask_mod(anchors, attn, block_len)
        q, kv = 4 * block_len, 13 + 4 * block_len
        b = torch.arange(2)[:, None, None]
        grid = mod(b, torch.zeros(()), torch.arange(q)[None, :, None], torch.arange(kv)[None, None, :])
        assert torch.equal(grid, dense_block_mask(anchors, attn, block_len))
        assert flex_block_mask(anchors, attn, block_len).shape[-2:] == (q, kv)


# --- flex vs SDPA ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("anchor_first", [True, False])
def test_flex_and_sdpa_forward_agree(anchor_first):
    model = make_model(markov_rank=8, confidence=True, anchor_first=anchor_first)
    ids, hidden, attn = make_batch()
    anchors = torch.tensor([[1, 6, 11, 17], [2, 7, 12, -1]])
    with torch.no_grad():
        dense = model(ids, hidden, anchors, attn, attn_impl="sdpa")
        flex = quiet_flex(lambda: model(ids, hidden, anchors, attn, attn_impl="flex"))
    assert dense.shape == (2, 4, 3, HIDDEN)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="flex_attention has no backward on CPU in torch 2.14 (NotImplementedError); CUDA only")
def test_flex_and_sdpa_gradients_agree():
    model = make_model(markov_rank=8).cuda().train()
    ids, hidden, attn = (t.cuda() for t in make_batch())
    anchors = torch.tensor([[1, 6, 11, 17], [2, 7, 12, -1]], device="cuda")
    grads = []
    for impl in ("sdpa", "flex"):
        model.zero_grad()
        model(ids, hidden, anchors, attn, attn_impl=impl).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "fc.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-4, rtol=1e-3)


# --- DFlash == DSpark with the heads off ------------------------------------------------------------------------------


def test_dflash_is_dspark_with_heads_off():
    dflash = make_model(seed=0)
    names = [n for n, _ in dflash.named_parameters()]
    assert not any(n.startswith(("markov_head", "confidence_head")) for n in names)
    assert {"embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight",
            "layers.1.self_attn.q_norm.weight", "layers.0.mlp.down_proj.weight"} <= set(names)
    assert not any(n.startswith("model.") for n in names)
    with pytest.raises(RuntimeError, match="no confidence head"):
        dflash.confidence_logits(torch.zeros(1, 3, HIDDEN), torch.zeros(1, 3, dtype=torch.long))

    dspark = make_model(seed=1, markov_rank=8, confidence=True)
    missing, unexpected = dspark.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all(n.startswith(("markov_head", "confidence_head")) for n in missing)
    ids, hidden, attn = make_batch()
    anchors = sample_anchor_positions(attn, 4, torch.Generator().manual_seed(0))
    _, prev, _, _ = block_targets(ids, attn, anchors, 3)
    with torch.no_grad():
        h0, h1 = dflash(ids, hidden, anchors, attn), dspark(ids, hidden, anchors, attn)
        assert torch.equal(h0, h1)
        assert not torch.allclose(dspark.draft_logits(h1, prev), dflash.draft_logits(h0, prev))
        dspark.markov_head.markov_w2.weight.zero_()
        assert torch.equal(dspark.draft_logits(h1, prev), dflash.draft_logits(h0, prev))


# --- anchors and targets ----------------------------------------------------------------------------------------------


def test_sample_anchor_positions():
    g = torch.Generator().manual_seed(3)
    loss_mask = (torch.rand(3, 24, generator=g) > 0.4).long()
    loss_mask[2] = 0
    loss_mask[2, 5] = 1  # exactly one eligible anchor: a = 4
    anchors = sample_anchor_positions(loss_mask, 6, torch.Generator().manual_seed(7))
    again = sample_anchor_positions(loss_mask, 6, torch.Generator().manual_seed(7))
    assert torch.equal(anchors, again) and anchors.dtype == torch.long and anchors.shape == (3, 6)
    assert anchors[2].tolist() == [4, -1, -1, -1, -1, -1]
    for row, mask in zip(anchors, loss_mask):
        real = row[row >= 0]
        eligible = [a for a in range(1, 23) if mask[a + 1]]
        assert len(real) == min(6, len(eligible)) and (row[len(real):] == -1).all()
        assert real.tolist() == sorted(set(real.tolist()))  # ascending, without replacement
        assert set(real.tolist()) <= set(eligible)
    other = sample_anchor_positions(loss_mask, 6, torch.Generator().manual_seed(8))
    assert not torch.equal(anchors, other)
    # Fewer eligible positions than asked: all of them; A is the batch max, not num_anchors.
    few = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]])
    assert sample_anchor_positions(few, 10, torch.Generator().manual_seed(0)).tolist() == [[1, 3], [-1, -1]]
    # Uniform: every eligible position is chosen about equally often.
    mask = torch.ones(1, 12, dtype=torch.long)  # eligible a = 1..10
    counts = torch.zeros(12)
    for seed in range(600):
        counts[sample_anchor_positions(mask, 3, torch.Generator().manual_seed(seed))[0]] += 1
    assert counts[0] == 0 and counts[11] == 0
    assert (counts[1:11] - 180).abs().max() < 60  # expected 600 * 3 / 10 = 180 each


def test_block_targets_valid_prefix():
    ids = 10 + torch.arange(8)[None]
    loss_mask = torch.tensor([[0, 0, 1, 0, 1, 1, 1, 1]])
    labels, prev, target_pos, valid = block_targets(ids, loss_mask, torch.tensor([[1, 3, 5, -1]]), 3)
    assert valid[0].tolist() == [[True, False, False],  # a=1: position 3 unsupervised cuts the block (4 too)
                                 [True, True, True],
                                 [True, True, False],  # a=5: a+3 = 8 is past the sequence
                                 [False, False, False]]  # padding anchor
    assert labels[0, :3].tolist() == [[12, 13, 14], [14, 15, 16], [16, 17, 17]]
    assert prev[0, :3].tolist() == [[11, 12, 13], [13, 14, 15], [15, 16, 17]]  # k=1: the anchor itself
    assert target_pos[0, :3].tolist() == [[1, 2, 3], [3, 4, 5], [5, 6, 7]]
    assert ((target_pos >= 0) & (target_pos < 8)).all() and ((labels >= 0) & (labels < 18)).all()


# --- layouts and visibility ------------------------------------------------------------------------------------------


def test_one_plus_n_is_anchor_first_without_slot_zero():
    """Same weights: 1+N with gamma=3 runs the block [x_a, MASK x 3] that anchor-first with gamma=4 runs, and must
    return its slots 1..3 (prediction k = slot k), while anchor-first returns every slot."""
    one_plus_n, anchor_first = make_model(gamma=3, anchor_first=False), make_model(gamma=4, anchor_first=True)
    anchor_first.load_state_dict(one_plus_n.state_dict())
    ids, hidden, attn = make_batch()
    anchors = torch.tensor([[3, 9, 14], [2, 5, -1]])
    with torch.no_grad():
        a = one_plus_n(ids, hidden, anchors, attn)
        b = anchor_first(ids, hidden, anchors, attn)
    assert a.shape == (2, 3, 3, HIDDEN) and b.shape == (2, 3, 4, HIDDEN)
    torch.testing.assert_close(a, b[:, :, 1:])
    assert (a[1, 2] == 0).all()  # padding anchor


@pytest.mark.parametrize("anchor_first", [True, False])
def test_block_sees_only_strictly_earlier_context(anchor_first):
    model = make_model(anchor_first=anchor_first)
    ids, hidden, attn = make_batch(batch=1, seq=16)
    attn[:] = 1
    anchors = torch.tensor([[5, 10]])

    def run(ids_, hidden_):
        with torch.no_grad():
            return model(ids_, hidden_, anchors, attn)

    base = run(ids, hidden)
    assert base.shape == (1, 2, 3, HIDDEN)
    later = hidden.clone()
    later[:, 5:] += torch.randn_like(later[:, 5:])  # the anchor's own target state and everything after it
    out = run(ids, later)
    torch.testing.assert_close(out[:, 0], base[:, 0], atol=0, rtol=0)
    assert not torch.allclose(out[:, 1], base[:, 1])  # the second block (anchor 10) sees positions 5..9
    earlier = hidden.clone()
    earlier[:, 4] += 1.0
    assert not torch.allclose(run(ids, earlier)[:, 0], base[:, 0])
    # Token inputs: only the anchor token enters a block; other blocks are invisible.
    other = ids.clone()
    other[0, 10] = (other[0, 10] + 1) % VOCAB  # anchor of block 1
    out = run(other, hidden)
    torch.testing.assert_close(out[:, 0], base[:, 0], atol=0, rtol=0)
    assert not torch.allclose(out[:, 1], base[:, 1])
    other = ids.clone()
    other[0, 6] = (other[0, 6] + 1) % VOCAB  # not an anchor: never an input
    torch.testing.assert_close(run(other, hidden), base, atol=0, rtol=0)


def naive_block(model: DSparkModel, ids, hidden, a: int) -> torch.Tensor:
    """One block, written out plainly: keys/values = [ctx positions 0..a-1; block at a..a+S-1], eager softmax."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    cfg, S = model.config, model.block_len
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = model.hidden_norm(model.fc(hidden[:a]))  # [a, H]
    x = model.embed_tokens(torch.tensor([int(ids[a])] + [cfg.mask_token_id] * (S - 1)))
    cos, sin = model.rotary_emb(x, torch.arange(a + S)[None])
    for layer in model.layers:
        att = layer.self_attn
        y = layer.input_layernorm(x)
        q = att.q_norm(att.q_proj(y).view(S, nh, hd)).transpose(0, 1)[None]
        src = torch.cat([ctx, y])  # context is not input-layernormed; the block is
        k = att.k_norm(att.k_proj(src).view(a + S, nkv, hd)).transpose(0, 1)[None]
        v = att.v_proj(src).view(a + S, nkv, hd).transpose(0, 1)
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        q, _ = apply_rotary_pos_emb(q, q, cos[:, a:], sin[:, a:])
        k, v = k[0].repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        probs = torch.softmax(q[0] @ k.transpose(1, 2) * hd**-0.5, dim=-1)  # no mask: all of it is visible
        x = x + att.o_proj((probs @ v).transpose(0, 1).reshape(S, nh * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)[S - model.block_size:]


@pytest.mark.parametrize("anchor_first", [True, False])
def test_forward_matches_naive_per_block_reference(anchor_first):
    model = make_model(anchor_first=anchor_first)
    ids, hidden, attn = make_batch(batch=1, seq=16)
    attn[:] = 1
    anchors = torch.tensor([[3, 8, 12]])
    with torch.no_grad():
        out = model(ids, hidden, anchors, attn)
        for j, a in enumerate(anchors[0].tolist()):
            torch.testing.assert_close(out[0, j], naive_block(model, ids[0], hidden[0], a), atol=1e-5, rtol=1e-4)


def test_right_padding_does_not_change_a_sequence():
    model = make_model(markov_rank=4)
    ids, hidden, attn = make_batch(batch=2, seq=20)  # row 1 has 5 padded positions
    anchors = torch.tensor([[2, 8, 13], [2, 8, 13]])
    with torch.no_grad():
        batched = model(ids, hidden, anchors, attn)
        alone = model(ids[1:, :15], hidden[1:, :15], anchors[1:], attn[1:, :15])
    torch.testing.assert_close(batched[1:], alone, atol=1e-5, rtol=1e-5)


# --- from_target ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_from_target_copies_and_freezes(family):
    torch.manual_seed(0)
    if family == "llama":  # SmolLM2-like: tied embeddings, no explicit head_dim, non-default rope theta
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
        target = LlamaForCausalLM(cfg)
    else:
        target = Qwen3ForCausalLM(target_config(tie_word_embeddings=False, head_dim=16))
    target.requires_grad_(False)
    config = build_dspark_config(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3],
                                 mask_token_id=MASK_ID, markov_rank=8, markov_head_type="vanilla",
                                 enable_confidence_head=True, sample_from_anchor=True)
    assert config.architectures == ["Qwen3DSparkModel"] and config.model_type == "qwen3"
    assert (config.hidden_size, config.num_key_value_heads, config.num_target_layers) == (HIDDEN, 2, 4)
    assert config.head_dim == (8 if family == "llama" else 16)
    assert config.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert not config.tie_word_embeddings and config.confidence_head_with_markov and config.block_size == 4

    draft = DSparkModel.from_target(config, target)
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight)
    frozen = {n for n, p in draft.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight", "lm_head.weight"}

    ids, hidden, attn = make_batch(batch=1, seq=12)
    anchors = torch.tensor([[2, 6]])
    _, prev, _, _ = block_targets(ids, attn, anchors, 4)
    h = draft(ids, hidden, anchors, attn)
    (draft.draft_logits(h, prev).logsumexp(-1).sum() + draft.confidence_logits(h, prev).sum()).backward()
    assert draft.embed_tokens.weight.grad is None and draft.lm_head.weight.grad is None
    assert all(p.grad is not None for n, p in draft.named_parameters() if n not in frozen)


def test_init_is_seeded_normal():
    a, b = make_model(seed=5, markov_rank=8), make_model(seed=5, markov_rank=8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert abs(a.fc.weight.std().item() - 0.02) < 0.003 and (a.norm.weight == 1).all()
    assert not torch.equal(a.fc.weight, make_model(seed=6).fc.weight)


def test_config_round_trip(tmp_path):
    config = draft_config(markov_rank=8, head="rnn", confidence=True, anchor_first=False)
    config.save_pretrained(tmp_path)
    loaded = Qwen3Config.from_pretrained(tmp_path)
    for key in ("block_size", "target_layer_ids", "num_target_layers", "mask_token_id", "markov_rank",
                "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
        assert getattr(loaded, key) == getattr(config, key), key
    with pytest.raises(ValueError):
        build_dspark_config(target_config(), num_layers=1, block_size=3, target_layer_ids=[4], mask_token_id=0)


# --- Markov heads -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_markov_heads(head):
    model = make_model(markov_rank=8, head=head, confidence=True)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 4, HIDDEN, generator=g, requires_grad=True)  # [B, A, gamma, H]
    prev = torch.randint(0, VOCAB, (2, 5, 4), generator=g)
    logits = model.draft_logits(h, prev)
    assert logits.shape == (2, 5, 4, VOCAB)
    assert torch.equal(logits, model.draft_logits(h, prev))  # teacher-forced: deterministic, no sampling
    kept = torch.tensor([0, 5, 17, 64, VOCAB - 1])  # loss.vocab_size: only these columns, the same values
    torch.testing.assert_close(model.draft_logits(h, prev, kept), logits[..., kept])
    assert model.confidence_logits(h, prev).shape == (2, 5, 4)

    changed = prev.clone()
    changed[..., 1] = (changed[..., 1] + 1) % VOCAB  # x_{k-1} of prediction k=2 (slot 1)
    diff = (model.draft_logits(h, changed) - logits).abs().amax(dim=(0, 1, 3))
    assert diff[0] == 0 and diff[1] > 0  # never reaches earlier predictions
    if head == "rnn":
        assert (diff[2:] > 0).all()  # the recurrent state carries it forward
    else:
        assert (diff[2:] == 0).all()
    conf_diff = (model.confidence_logits(h, changed) - model.confidence_logits(h, prev)).abs().amax(dim=(0, 1))
    assert conf_diff[0] == 0 and conf_diff[1] > 0

    with torch.no_grad():  # the bias is the only path: with W2 = 0 the logits are lm_head(h) whatever prev is
        model.markov_head.markov_w2.weight.zero_()
    torch.testing.assert_close(model.draft_logits(h, changed), model.lm_head(h), atol=0, rtol=0)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_(0, 0.02)
    model.draft_logits(h, prev).square().sum().backward()
    extra = {"vanilla": [], "gated": ["gate_proj"], "rnn": ["joint_proj"]}[head]
    for name in ["markov_w1", "markov_w2", *extra]:
        assert getattr(model.markov_head, name).weight.grad.abs().sum() > 0, name
    assert h.grad.abs().sum() > 0


def test_init_from_target_and_normalized_fc():
    """draft.init_layers=target copies the target's last layers; init_fc=normalized divides fc's columns by the RMS of
    each captured dimension, so an outlier dimension (as real residual streams have) does not drown the others."""
    from types import SimpleNamespace

    from train.algorithms import _init_draft, input_scale

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(target_config()).eval()
    ids, hidden, attn = make_batch()
    hidden[..., 3] *= 300.0
    class Records(list):  # the cache interface input_scale reads: records that already carry their states
        def with_hidden(self, records):
            return records

    records = Records({"hidden_states": h} for h in hidden)
    scale = input_scale(records)
    assert scale[3] > 100 * scale[4]
    draft = make_model(markov_rank=4)
    plain_fc = draft.fc.weight.clone()
    recipe = SimpleNamespace(draft=SimpleNamespace(init_layers="target", init_fc="normalized", init_norm="target",
                                                   markov_init="zero_w2", init_copy="none"))
    _init_draft(draft, recipe, target, records)
    last = target.model.layers[-1]
    assert torch.equal(draft.layers[-1].mlp.up_proj.weight, last.mlp.up_proj.weight)
    assert torch.equal(draft.layers[-1].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(draft.norm.weight, target.model.norm.weight)
    assert torch.equal(draft.markov_head.markov_w2.weight, torch.zeros_like(draft.markov_head.markov_w2.weight))
    torch.testing.assert_close(draft.fc.weight, plain_fc / scale[None, :])
    features = draft.fc(hidden)
    assert features.std(dim=(0, 1)).max() < 10 * features.std(dim=(0, 1)).median()  # no outlier column dominates


def test_feature_noise_is_seeded_per_sample_and_scaled_per_dimension():
    """train.feature_noise: the context features get noise of each dimension's own std, the same for the same
    (seed, step, place) (a resumed run adds what the first run added), and the distilled states get none."""
    from train.algorithms import add_feature_noise

    hidden = torch.zeros(2, 4096, 3)
    batch = {"hidden_states": hidden, "last_hidden_state": torch.ones(2, 4096, 3)}
    std = torch.tensor([0.1, 1.0, 30.0])
    noisy = add_feature_noise(batch, std, [(42, 7, 0), (42, 7, 1)])
    again = add_feature_noise(batch, std, [(42, 7, 0), (42, 8, 1)])
    assert torch.equal(noisy["hidden_states"][0], again["hidden_states"][0])
    assert not torch.equal(noisy["hidden_states"][1], again["hidden_states"][1])
    assert not torch.equal(noisy["hidden_states"][0], noisy["hidden_states"][1])
    torch.testing.assert_close(noisy["hidden_states"].std(dim=(0, 1)), std, rtol=0.05, atol=0)
    assert noisy["last_hidden_state"] is batch["last_hidden_state"] and torch.equal(hidden, torch.zeros_like(hidden))


def test_dropout_is_training_only_and_seeded_per_micro_batch():
    """train.dropout: the residual branches drop units in training only; the same (seed, step, rank, micro-batch)
    drops the same units (a resumed run repeats the first run), another drops others; the global RNG is untouched."""
    from train.algorithms import seeded_dropout, set_dropout

    model = make_model(markov_rank=8)
    ids, hidden, attn = make_batch()
    anchors = torch.tensor([[1, 6, 11, -1], [2, 7, 12, 13]])
    plain = model(ids, hidden, anchors, attn, attn_impl="sdpa")
    set_dropout(model, 0.3)
    assert [layer.dropout for layer in model.layers] == [0.3, 0.3]
    torch.testing.assert_close(model(ids, hidden, anchors, attn, attn_impl="sdpa"), plain)  # eval: no dropout
    model.train()
    rng = torch.get_rng_state()
    outs = []
    for seed in [(42, 7, 0, 0), (42, 7, 0, 0), (42, 7, 1, 0)]:
        with seeded_dropout(0.3, seed, torch.device("cpu")):
            outs.append(model(ids, hidden, anchors, attn, attn_impl="sdpa"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert not torch.allclose(outs[0], plain)
    set_dropout(model, 0.0)
    torch.testing.assert_close(model(ids, hidden, anchors, attn, attn_impl="sdpa"), plain)


def test_lookup_hits_are_the_ngram_drafters_first_proposals():
    """eval.replay.lookup_hits marks the positions whose next token the n-gram drafter (prompt lookup) proposes
    first: the same rule, checked against NgramDrafter itself on repetitive random rows."""
    from eval.lookup import NgramDrafter, lookup_hits

    g = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 6, (3, 50), generator=g)  # 6 symbols: many repeats of every n-gram length
    rows[2, 25:] = rows[2, :25]  # a copied half: lookup hits nearly everywhere in it
    hits = lookup_hits(rows)
    drafter = NgramDrafter(max_n=3, min_n=1)
    for r, ids in enumerate(rows.tolist()):
        for a in range(len(ids) - 1):
            drafter.reset(ids[: a + 1], None)
            proposal = drafter.propose(1, 0.0, None).tokens
            assert bool(hits[r, a]) == (proposal[:1] == [ids[a + 1]]), (r, a)
        assert not hits[r, -1]
    assert hits[2, 28:49].float().mean() > 0.8 and 0.05 < hits[0].float().mean() < 0.7


def test_replay_reports_first_draft_accuracy_where_lookup_hits(monkeypatch):
    """eval/replay.py splits the first-draft accuracy by whether prompt lookup gets the next token right: a drafter
    whose first draft is right exactly where lookup is right scores 1.0 there and 0.0 elsewhere."""
    import eval.replay as replay
    from eval.lookup import lookup_hits

    ids = torch.tensor([5, 1, 2, 3, 1, 2, 3, 4, 1, 2, 9, 9, 9, 9])
    record = {"input_ids": ids, "loss_mask": torch.tensor([0, 0, 0] + [1] * 11)}
    hits = lookup_hits(ids[None])[0]
    matches = torch.zeros(len(ids), 7, dtype=torch.bool)
    matches[:, 0] = hits
    monkeypatch.setattr(replay, "draft_matches", lambda model, rec, gamma: matches)
    report = replay.replay_records(None, [record], 7)
    answer = range(2, 13)  # pending positions first .. end - 2: the last prompt token to the last but one
    assert report["lookup_hit_share"] == pytest.approx(float(hits[list(answer)].float().mean()))
    assert 0 < report["lookup_hit_share"] < 1
    assert report["first_draft_right_at_lookup_hits"] == 1.0 and report["first_draft_right_elsewhere"] == 0.0
    # the tokens and rounds behind the record's tau (what quality.py's paired bootstrap resamples)
    assert report["per_record_rounds"] == [report["num_rounds"]]
    assert report["per_record_tokens"][0] / report["per_record_rounds"][0] == pytest.approx(report["accept_len"])
    assert report["per_record_accept_len"] == [pytest.approx(report["accept_len"])]
