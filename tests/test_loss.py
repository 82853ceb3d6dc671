"""train/loss.py against hand-written formulas: block drafters (DSpark, DFlash) and Eagle3.

Everything runs in float64 on tiny vocabularies so that "equal up to summation order" can be checked tightly.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from train.loss import (BlockLossBatch, BlockLossSettings, Eagle3LossSettings, LossChunking, auto_chunk_size,
                        block_loss, eagle3_loss, position_weights)

F64 = torch.float64
DSPARK = dict(ce_alpha=0.1, l1_alpha=0.9, conf_alpha=1.0)


class TinyBlockDrafter(nn.Module):
    """Stand-in for a DSpark drafter: a trainable projection, the frozen lm_head, a vanilla Markov bias
    W2 W1[x_{k-1}] and a confidence head on [h; W1 x_{k-1}] (or on W1 x_{k-1} alone, conf_uses_hidden=False).

    draft_logits reads lm_head.weight directly, so a forward hook on lm_head counts only target-logit calls.
    """

    def __init__(self, hidden=16, vocab=64, rank=8, conf_uses_hidden=True, dtype=F64, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=dtype).requires_grad_(False)
        self.markov_w1 = nn.Embedding(vocab, rank, dtype=dtype)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False, dtype=dtype)
        self.conf_uses_hidden = conf_uses_hidden
        self.conf_head = nn.Linear((hidden if conf_uses_hidden else 0) + rank, 1, dtype=dtype)
        self.target_calls = 0
        self.conf_calls = 0
        self.lm_head.register_forward_hook(self._count_target)

    def _count_target(self, *_):
        self.target_calls += 1

    def draft_logits(self, h, prev_ids, vocab_ids=None):
        head, w2 = self.lm_head.weight, self.markov_w2.weight
        if vocab_ids is not None:
            head, w2 = head[vocab_ids], w2[vocab_ids]
        return F.linear(torch.tanh(self.proj(h)), head) + F.linear(self.markov_w1(prev_ids), w2)

    def confidence_logits(self, h, prev_ids):
        self.conf_calls += 1
        feats = self.markov_w1(prev_ids)
        if self.conf_uses_hidden:
            feats = torch.cat([h, feats], dim=-1)
        return self.conf_head(feats).squeeze(-1)


def make_batch(n=7, gamma=5, hidden=16, vocab=64, prefix=None, seed=1, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    if prefix is None:  # a mix: full blocks, partial prefixes and a padding anchor with nothing valid
        prefix = [gamma, 3, 0, 1, gamma, 2, gamma][:n]
        prefix += [gamma] * (n - len(prefix))
    valid = torch.arange(gamma)[None, :] < torch.tensor(prefix)[:, None]
    labels = torch.randint(0, vocab, (n, gamma), generator=g)
    labels[~valid] = -100  # out-of-range labels past the prefix must be harmless
    prev_ids = torch.randint(0, vocab, (n, gamma), generator=g)
    draft_hidden = torch.randn(n, gamma, hidden, generator=g, dtype=dtype).requires_grad_(True)
    target_hidden = torch.randn(n, gamma, hidden, generator=g, dtype=dtype)
    return dict(draft_hidden=draft_hidden, target_hidden=target_hidden, labels=labels, prev_ids=prev_ids,
                valid=valid)


def hand_terms(model, b, gamma_decay, vocab_ids=None):
    """Per-prediction pieces from the definitions, with plain ops (softmax then log, sigmoid BCE by hand).
    vocab_ids: both softmaxes over those columns of the full logits only (labels index into vocab_ids)."""
    dh, th, labels, prev, valid = b["draft_hidden"], b["target_hidden"], b["labels"], b["prev_ids"], b["valid"]
    gamma = dh.shape[1]
    w = torch.exp(-(torch.arange(1, gamma + 1, dtype=F64) - 1) / gamma_decay)[None, :] * valid
    columns = slice(None) if vocab_ids is None else vocab_ids
    p_d = torch.softmax(model.draft_logits(dh, prev)[..., columns], dim=-1)
    p_t = torch.softmax(model.lm_head(th)[..., columns], dim=-1)
    ce = -torch.log(p_d.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1))
    l1 = (p_d - p_t).abs().sum(-1)
    cstar = (1 - 0.5 * l1).clamp(0, 1).detach()
    z = model.confidence_logits(dh, prev)
    sig = torch.sigmoid(z)
    bce = -(cstar * torch.log(sig) + (1 - cstar) * torch.log(1 - sig))
    return dict(w=w, ce=ce, l1=l1, cstar=cstar, bce=bce, argmax=p_d.argmax(-1))


def hand_sums(model, b, gamma_decay, ce_alpha, l1_alpha, conf_alpha, vocab_ids=None):
    t = hand_terms(model, b, gamma_decay, vocab_ids)
    v = b["valid"]
    s = {k: (t["w"] * torch.where(v, t[k], 0.0)).sum() for k in ("ce", "l1", "bce")}
    s["loss"] = ce_alpha * s["ce"] + l1_alpha * s["l1"] + conf_alpha * s["bce"]
    s["weight"] = t["w"].sum()
    return s, t


def grads(loss, model, dh):
    params = [p for p in model.parameters() if p.requires_grad]
    out = torch.autograd.grad(loss, [dh, *params], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(out, [dh, *params])]


# --------------------------------------------------------------------------------------------------------------
# block_loss
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma_decay", [4.0, 1.5])
def test_block_terms_match_hand_formula(gamma_decay):
    model, b = TinyBlockDrafter(), make_batch()
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(**DSPARK, gamma_decay=gamma_decay))
    ref, t = hand_sums(model, b, gamma_decay, **DSPARK)
    torch.testing.assert_close(out.ce_sum, ref["ce"].float())
    torch.testing.assert_close(out.l1_sum, ref["l1"].float())
    torch.testing.assert_close(out.conf_sum, ref["bce"].float())
    torch.testing.assert_close(out.weight_sum, ref["weight"].float())
    torch.testing.assert_close(out.loss_sum, ref["loss"].float())
    valid = b["valid"]
    assert out.accept_count.tolist() == valid.sum(0).tolist()
    assert int(out.num_anchors) == int(valid.any(1).sum()) == 6
    assert out.top1_correct.tolist() == ((t["argmax"] == b["labels"]) & valid).sum(0).tolist()
    assert out.loss_sum.requires_grad and not out.ce_sum.requires_grad and not out.accept_sum.requires_grad


def test_position_weights_and_valid_prefix_by_scalar_loops():
    gamma, gd = 7, 4.0
    prefix = [7, 3, 0, 1]
    model, b = TinyBlockDrafter(), make_batch(n=4, gamma=gamma, prefix=prefix)
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(ce_alpha=1.0, l1_alpha=0.0, conf_alpha=0.0,
                                                                   gamma_decay=gd))
    with torch.no_grad():
        t = hand_terms(model, b, gd)
    want_w = sum(math.exp(-(k - 1) / gd) for p in prefix for k in range(1, p + 1))
    want_ce = sum(math.exp(-(k - 1) / gd) * t["ce"][a, k - 1].item() for a, p in enumerate(prefix)
                  for k in range(1, p + 1))
    assert out.weight_sum.item() == pytest.approx(want_w, rel=1e-6)
    assert out.ce_sum.item() == pytest.approx(want_ce, rel=1e-6)
    torch.testing.assert_close(position_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    torch.testing.assert_close(position_weights(3, None), torch.ones(3))

    # Nothing past the valid prefix matters: scramble hidden states and labels there.
    b2 = {k: (v.detach().clone() if v.is_floating_point() else v.clone()) for k, v in b.items()}
    inv = ~b["valid"]
    b2["draft_hidden"][inv] = 1e3 * torch.randn_like(b2["draft_hidden"][inv])
    b2["target_hidden"][inv] = float("nan")
    b2["labels"][inv] = 10**9
    b2["prev_ids"][inv] = 0
    out2 = block_loss(model, BlockLossBatch(**b2), BlockLossSettings(**DSPARK, gamma_decay=gd))
    out1 = block_loss(model, BlockLossBatch(**b), BlockLossSettings(**DSPARK, gamma_decay=gd))
    for f in ("loss_sum", "weight_sum", "ce_sum", "l1_sum", "conf_sum", "accept_sum", "tau_sum"):
        torch.testing.assert_close(getattr(out2, f), getattr(out1, f), msg=f)
    assert torch.equal(out2.top1_correct, out1.top1_correct)


def test_accept_and_tau_by_formula():
    model, b = TinyBlockDrafter(), make_batch()
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(**DSPARK, gamma_decay=4.0))
    t = hand_terms(model, b, 4.0)
    c, valid = t["cstar"], b["valid"]
    n, gamma = valid.shape
    want_accept = [sum(float(c[a, k]) for a in range(n) if valid[a, k]) for k in range(gamma)]
    want_tau = 0.0
    for a in range(n):
        if not valid[a].any():
            continue  # padding anchors are not anchors
        prod, tau = 1.0, 1.0
        for k in range(gamma):
            prod *= float(c[a, k]) if valid[a, k] else 0.0
            tau += prod
        want_tau += tau
    torch.testing.assert_close(out.accept_sum, torch.tensor(want_accept, dtype=torch.float32))
    assert out.tau_sum.item() == pytest.approx(want_tau, rel=1e-6)
    assert 0 < out.tau_sum.item() / out.num_anchors.item() <= 1 + gamma


@pytest.mark.parametrize("chunk_size", [1, 3, 7, None])
@pytest.mark.parametrize("use_checkpoint", [True, False])
def test_chunked_equals_unchunked(chunk_size, use_checkpoint):
    model, b = TinyBlockDrafter(), make_batch(n=7)
    ref, _ = hand_sums(model, b, 4.0, **DSPARK)
    ref_grads = grads(ref["loss"], model, b["draft_hidden"])
    chunking = LossChunking(chunk_size=chunk_size, use_checkpoint=use_checkpoint)
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(**DSPARK, gamma_decay=4.0, chunking=chunking))
    full = block_loss(model, BlockLossBatch(**b), BlockLossSettings(
        **DSPARK, gamma_decay=4.0, chunking=LossChunking(chunk_size=7, use_checkpoint=False)))
    torch.testing.assert_close(out.loss_sum, ref["loss"].float())
    got = grads(out.loss_sum, model, b["draft_hidden"])
    got_full = grads(full.loss_sum, model, b["draft_hidden"])
    assert len(got) == 1 + 6  # draft_hidden, proj.w/b, markov w1/w2, conf_head w/b
    for g, r, f in zip(got, ref_grads, got_full):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, r.to(g.dtype), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g, f, rtol=1e-5, atol=1e-7)
    for f in ("ce_sum", "l1_sum", "conf_sum", "accept_sum", "tau_sum"):
        torch.testing.assert_close(getattr(out, f), getattr(full, f))
    assert torch.equal(out.top1_correct, full.top1_correct)


@pytest.mark.parametrize("chunk_size", [2, None])
def test_loss_vocabulary_is_a_softmax_over_those_columns(chunk_size):
    """loss.vocab_size: every term as the hand formula with both distributions cut to the kept columns and
    renormalised there; the Markov rows of dropped tokens get no gradient; nothing vocabulary-sized is full width."""
    model, b = TinyBlockDrafter(vocab=64), make_batch(n=7, vocab=24)  # labels < 24 index into vocab_ids
    vocab_ids = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:24].sort().values
    ref, terms = hand_sums(model, b, 4.0, **DSPARK, vocab_ids=vocab_ids)
    out = block_loss(model, BlockLossBatch(**b, vocab_ids=vocab_ids),
                     BlockLossSettings(**DSPARK, gamma_decay=4.0, chunking=LossChunking(chunk_size=chunk_size)))
    torch.testing.assert_close(out.loss_sum, ref["loss"].float())
    for field, key in (("ce_sum", "ce"), ("l1_sum", "l1"), ("conf_sum", "bce")):
        torch.testing.assert_close(getattr(out, field), ref[key].float())
    assert torch.equal(out.top1_correct, ((terms["argmax"] == b["labels"]) & b["valid"]).sum(0))
    g_w2 = torch.autograd.grad(out.loss_sum, model.markov_w2.weight)[0]
    dropped = torch.ones(64, dtype=torch.bool)
    dropped[vocab_ids] = False
    assert g_w2[dropped].abs().sum() == 0 and g_w2[vocab_ids].abs().sum() > 0
    # the full-vocabulary loss is a different objective on the same batch
    full = block_loss(model, BlockLossBatch(**b), BlockLossSettings(**DSPARK, gamma_decay=4.0))
    assert not torch.allclose(full.loss_sum, out.loss_sum)


@pytest.mark.parametrize("vocab_ids", [None, torch.arange(0, 64, 3)])
def test_target_labels_are_the_target_argmax(vocab_ids):
    """loss.ce_labels=target: the same loss as with the target's argmax (over the loss vocabulary) passed as the
    labels, whatever the batch's own labels are; DFlash's CE-only weights too (no target distribution otherwise)."""
    model, b = TinyBlockDrafter(), make_batch(n=7)
    head = model.lm_head(b["target_hidden"])
    argmax = (head if vocab_ids is None else head[..., vocab_ids]).argmax(-1)
    for alphas in (DSPARK, dict(ce_alpha=1.0, l1_alpha=0.0, conf_alpha=0.0)):
        settings = BlockLossSettings(**alphas, gamma_decay=4.0)
        got = block_loss(model, BlockLossBatch(**b, vocab_ids=vocab_ids), replace(settings, target_labels=True))
        want = block_loss(model, BlockLossBatch(**{**b, "labels": argmax}, vocab_ids=vocab_ids), settings)
        torch.testing.assert_close(got.loss_sum, want.loss_sum)
        assert torch.equal(got.top1_correct, want.top1_correct)
        mine = block_loss(model, BlockLossBatch(**{**b, "labels": b["labels"].clamp(min=0) % 21}, vocab_ids=vocab_ids),
                          settings)
        assert not torch.allclose(mine.loss_sum, got.loss_sum)  # the batch's labels are really ignored


def vocab_sized_saved(run_loss, width: int, **kw) -> list[tuple]:
    """Shapes of the tensors autograd saves for the backward of `run_loss(**kw)` whose last dim is `width`."""
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = run_loss(**kw)
    out.loss_sum.backward()
    return [s for s in shapes if len(s) >= 2 and s[-1] == width]


def test_checkpointed_chunks_save_nothing_vocab_sized():
    """With checkpointing, the graph outside the chunks holds no [.., V] tensor: the backward recomputes them."""
    vocab = 97
    model, b = TinyBlockDrafter(vocab=vocab), make_batch(n=7, vocab=vocab)

    def run(**kw):
        return block_loss(model, BlockLossBatch(**b),
                          BlockLossSettings(**DSPARK, gamma_decay=4.0, chunking=LossChunking(chunk_size=2, **kw)))

    assert (2, 5, vocab) in vocab_sized_saved(run, vocab, use_checkpoint=False)
    assert vocab_sized_saved(run, vocab, use_checkpoint=True) == []


def test_auto_chunk_size():
    assert auto_chunk_size(7 * 151936 * 4) == 63  # Qwen3 vocabulary, gamma 7, 256 MiB
    assert auto_chunk_size(10, chunk_bytes=35) == 3
    assert auto_chunk_size(10**12) == 1


def test_dflash_weights_give_exactly_ce_and_skip_target_work():
    model, b = TinyBlockDrafter(), make_batch()
    dflash = BlockLossSettings(ce_alpha=1.0, l1_alpha=0.0, conf_alpha=0.0, gamma_decay=4.0)
    out = block_loss(model, BlockLossBatch(**b), replace(dflash, chunking=LossChunking(chunk_size=3)))
    assert model.target_calls == 0 and model.conf_calls == 0
    assert torch.equal(out.loss_sum.detach(), out.ce_sum)
    ref, _ = hand_sums(model, b, 4.0, 1.0, 0.0, 0.0)
    torch.testing.assert_close(out.loss_sum, ref["ce"].float())
    model.target_calls = model.conf_calls = 0
    assert out.l1_sum.item() == 0.0 and out.conf_sum.item() == 0.0
    assert torch.isnan(out.accept_sum).all() and out.accept_sum.shape == (5,) and torch.isnan(out.tau_sum)
    g = grads(out.loss_sum, model, b["draft_hidden"])
    assert g[-1].abs().sum() == 0 and g[-2].abs().sum() == 0  # conf_head untouched

    # Forcing the acceptance statistics costs target logits but does not change the loss.
    out2 = block_loss(model, BlockLossBatch(**b), replace(dflash, accept_stats=True))
    assert model.target_calls > 0 and model.conf_calls == 0
    torch.testing.assert_close(out2.loss_sum, out.loss_sum)
    full = block_loss(model, BlockLossBatch(**b), BlockLossSettings(**DSPARK, gamma_decay=4.0))
    torch.testing.assert_close(out2.accept_sum, full.accept_sum)
    torch.testing.assert_close(out2.tau_sum, full.tau_sum)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_soft_ce_is_cross_entropy_against_the_target_distribution(chunk_size):
    """loss.soft_ce_alpha: sum w_k * -sum_v p_target(v) log p_draft(v), added to the other terms, with its gradient."""
    model, b = TinyBlockDrafter(), make_batch()
    t = hand_terms(model, b, 4.0)
    p_t = torch.softmax(model.lm_head(b["target_hidden"]), dim=-1)
    logp_d = torch.log_softmax(model.draft_logits(b["draft_hidden"], b["prev_ids"]), dim=-1)
    soft = (t["w"] * torch.where(b["valid"], -(p_t * logp_d).sum(-1), 0.0)).sum()
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(
        ce_alpha=0.5, l1_alpha=0.0, conf_alpha=0.0, soft_ce_alpha=2.0, gamma_decay=4.0,
        chunking=LossChunking(chunk_size=chunk_size)))
    ce = (t["w"] * torch.where(b["valid"], t["ce"], 0.0)).sum()
    torch.testing.assert_close(out.loss_sum, (0.5 * ce + 2.0 * soft).float())
    for mine, want in zip(grads(out.loss_sum, model, b["draft_hidden"]),
                          grads(0.5 * ce + 2.0 * soft, model, b["draft_hidden"])):
        torch.testing.assert_close(mine, want)


@pytest.mark.parametrize("alphas", [(0.0, 0.9, 1.0), (0.1, 0.0, 1.0), (0.1, 0.9, 0.0), (0.0, 0.0, 2.0),
                                    (0.0, 0.5, 0.0)])
def test_zero_alpha_terms_contribute_nothing(alphas):
    model, b = TinyBlockDrafter(), make_batch()
    ce_a, l1_a, conf_a = alphas
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(
        ce_alpha=ce_a, l1_alpha=l1_a, conf_alpha=conf_a, gamma_decay=4.0, chunking=LossChunking(chunk_size=2)))
    assert (model.conf_calls > 0) == (conf_a > 0)
    ref, _ = hand_sums(model, b, 4.0, ce_a, l1_a, conf_a)
    torch.testing.assert_close(out.loss_sum, ref["loss"].float())
    got = grads(out.loss_sum, model, b["draft_hidden"])
    want = grads(ref["loss"], model, b["draft_hidden"])
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r.to(g.dtype), rtol=1e-5, atol=1e-7)
    if conf_a == 0:
        assert got[-1].abs().sum() == 0
    if ce_a == 0 and l1_a == 0:  # only the confidence head (and the W1 embedding it reads) learns
        assert all(got[i].abs().sum() == 0 for i in (1, 2, 4))  # proj.w, proj.b, markov_w2


def test_cstar_is_detached():
    """The confidence head here does not read h, so BCE can only reach draft_hidden through c*; it must not."""
    model, b = TinyBlockDrafter(conf_uses_hidden=False), make_batch()
    dh = b["draft_hidden"]
    l1_conf = BlockLossSettings(ce_alpha=0.0, l1_alpha=0.9, conf_alpha=1.0, gamma_decay=4.0,
                                chunking=LossChunking(chunk_size=3))
    with_conf = block_loss(model, BlockLossBatch(**b), l1_conf)
    no_conf = block_loss(model, BlockLossBatch(**b), replace(l1_conf, conf_alpha=0.0))
    (g_with,) = torch.autograd.grad(with_conf.loss_sum, dh)
    (g_without,) = torch.autograd.grad(no_conf.loss_sum, dh)
    torch.testing.assert_close(g_with, g_without, rtol=1e-6, atol=1e-9)

    # The check can fail: a c* that carried gradient would move draft_hidden's gradient.
    t = hand_terms(model, b, 4.0)
    z = model.confidence_logits(dh, b["prev_ids"])
    live_c = (1 - 0.5 * t["l1"]).clamp(0, 1)
    bce_live = (t["w"] * torch.where(b["valid"], F.binary_cross_entropy_with_logits(z, live_c, reduction="none"),
                                     0.0)).sum()
    (g_live,) = torch.autograd.grad(bce_live, dh)
    assert g_live.abs().max() > 1e-6
    (g_conf_only,) = torch.autograd.grad(
        block_loss(model, BlockLossBatch(**b), BlockLossSettings(ce_alpha=0.0, l1_alpha=0.0, conf_alpha=1.0,
                                                                 gamma_decay=4.0)).loss_sum, dh,
        allow_unused=True)
    assert g_conf_only is None or g_conf_only.abs().max() == 0


def test_all_padding_and_bad_inputs():
    model, b = TinyBlockDrafter(), make_batch(n=3, prefix=[0, 0, 0])
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(**DSPARK, gamma_decay=4.0))
    assert out.loss_sum.item() == 0.0 and out.weight_sum.item() == 0.0 and out.num_anchors.item() == 0
    out.loss_sum.backward()  # still differentiable
    b = make_batch()
    with pytest.raises(ValueError, match="labels"):
        block_loss(model, BlockLossBatch(**{**b, "labels": b["labels"][:, :2]}), BlockLossSettings(**DSPARK,
                                                                                                   gamma_decay=4.0))
    with pytest.raises(ValueError, match="bool"):
        block_loss(model, BlockLossBatch(**{**b, "valid": b["valid"].long()}), BlockLossSettings(**DSPARK,
                                                                                                 gamma_decay=4.0))


def test_bf16_model_gives_fp32_sums():
    model, b = TinyBlockDrafter(dtype=torch.bfloat16), make_batch(dtype=torch.bfloat16)
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(**DSPARK, gamma_decay=4.0,
                                                                   chunking=LossChunking(chunk_size=2)))
    assert out.loss_sum.dtype == torch.float32 and torch.isfinite(out.loss_sum)
    out.loss_sum.backward()
    assert b["draft_hidden"].grad is not None and torch.isfinite(b["draft_hidden"].grad).all()


# --------------------------------------------------------------------------------------------------------------
# eagle3_loss
# --------------------------------------------------------------------------------------------------------------


def eagle3_setup(b=2, t=9, hidden=12, vocab=50, steps=3, seed=0):
    torch.manual_seed(seed)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab)[:30]] = True
    target_head = nn.Linear(hidden, vocab, bias=True, dtype=F64).requires_grad_(False)
    draft_head = nn.Linear(hidden, int(t2d.sum()), dtype=F64)
    step_hidden = [torch.randn(b, t, hidden, dtype=F64, requires_grad=True) for _ in range(steps)]
    target_hidden = torch.randn(b, t, hidden, dtype=F64)
    valid = [torch.rand(b, t) > 0.2 for _ in range(steps)]
    return dict(step_logits_fn=draft_head, step_hidden=step_hidden, target_hidden=target_hidden,
                target_lm_head=target_head, t2d=t2d, valid=valid), draft_head


def eagle3_hand(inp, step_decay):
    """Loops over steps and positions: step k at position t against the target at t+k+1, draft vocabulary only."""
    sh, th, head, t2d, valid = (inp["step_hidden"], inp["target_hidden"], inp["target_lm_head"], inp["t2d"],
                                inp["valid"])
    b, t_len, _ = th.shape
    steps = len(sh)
    loss, weight = 0.0, 0.0
    ce_sum, acc, count = [0.0] * steps, [0] * steps, [0] * steps
    for k in range(steps):
        for i in range(b):
            for t in range(t_len):
                if not valid[k][i, t] or t + k + 1 >= t_len:
                    continue
                full = head(th[i, t + k + 1])  # [V]
                p_t = torch.exp(full[t2d]) / torch.exp(full[t2d]).sum()
                d = inp["step_logits_fn"](sh[k][i, t])
                log_q = d - torch.log(torch.exp(d).sum())
                ce = -(p_t * log_q).sum()
                loss = loss + step_decay**k * ce
                weight += step_decay**k
                ce_sum[k] += ce.item()
                acc[k] += int((d.argmax() == p_t.argmax()).item())
                count[k] += 1
    return loss, weight, ce_sum, acc, count


@pytest.mark.parametrize("chunk_size", [1, 3, 9, None])
def test_eagle3_soft_ce_matches_direct_formula(chunk_size):
    inp, draft_head = eagle3_setup()
    out = eagle3_loss(**inp, settings=Eagle3LossSettings(step_decay=0.8, chunking=LossChunking(chunk_size=chunk_size)))
    loss, weight, ce_sum, acc, count = eagle3_hand(inp, 0.8)
    torch.testing.assert_close(out.loss_sum, loss.float())
    assert out.weight_sum.item() == pytest.approx(weight, rel=1e-6)
    torch.testing.assert_close(out.ce_sum, torch.tensor(ce_sum, dtype=torch.float32))
    assert out.acc_sum.tolist() == acc and out.acc_count.tolist() == count
    assert count[2] <= 2 * (9 - 3)  # step 2 cannot use the last 3 positions

    params = [*inp["step_hidden"], *draft_head.parameters()]
    got = torch.autograd.grad(out.loss_sum, params)
    want = torch.autograd.grad(loss, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)


def test_eagle3_restriction_and_decay_matter():
    """The draft-vocab renormalisation and the step decay are not no-ops (so the test above can fail)."""
    inp, _ = eagle3_setup()
    out = eagle3_loss(**inp, settings=Eagle3LossSettings(step_decay=0.8))
    flat = eagle3_loss(**inp, settings=Eagle3LossSettings(step_decay=1.0))
    assert flat.loss_sum.item() != pytest.approx(out.loss_sum.item(), rel=1e-4)
    torch.testing.assert_close(out.loss_sum, (out.ce_sum * torch.tensor([1.0, 0.8, 0.64])).sum())
    # Full-vocab softmax then slicing would give a different (unnormalised) target.
    head, th, t2d = inp["target_lm_head"], inp["target_hidden"], inp["t2d"]
    sliced = torch.softmax(head(th), -1)[..., t2d]
    assert not torch.allclose(sliced.sum(-1), torch.ones_like(sliced.sum(-1)))


def test_eagle3_checkpoint_saves_nothing_vocab_sized():
    inp, _ = eagle3_setup(b=1, t=12, vocab=50)
    vocab_d = int(inp["t2d"].sum())

    def run(**kw):
        chunking = LossChunking(chunk_size=4, **kw)
        return eagle3_loss(**inp, settings=Eagle3LossSettings(step_decay=0.8, chunking=chunking))

    assert (1, 4, vocab_d) in vocab_sized_saved(run, vocab_d, use_checkpoint=False)
    assert vocab_sized_saved(run, vocab_d, use_checkpoint=True) == []  # the backward recomputes each chunk's log-probabilities


def test_all_alphas_zero_is_a_differentiable_zero():
    model, b = TinyBlockDrafter(), make_batch()
    out = block_loss(model, BlockLossBatch(**b), BlockLossSettings(
        ce_alpha=0.0, l1_alpha=0.0, conf_alpha=0.0, gamma_decay=4.0, chunking=LossChunking(chunk_size=3)))
    assert out.loss_sum.item() == 0.0 and out.ce_sum.item() > 0
    out.loss_sum.backward()


def test_eagle3_loss_norm_positions_divides_by_the_batch_tokens():
    """loss.eagle3_loss_norm: valid_tokens = sum_k decay^k x valid positions of step k; positions (DeepSpec) = the
    batch's real tokens, whatever the steps' valid counts."""
    from core.recipe import load_recipe
    from train.algorithms import Eagle3Algorithm

    records = [{"input_ids": torch.arange(10), "loss_mask": torch.tensor([0] * 4 + [1] * 6)},
               {"input_ids": torch.arange(6), "loss_mask": torch.tensor([0, 0, 1, 1, 1, 1])}]
    token_mean = Eagle3Algorithm.make_batch(load_recipe("eagle3_smollm2_135m", ["draft.ttt_length=3"]), records,
                                            [], "cpu")
    valid = token_mean["step_valid"]
    assert token_mean["weight_sum"] == pytest.approx(sum(0.8**k * float(v.sum()) for k, v in enumerate(valid)))
    deepspec = Eagle3Algorithm.make_batch(load_recipe("eagle3_smollm2_135m", ["draft.ttt_length=3",
                                                                              "loss.eagle3_loss_norm=positions"]),
                                          records, [], "cpu")
    assert deepspec["weight_sum"] == 16.0 != token_mean["weight_sum"]


def test_the_step_reaches_the_block_loss_as_an_argument(tiny_qwen3):
    """loss.ce_warmup_steps: forward(batch, step) trains CE alone before that step and the recipe's weighted sum from
    it on; the module keeps no step of its own."""
    from core.recipe import load_recipe
    from modeling.target import load_target
    from train.algorithms import BlockAlgorithm, attach_hidden

    recipe = load_recipe("dspark_qwen3_8b", [f"target.name_or_path={tiny_qwen3}", "draft.num_layers=1",
                                             "draft.markov_rank=8", "draft.block_size=3", "loss.ce_warmup_steps=2"])
    torch.manual_seed(0)
    module = BlockAlgorithm.build(recipe, load_target(str(tiny_qwen3)), None)
    width, hidden = len(recipe.target.layer_ids), module.draft.config.hidden_size
    g = torch.Generator().manual_seed(0)
    records = [{"input_ids": torch.randint(0, 1000, (16,), generator=g),
                "loss_mask": torch.tensor([0] * 4 + [1] * 12, dtype=torch.uint8),
                "hidden_states": torch.randn(16, width * hidden, generator=g),
                "last_hidden_state": torch.randn(16, hidden, generator=g)}]
    batch = attach_hidden(BlockAlgorithm.make_batch(recipe, records, [(0, 0, 0)], "cpu"), records, "cpu",
                          torch.float32)
    with torch.no_grad():
        warm, trained = module(batch, 1), module(batch, 2)
    loss = recipe.loss
    assert warm.loss_sum.item() == pytest.approx(warm.ce_sum.item())
    assert trained.loss_sum.item() == pytest.approx(loss.ce_alpha * trained.ce_sum.item() + loss.l1_alpha
                                                    * trained.l1_sum.item() + loss.conf_alpha * trained.conf_sum.item())
    assert trained.conf_sum.item() > 0 and not hasattr(module, "step")


# --- the settings objects ---------------------------------------------------------------------------------------------


def test_block_settings_come_from_every_loss_key_of_the_recipe():
    """BlockLossSettings.from_recipe is where the recipe's loss keys become the loss's: each key lands on its field
    (values unlike the defaults, so a key read from the wrong place shows), and the warm-up steps train CE alone."""
    from core.recipe import load_recipe

    loss = load_recipe("dflash2_smollm2_135m", [
        "loss.ce_alpha=0.3", "loss.l1_alpha=0.2", "loss.conf_alpha=0.5", "loss.loss_decay_gamma=2.5",
        "loss.soft_ce_alpha=0.7", "loss.selector_alpha=0.4", "loss.ce_labels=target", "loss.accept_stats=false",
        "loss.checkpoint=false", "loss.ce_warmup_steps=3"]).loss
    trained = BlockLossSettings(ce_alpha=0.3, l1_alpha=0.2, conf_alpha=0.5, gamma_decay=2.5, soft_ce_alpha=0.7,
                                selector_alpha=0.4, target_labels=True, accept_stats=False,
                                chunking=LossChunking(use_checkpoint=False))
    assert BlockLossSettings.from_recipe(loss, 3) == BlockLossSettings.from_recipe(loss, 40) == trained
    assert BlockLossSettings.from_recipe(loss, 2) == replace(trained, ce_alpha=1.0, l1_alpha=0.0, conf_alpha=0.0,
                                                             selector_alpha=0.0)
    dspark = BlockLossSettings.from_recipe(load_recipe("dspark_smollm2_135m", ["loss.checkpoint=true"]).loss, 0)
    assert not dspark.target_labels and dspark.chunking == LossChunking() and dspark.want_cstar

    eagle3 = load_recipe("eagle3_smollm2_135m", ["loss.step_loss_decay=0.6", "loss.checkpoint=false"]).loss
    assert Eagle3LossSettings.from_recipe(eagle3) == Eagle3LossSettings(0.6, LossChunking(use_checkpoint=False))


def test_settings_refuse_bad_values_by_name():
    with pytest.raises(ValueError, match=r"loss alphas must be >= 0, got ce=0.1 l1=0.9 conf=1.0 soft_ce=-0.5"):
        BlockLossSettings(**DSPARK, gamma_decay=4.0, soft_ce_alpha=-0.5)
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1 \(or None: sized from chunk_bytes\), got 0"):
        LossChunking(chunk_size=0)
    assert LossChunking(chunk_bytes=35).rows(10) == 3 and LossChunking(chunk_size=5, chunk_bytes=35).rows(10) == 5
    b = make_batch()
    with pytest.raises(ValueError, match=r"target_hidden must be \[N, gamma, H\]"):
        BlockLossBatch(**{**b, "target_hidden": b["target_hidden"][:3]})
    batch = BlockLossBatch(**b, vocab_ids=torch.arange(10))
    picked = batch.rows(torch.tensor([4, 1]))
    assert torch.equal(picked.labels, b["labels"][[4, 1]]) and picked.vocab_ids is batch.vocab_ids
