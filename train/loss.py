"""The one loss module for every drafter family: block drafters (DSpark, DFlash) and Eagle3.

Both losses return **sums**, never means. The trainer all-reduces ``weight_sum`` over ranks and micro-batches and
divides ``loss_sum`` by that global total, so a run on several ranks optimises the same objective as one rank.

Memory. A vocabulary-sized tensor for every prediction at once is the hot spot (Qwen3: 512 anchors x 7 x 151,936 x
fp32 = 2.2 GB per probability tensor, several of them alive in the backward). Both losses therefore walk over
anchors (positions, for Eagle3) in chunks, and run each chunk under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps nothing vocabulary-sized, the
backward recomputes one chunk's logits at a time. Peak memory is a handful of ``[chunk, gamma, V]`` fp32 tensors
whatever the number of anchors (measured: benchmarks/README.md, "Loss memory"). The model callables must be
deterministic (or draw from torch's RNG, whose state the checkpoint restores), since the backward calls them again.
``chunk_size`` defaults to the largest chunk whose ``[chunk, gamma, V]`` fp32 tensor fits in ``chunk_bytes``
(256 MiB); the chunked result equals the unchunked one up to floating-point summation order.

Block drafters (``block_loss``), per prediction k = 1..gamma of each anchor, all softmaxes at T=1 in fp32 (or in
the input's precision if that is higher):

* w_k = exp(-(k-1)/gamma_decay) * valid_k (``gamma_decay=None``: no decay, w_k = valid_k);
* CE  = sum w * CE(draft_logits, label);
* L1  = sum w * ||p_draft - p_target||_1 (no 1/2: this is 2 * total variation);
* BCE = sum w * BCEWithLogits(confidence_logit, c*), with c* = clamp(1 - 1/2 ||p_draft - p_target||_1, 0, 1)
  detached (the analytic acceptance probability of the prediction under a teacher-forced prefix);
* SEL = sum w * CE_K(selector scores over the draft's top-K candidates, the label's place) (DFlash2,
  modeling/selector.py: the label put in place of the K-th candidate when absent; the candidates' unary score is
  their log-probability, which gives the K-way softmax of the raw logits SGLang scores with);
* loss_sum = ce_alpha * CE + l1_alpha * L1 + conf_alpha * BCE + selector_alpha * SEL.

A term whose alpha is 0 adds nothing and costs as little as it can: with ``l1_alpha == conf_alpha == 0`` (DFlash)
neither the target logits nor any probability tensor is computed, and ``confidence_logits`` is only called when
``conf_alpha > 0``. The acceptance statistics (``accept_sum``, ``tau_sum``) need p_target, so by default they are only
produced when it is computed anyway (otherwise they are NaN); ``accept_stats=True`` forces them (forward-only, under
``no_grad``).

Each loss takes its inputs and one frozen settings object: ``block_loss(model, BlockLossBatch, BlockLossSettings)``,
``eagle3_loss(..., Eagle3LossSettings)``; both settings carry a ``LossChunking``. ``from_recipe`` builds them from a
recipe's ``loss`` section, the one place the trainer's keys become the loss's (train/algorithms.py calls it).

Eagle3 (``eagle3_loss``): TTT step k's draft logits at position t are compared with the target distribution at
position t+k+1, restricted to the draft vocabulary (``t2d``) and renormalised there: soft CE
-sum p_target * log_softmax(draft_logits), weighted by ``step_decay ** k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from core.recipe import LossConfig
from modeling.cpu_linear import fast_linear
from modeling.dspark import output_rows
from modeling.selector import training_candidates

DEFAULT_CHUNK_BYTES = 256 * 2**20  # bytes of one fp32 [chunk, gamma, V] tensor (Eagle3: see eagle3_loss)


def auto_chunk_size(row_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Largest number of rows of ``row_bytes`` each that fits in ``chunk_bytes`` (at least 1)."""
    return max(1, int(chunk_bytes) // max(1, int(row_bytes)))


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 for half-precision inputs; fp32/fp64 inputs are kept as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _out_features(linear) -> int:
    out = getattr(linear, "out_features", None)
    return int(out) if out is not None else int(linear.weight.shape[0])


def position_weights(gamma: int, gamma_decay: float | None, device=None, dtype=torch.float32) -> torch.Tensor:
    """[gamma]: w_k = exp(-(k-1)/gamma_decay) for k = 1..gamma (all ones when gamma_decay is None)."""
    k = torch.arange(gamma, dtype=dtype, device=device)
    if gamma_decay is None:
        return torch.ones_like(k)
    if gamma_decay <= 0:
        raise ValueError(f"gamma_decay must be > 0 (or None for no decay), got {gamma_decay}")
    return torch.exp(-k / float(gamma_decay))


def block_weight_sum(valid: torch.Tensor, gamma_decay: float | None) -> float:
    """The block loss's denominator for a batch: sum of w_k over its valid predictions ([..., gamma] bool), in
    float64. The trainer adds it up over micro-batches and ranks before dividing, so the whole global batch
    shares one denominator."""
    return float((valid.double() * position_weights(valid.shape[-1], gamma_decay, dtype=torch.float64)).sum())


def step_weights(steps: int, step_decay: float) -> list[float]:
    """[steps]: Eagle3's weight of TTT step k = 0..steps-1, step_decay**k."""
    return [float(step_decay) ** k for k in range(steps)]


def eagle3_weight_sum(counts: Sequence, step_decay: float):
    """Eagle3's denominator: sum over TTT steps k of step_decay**k x counts[k], the valid positions of step k (numbers,
    or 0-d tensors for a tensor). The trainer adds a batch's up over micro-batches and ranks before dividing."""
    return sum(w * c for w, c in zip(step_weights(len(counts), step_decay), counts))


@dataclass(frozen=True)
class LossChunking:
    """How a loss walks over its rows (anchors for ``block_loss``, positions along T for ``eagle3_loss``): the module
    docstring's "Memory"."""

    #: rows per checkpointed chunk; None: the most whose vocabulary-sized fp32 tensors fit ``chunk_bytes`` (each loss
    #: says which tensors: ``[chunk, gamma, V]`` for block_loss, K+1 ``[B, chunk, Vd]`` for eagle3_loss)
    chunk_size: int | None = None
    #: the byte budget that sizes a chunk when ``chunk_size`` is None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: False keeps every chunk's activations for the backward (faster, memory grows with the rows; for measurements
    #: and small problems); True recomputes each chunk in the backward (loss.checkpoint)
    use_checkpoint: bool = True

    def __post_init__(self):
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None: sized from chunk_bytes), got {self.chunk_size}")

    def rows(self, row_bytes: int) -> int:
        """Rows per chunk, for rows whose vocabulary-sized fp32 tensors take ``row_bytes`` together."""
        return auto_chunk_size(row_bytes, self.chunk_bytes) if self.chunk_size is None else self.chunk_size

    def run(self, chunk_fn: Callable, *args):
        """``chunk_fn(*args)``, under a non-reentrant checkpoint when ``use_checkpoint`` and autograd records."""
        if self.use_checkpoint and torch.is_grad_enabled():
            return checkpoint(chunk_fn, *args, use_reentrant=False)
        return chunk_fn(*args)


# --------------------------------------------------------------------------------------------------------------
# Block drafters: DSpark, DFlash
# --------------------------------------------------------------------------------------------------------------


@dataclass
class BlockLossOut:
    """Local sums of one micro-batch. Everything but ``loss_sum`` is detached.

    loss_sum       scalar with grad: ce_alpha*CE + l1_alpha*L1 + conf_alpha*BCE (weighted sums)
    weight_sum     scalar: sum of the position weights w over valid predictions
    ce_sum, l1_sum, conf_sum   scalars: the weighted sums of each term before its alpha (l1_sum/conf_sum are 0 when
                   the term was not computed)
    accept_sum     [gamma]: sum of c*_k over valid predictions at position k (NaN when not computed, see
                   ``accept_stats``: never a made-up 0)
    accept_count   [gamma]: number of valid predictions at position k
    tau_sum        scalar: sum over anchors with >= 1 valid prediction of 1 + sum_k prod_{i<=k} c*_i, with c* = 0 past
                   the valid prefix (NaN when not computed)
    num_anchors    scalar: anchors with >= 1 valid prediction
    top1_correct   [gamma]: valid predictions whose draft argmax equals the label
    selector_sum   scalar: the weighted selector CE before selector_alpha (0 without one)
    selector_top1  [gamma]: valid predictions whose selector pick (teacher-forced predecessor) equals the label
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    ce_sum: torch.Tensor
    l1_sum: torch.Tensor
    conf_sum: torch.Tensor
    accept_sum: torch.Tensor
    accept_count: torch.Tensor
    tau_sum: torch.Tensor
    num_anchors: torch.Tensor
    top1_correct: torch.Tensor
    selector_sum: torch.Tensor | None = None
    selector_top1: torch.Tensor | None = None


@dataclass(frozen=True)
class BlockLossSettings:
    """block_loss's weights and switches (the terms: module docstring). ``from_recipe`` builds it from a recipe."""

    #: weight of the CE against the labels (loss.ce_alpha)
    ce_alpha: float
    #: weight of the L1 term, ||p_draft - p_target||_1 (loss.l1_alpha)
    l1_alpha: float
    #: weight of the confidence head's BCE against c* (loss.conf_alpha; ``model.confidence_logits`` is only called
    #: when > 0)
    conf_alpha: float
    #: w_k = exp(-(k-1)/gamma_decay) per block position k (loss.loss_decay_gamma); None: no decay
    gamma_decay: float | None
    #: weight of the CE against the target's whole distribution (dense soft labels; loss.soft_ce_alpha)
    soft_ce_alpha: float = 0.0
    #: weight of DFlash2's selector CE (``model.candidate_selector``; its statistics are computed whenever the model
    #: has one; loss.selector_alpha)
    selector_alpha: float = 0.0
    #: the CE label (and top-1 statistic) of each prediction is the target's argmax there, from
    #: ``lm_head(target_hidden)``, instead of the batch's labels (loss.ce_labels: target); the selector's too
    target_labels: bool = False
    #: compute accept_sum/tau_sum (else they are NaN); None: only when p_target is needed anyway (l1 or conf alpha >
    #: 0). True costs DFlash one no-grad target-logit matmul and softmax per chunk in the forward (the backward's
    #: recompute stops before it; loss.accept_stats)
    accept_stats: bool | None = None
    #: anchors per checkpointed chunk: by default the most whose fp32 [chunk, gamma, V] fits chunk_bytes
    chunking: LossChunking = LossChunking()

    def __post_init__(self):
        alphas = dict(ce=self.ce_alpha, l1=self.l1_alpha, conf=self.conf_alpha, soft_ce=self.soft_ce_alpha,
                      selector=self.selector_alpha)
        if min(alphas.values()) < 0:
            raise ValueError("loss alphas must be >= 0, got " + " ".join(f"{k}={v}" for k, v in alphas.items()))

    @classmethod
    def from_recipe(cls, loss: LossConfig, step: int) -> BlockLossSettings:
        """The recipe's ``loss`` section at optimizer step ``step``: CE alone (weight 1, no L1, confidence or selector
        term) during the first loss.ce_warmup_steps steps, the recipe's weights from then on."""
        alphas = dict(ce_alpha=loss.ce_alpha, l1_alpha=loss.l1_alpha, conf_alpha=loss.conf_alpha,
                      selector_alpha=loss.selector_alpha)
        if step < loss.ce_warmup_steps:
            alphas = dict(ce_alpha=1.0, l1_alpha=0.0, conf_alpha=0.0, selector_alpha=0.0)
        # accept_stats: DFlash too by default, the training tau estimate needs the target distribution
        return cls(**alphas, gamma_decay=loss.loss_decay_gamma, soft_ce_alpha=loss.soft_ce_alpha,
                   target_labels=loss.ce_labels == "target", accept_stats=loss.accept_stats,
                   chunking=LossChunking(use_checkpoint=loss.checkpoint))

    @property
    def want_cstar(self) -> bool:
        """Whether p_target and c* are computed: a term needs them, or accept_stats asks for the statistics."""
        needed = bool(self.l1_alpha or self.conf_alpha)
        return needed if self.accept_stats is None else bool(self.accept_stats or needed)

    @property
    def trains_draft_logits(self) -> bool:
        """Whether a term differentiates the draft logits (otherwise p_draft only feeds the detached c*)."""
        return bool(self.ce_alpha or self.l1_alpha or self.soft_ce_alpha or self.selector_alpha)


@dataclass(frozen=True)
class BlockLossBatch:
    """What block_loss reads of one micro-batch: N anchors of gamma predictions each. A bad shape or dtype is refused
    here, naming the field."""

    #: [N, gamma, H], the draft's states (with grad)
    draft_hidden: torch.Tensor
    #: [N, gamma, H], the target's final-norm states whose ``model.lm_head`` gives each prediction's target
    #: distribution (no grad)
    target_hidden: torch.Tensor
    #: [N, gamma] long, the next tokens (indices into ``vocab_ids`` when it is given); ignored where not valid
    labels: torch.Tensor
    #: [N, gamma] long, each prediction's predecessor token (the Markov bias and the selector read it)
    prev_ids: torch.Tensor
    #: [N, gamma] bool, a contiguous valid prefix per anchor
    valid: torch.Tensor
    #: [V'] long: every softmax (draft and target) over these tokens only, renormalised there; ``labels`` then index
    #: into it (loss.vocab_size: the caller maps them and marks the rest invalid). None: the whole vocabulary
    vocab_ids: torch.Tensor | None = None

    def __post_init__(self):
        if self.draft_hidden.dim() != 3:
            raise ValueError(f"draft_hidden must be [N, gamma, H], got {tuple(self.draft_hidden.shape)}")
        n, gamma, _ = self.draft_hidden.shape
        for name in ("labels", "prev_ids", "valid"):
            if tuple(getattr(self, name).shape) != (n, gamma):
                raise ValueError(f"{name} must be [N, gamma] = {(n, gamma)}, got {tuple(getattr(self, name).shape)}")
        if tuple(self.target_hidden.shape[:2]) != (n, gamma):
            raise ValueError(f"target_hidden must be [N, gamma, H] with N, gamma = {(n, gamma)}, "
                             f"got {tuple(self.target_hidden.shape)}")
        if self.valid.dtype != torch.bool:
            raise ValueError(f"valid must be bool, got {self.valid.dtype}")

    def rows(self, index: torch.Tensor | slice) -> BlockLossBatch:
        """The anchors at ``index`` (a 1-D long tensor of rows, or a slice); ``vocab_ids`` is shared."""
        pick = (lambda t: t[index]) if isinstance(index, slice) else (lambda t: t.index_select(0, index))
        return BlockLossBatch(pick(self.draft_hidden), pick(self.target_hidden), pick(self.labels),
                              pick(self.prev_ids), pick(self.valid), self.vocab_ids)


def _selector_term(model, h, logp, labels, prev_ids, valid, w, vocab_ids):
    """(weighted K-way CE sum with grad, [gamma] picks equal to the label) of DFlash2's selector on one chunk."""
    selector = model.candidate_selector
    places, safe = logp.detach().topk(selector.top_k, dim=-1).indices, torch.where(valid, labels, 0)
    candidates, target = training_candidates(places, safe)
    scores = logp.gather(-1, candidates) + selector.transition(
        h, prev_ids, candidates if vocab_ids is None else vocab_ids[candidates]).float()
    nll = -torch.log_softmax(scores, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        top1 = ((scores.argmax(-1) == target) & valid).sum(0)
    return (w * torch.where(valid, nll, 0.0)).sum(), top1


def _block_chunk(model, chunk: BlockLossBatch, w: torch.Tensor, settings: BlockLossSettings):
    """One chunk of anchors (``w``: their [c, gamma] position weights, zero where not valid): returns (loss, ce, l1,
    conf, accept[gamma], tau, top1[gamma], sel, sel_top1[gamma]); only loss has grad.

    Memory-sensitive: vocabulary-sized intermediates are dropped as soon as they are used. The statistics come last,
    under no_grad, so the checkpoint's early stop skips them when the backward recomputes this chunk.
    """
    h, th, labels, prev_ids, valid, vocab_ids = (chunk.draft_hidden, chunk.target_hidden, chunk.labels,
                                                 chunk.prev_ids, chunk.valid, chunk.vocab_ids)
    ce_alpha, l1_alpha, conf_alpha = settings.ce_alpha, settings.l1_alpha, settings.conf_alpha
    soft_ce_alpha, selector_alpha = settings.soft_ce_alpha, settings.selector_alpha
    want_cstar, target_labels = settings.want_cstar, settings.target_labels
    p_t = None
    if want_cstar or soft_ce_alpha or target_labels:
        with torch.no_grad():
            head = output_rows(model.lm_head, th, vocab_ids)
            if target_labels:
                labels = head.argmax(-1)
            if want_cstar or soft_ce_alpha:
                p_t = torch.softmax(_wide(head), dim=-1)
            del head
    # With neither CE nor L1 trained, p_draft only feeds the detached c*: no graph through the draft logits.
    with torch.set_grad_enabled(torch.is_grad_enabled() and settings.trains_draft_logits):
        logits = _wide(model.draft_logits(h, prev_ids, vocab_ids))  # [c, gamma, V]
        logp = torch.log_softmax(logits, dim=-1)
        del logits
    nll = -logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ce = (w * torch.where(valid, nll, 0.0)).sum()
    terms = [ce_alpha * ce] if ce_alpha else []
    sel, sel_top1 = None, None
    if getattr(model, "candidate_selector", None) is not None:
        sel, sel_top1 = _selector_term(model, h, logp, labels, prev_ids, valid, w, vocab_ids)
        if selector_alpha:
            terms.append(selector_alpha * sel)

    l1 = cstar = bce = None
    if soft_ce_alpha:
        # cross-entropy against the target's whole distribution (Eagle3's TTT loss): dense soft labels
        soft = -(p_t * logp).sum(-1)
        terms.append(soft_ce_alpha * (w * torch.where(valid, soft, 0.0)).sum())
        del soft
    if want_cstar:
        if l1_alpha:
            dist = (logp.exp() - p_t).abs().sum(-1)  # [c, gamma], differentiable in p_draft
        else:
            with torch.no_grad():
                dist = (logp.exp() - p_t).abs().sum(-1)
        del p_t
        dist = torch.where(valid, dist, 0.0)
        l1 = (w * dist).sum()
        if l1_alpha:
            terms.append(l1_alpha * l1)
        cstar = (1.0 - 0.5 * dist.detach()).clamp(0.0, 1.0)
        if conf_alpha:
            conf_logit = _wide(model.confidence_logits(h, prev_ids))
            bce_el = F.binary_cross_entropy_with_logits(conf_logit, cstar.to(conf_logit.dtype), reduction="none")
            bce = (w * torch.where(valid, bce_el, 0.0)).sum()
            terms.append(conf_alpha * bce)

    loss = terms[0] if terms else h.sum() * 0.0  # every alpha 0: a zero that still backpropagates
    for term in terms[1:]:
        loss = loss + term

    with torch.no_grad():
        zero = ce.new_zeros(())
        gamma = valid.shape[1]
        if cstar is not None:
            c_masked = torch.where(valid, cstar, 0.0)
            accept = c_masked.sum(0)
            tau = (1.0 + torch.cumprod(c_masked, dim=1).sum(1)).sum()
        else:
            accept, tau = ce.new_zeros(gamma), zero
        top1 = ((logp.argmax(-1) == labels) & valid).sum(0)
        return (loss, ce.detach(), zero if l1 is None else l1.detach(), zero if bce is None else bce.detach(),
                accept, tau, top1, zero if sel is None else sel.detach(),
                torch.zeros_like(top1) if sel_top1 is None else sel_top1)


def block_loss(model, batch: BlockLossBatch, settings: BlockLossSettings) -> BlockLossOut:
    """DSpark/DFlash loss sums over the batch's N anchors of gamma predictions each, weighted and switched by
    ``settings``.

    model  ``draft_logits(h, prev_ids, vocab_ids) -> [n, gamma, V]`` (Markov bias included),
           ``confidence_logits(h, prev_ids) -> [n, gamma]`` (called only when conf_alpha > 0), ``lm_head`` (frozen
           Linear H -> V), and ``candidate_selector`` (DFlash2) when it has one
    """
    n, gamma, _ = batch.draft_hidden.shape
    valid = batch.valid
    device = batch.draft_hidden.device
    want_cstar = settings.want_cstar
    w_pos = position_weights(gamma, settings.gamma_decay, device)
    w_all = w_pos * valid  # [N, gamma] fp32
    accept_count = valid.sum(0)
    active = valid.any(1)
    num_anchors = active.sum()

    # Anchors without a valid prediction (padding) are dropped: they weigh nothing, and garbage in them cannot
    # turn into NaN. One host sync.
    idx = active.nonzero().squeeze(1)
    if idx.numel() != n:
        batch, w_all = batch.rows(idx), w_all.index_select(0, idx)
    m = idx.numel()

    vocab = _out_features(model.lm_head) if batch.vocab_ids is None else batch.vocab_ids.numel()
    chunk_size = settings.chunking.rows(gamma * vocab * 4)

    zero = torch.zeros((), dtype=torch.float32, device=device)
    loss_sum = batch.draft_hidden.sum() * 0.0 if m == 0 else None
    ce_sum, l1_sum, conf_sum, tau_sum = zero, zero, zero, zero
    accept_sum = torch.zeros(gamma, dtype=torch.float32, device=device)
    top1 = torch.zeros(gamma, dtype=torch.long, device=device)
    sel_sum, sel_top1 = zero, torch.zeros(gamma, dtype=torch.long, device=device)
    for s in range(0, m, chunk_size):
        e = min(m, s + chunk_size)
        out = settings.chunking.run(_block_chunk, model, batch.rows(slice(s, e)), w_all[s:e], settings)
        loss, ce, l1, conf, accept, tau, t1, sel, sel_t1 = out
        loss_sum = loss if loss_sum is None else loss_sum + loss
        sel_sum, sel_top1 = sel_sum + sel, sel_top1 + sel_t1
        ce_sum, l1_sum, conf_sum, tau_sum = ce_sum + ce, l1_sum + l1, conf_sum + conf, tau_sum + tau
        accept_sum, top1 = accept_sum + accept, top1 + t1

    return BlockLossOut(
        loss_sum=loss_sum.float(),
        weight_sum=w_all.sum().float(),
        ce_sum=ce_sum.float(),
        l1_sum=l1_sum.float(),
        conf_sum=conf_sum.float(),
        accept_sum=accept_sum.float() if want_cstar else torch.full_like(accept_sum, float("nan")),
        accept_count=accept_count,
        tau_sum=tau_sum.float() if want_cstar else torch.full_like(tau_sum, float("nan")),
        num_anchors=num_anchors,
        top1_correct=top1,
        selector_sum=sel_sum.float(),
        selector_top1=sel_top1,
    )


# --------------------------------------------------------------------------------------------------------------
# Eagle3
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Eagle3LossOut:
    """Local sums of one micro-batch. Everything but ``loss_sum`` is detached.

    loss_sum    scalar with grad: sum_k step_decay**k * sum over valid positions of the soft CE of step k
    weight_sum  scalar: sum_k step_decay**k * (number of valid positions of step k)
    ce_sum      [steps]: unweighted soft-CE sum per step
    acc_sum     [steps]: valid positions whose draft argmax equals the target argmax (both within the draft vocab)
    acc_count   [steps]: valid positions per step (positions whose target t+k+1 falls past the sequence are invalid)
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    ce_sum: torch.Tensor
    acc_sum: torch.Tensor
    acc_count: torch.Tensor


@dataclass(frozen=True)
class Eagle3LossSettings:
    """eagle3_loss's switches. ``from_recipe`` builds it from a recipe."""

    #: TTT step k's loss weighs step_decay**k (loss.step_loss_decay)
    step_decay: float
    #: positions (along T) per checkpointed chunk: by default the most for which the chunk's K step log-probabilities
    #: plus its target window, [B, chunk, Vd] fp32 each, fit in chunk_bytes
    chunking: LossChunking = LossChunking()

    @classmethod
    def from_recipe(cls, loss: LossConfig) -> Eagle3LossSettings:
        """The recipe's ``loss`` section (the same at every optimizer step)."""
        return cls(step_decay=loss.step_loss_decay, chunking=LossChunking(use_checkpoint=loss.checkpoint))


def _eagle3_chunk(step_logits_fn, weight, bias, th_window, decays, n_pos, *tensors):
    """Positions [s, s+n_pos) for every step. tensors = K step hiddens [B, n_pos, H] then K valid masks [B, n_pos].

    th_window [B, n_pos+K-1, H] holds target positions s+1 .. s+n_pos+K-1: step k reads rows k .. k+n_pos-1.
    """
    steps = len(decays)
    hs, valids = tensors[:steps], tensors[steps:]
    with torch.no_grad():
        t_logp = torch.log_softmax(_wide(fast_linear(th_window.to(weight.dtype), weight, bias)), dim=-1)
        p_t = t_logp.exp()
        del t_logp
        t_arg = p_t.argmax(-1)  # [B, n_pos+K-1]
    loss, ce_list, acc_list = None, [], []
    for k in range(steps):
        logits = _wide(step_logits_fn(hs[k]))  # [B, n_pos, Vd]
        if logits.shape[-1] != p_t.shape[-1]:
            raise ValueError(f"step_logits_fn returned {logits.shape[-1]} columns; the draft vocabulary (t2d) has "
                             f"{p_t.shape[-1]}")
        logp = torch.log_softmax(logits, dim=-1)
        del logits
        ce = -(p_t[:, k:k + n_pos] * logp).sum(-1)
        ce = torch.where(valids[k], ce, 0.0).sum()
        term = decays[k] * ce
        loss = term if loss is None else loss + term
        with torch.no_grad():
            ce_list.append(ce.detach())
            acc_list.append(((logp.argmax(-1) == t_arg[:, k:k + n_pos]) & valids[k]).sum())
        del logp
    return loss, torch.stack(ce_list), torch.stack(acc_list)


def eagle3_loss(
    step_logits_fn: Callable[[torch.Tensor], torch.Tensor],
    step_hidden: Sequence[torch.Tensor],
    target_hidden: torch.Tensor,
    target_lm_head,
    t2d: torch.Tensor,
    valid: Sequence[torch.Tensor],
    settings: Eagle3LossSettings,
) -> Eagle3LossOut:
    """Eagle3 TTT loss sums: soft CE of each step against the target, over the draft vocabulary.

    step_logits_fn  draft states [B, n, H] -> draft-vocabulary logits [B, n, Vd] (shared by all steps)
    step_hidden     one [B, T, H] per TTT step (with grad)
    target_hidden   [B, T, H] target final-norm states; target_lm_head a frozen Linear H -> V
    t2d             [V] bool, True on the draft vocabulary's columns (Vd of them, in target-id order)
    valid           one [B, T] bool per step; position t of step k is also invalid when t+k+1 >= T
    settings        the step decay and the chunking (Eagle3LossSettings)
    """
    steps = len(step_hidden)
    if steps == 0 or len(valid) != steps:
        raise ValueError(f"need one valid mask per step: {steps} step hiddens, {len(valid)} masks")
    if target_hidden.dim() != 3:
        raise ValueError(f"target_hidden must be [B, T, H], got {tuple(target_hidden.shape)}")
    b, t_len, hdim = target_hidden.shape
    for k in range(steps):
        if tuple(step_hidden[k].shape[:2]) != (b, t_len):
            raise ValueError(f"step_hidden[{k}] must be [B, T, H] = {(b, t_len)}, got {tuple(step_hidden[k].shape)}")
        if tuple(valid[k].shape) != (b, t_len) or valid[k].dtype != torch.bool:
            raise ValueError(f"valid[{k}] must be bool [B, T] = {(b, t_len)}, got {valid[k].dtype} "
                             f"{tuple(valid[k].shape)}")
    vocab = _out_features(target_lm_head)
    if t2d.dtype != torch.bool or t2d.shape != (vocab,):
        raise ValueError(f"t2d must be bool [V] = [{vocab}], got {t2d.dtype} {tuple(t2d.shape)}")

    device = target_hidden.device
    weight, bias = target_lm_head.weight, getattr(target_lm_head, "bias", None)
    with torch.no_grad():
        if not bool(t2d.all()):  # restrict the target head to the draft vocabulary once per call
            cols = t2d.to(weight.device).nonzero().squeeze(1)
            weight = weight.index_select(0, cols)
            bias = None if bias is None else bias.index_select(0, cols)
        weight, bias = weight.detach(), None if bias is None else bias.detach()
    vocab_d = weight.shape[0]

    step_decay = settings.step_decay
    decays = step_weights(steps, step_decay)
    pos = torch.arange(t_len, device=device)
    valid = [valid[k] & (pos < t_len - k - 1) for k in range(steps)]
    counts = torch.stack([v.sum() for v in valid])
    weight_sum = eagle3_weight_sum(counts.float(), step_decay)

    chunk_size = settings.chunking.rows(b * vocab_d * 4 * (steps + 1))
    th_pad = F.pad(target_hidden, (0, 0, 0, steps))  # rows past T: finite dummies, always masked out

    loss_sum = None
    ce_sum = torch.zeros(steps, dtype=torch.float32, device=device)
    acc_sum = torch.zeros(steps, dtype=torch.long, device=device)
    for s in range(0, t_len, chunk_size):
        e = min(t_len, s + chunk_size)
        n_pos = e - s
        args = (step_logits_fn, weight, bias, th_pad[:, s + 1:e + steps], decays, n_pos,
                *(h[:, s:e] for h in step_hidden), *(v[:, s:e] for v in valid))
        loss, ce, acc = settings.chunking.run(_eagle3_chunk, *args)
        loss_sum = loss if loss_sum is None else loss_sum + loss
        ce_sum, acc_sum = ce_sum + ce.float(), acc_sum + acc

    return Eagle3LossOut(loss_sum=loss_sum.float(), weight_sum=torch.as_tensor(weight_sum, device=device).float(),
                         ce_sum=ce_sum, acc_sum=acc_sum, acc_count=counts)


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "BlockLossBatch",
    "BlockLossOut",
    "BlockLossSettings",
    "Eagle3LossOut",
    "Eagle3LossSettings",
    "LossChunking",
    "auto_chunk_size",
    "block_loss",
    "block_weight_sum",
    "eagle3_loss",
    "eagle3_weight_sum",
    "position_weights",
    "step_weights",
]
