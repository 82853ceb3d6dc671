"""Lossless speculative decoding at batch size 1: one loop, any drafter (DSpark, DFlash, Eagle3, n-gram, draft LM).

The loop (`speculative_generate`)
    The sequence is `tokens`; its last token is *pending*: emitted, but not yet run through the target. The target's
    KV cache (a transformers DynamicCache) holds every other token. Each round:
      1. the drafter proposes gamma tokens d_1..d_gamma (plus, when sampling, their proposal distributions);
      2. the target runs [pending, d_1..d_gamma] in ONE forward on top of its cache, which gives the target
         distribution of every proposed position and of the bonus position, and (forward hooks) the recipe layers'
         hidden states of those positions;
      3. acceptance: T=0 keeps the longest prefix equal to the target argmax and appends the target argmax at the
         first mismatch (or the bonus token); T>0 is standard rejection sampling (accept x with min(1, p_t/p_d), on
         rejection resample from norm((p_t - p_d)+), bonus from p_t), which leaves the output distribution exactly
         the target's whatever the drafter does;
      4. the cache is cropped to the verified tokens (old pending + accepted drafts), the new pending token is the
         correction/bonus, and the drafter receives the hidden states of the verified positions only.
    Output stops at EOS or max_new_tokens (the last round is truncated; nothing past the budget is emitted).

Drafters (`Drafter`: reset / propose / accept; the loop never looks inside)
    DSparkDrafter   DSpark, DFlash, DFlash2 (`Qwen3DSparkModel`). Context = target hidden states of every verified
                    token; one parallel block pass anchored at the pending token (which, as in training, sees only
                    context positions < anchor), then DSpark's Markov head samples left to right (sigmoid
                    confidences), or DFlash2's selector walks its path through each slot's top K.
    Eagle3Drafter   `LlamaForCausalLMEagle3`: a chain of gamma steps as in TTT; draft ids -> target ids via d2t.
    DraftLMDrafter  any HF causal LM sharing the tokenizer, with its own KV cache. Prompt lookup: eval/lookup.py.
`load_draft(dir, target)` builds the right one from a saved `runs/<recipe>/train/final/` (or a serving export).
`target_generate` is plain autoregressive decoding with the same cached target: the speed baseline and the T=0
reference (speculative output must equal it token for token).

Every random draw (drafter sampling, accept tests, residual and bonus sampling) uses one seeded torch.Generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from modeling.cpu_linear import pack_linears
from modeling.dspark import ContextCache, DSparkModel
from modeling.eagle3 import Eagle3Model
from modeling.registry import load_draft_model
from modeling.selector import walk
from modeling.target import TargetRunner, crop_cache, vocab_logits

GREEDY_BELOW = 1e-5  # DeepSpec: temperatures below this mean greedy (one-hot distributions)

# ---------------------------------------------------------------------------------------------------------------------
# Sampling helpers


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def softmax_t(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # float32 at least: bf16 probabilities are too coarse for the p_t/p_d ratios of rejection sampling.
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def argmax(logits: torch.Tensor):
    """`logits.argmax(-1)` as Python int(s). On a CPU numpy's: torch's CPU argmax reads a 49,152-token row ~20x slower
    (measured 91 us against 4 us; a DSpark round takes 8-15 of them). Both return the first of tied maxima."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """One token from a [V] logit row: argmax at T=0 (no distribution), else a draw from softmax(logits/T)."""
    if is_greedy(temperature):
        return argmax(logits), None
    probs = softmax_t(logits, temperature)
    return sample(probs, generator), probs


def argmax_with_low_rank_bias(base: torch.Tensor, w2: torch.Tensor, u: torch.Tensor, w2_norms: torch.Tensor) -> int:
    """argmax(base + w2 @ u) for base [V], w2 [V, r], u [r], mostly without the [V, r] product (DSpark's Markov bias,
    one per drafted token: 7 passes over W2 cost a third of a draft). |w2[v] . u| <= |w2[v]| |u| (w2_norms: the row
    norms) bounds every token's bias, so only tokens whose base logit plus that bound reaches the exact score of
    base's own argmax can win; they are scored exactly (usually one or two tokens). The passes over the vocabulary
    run in numpy (CPU copies off a GPU): torch's CPU argmax and nonzero over 49,152 tokens took 3x as long."""
    row, norms = base.detach().float().cpu().numpy(), w2_norms.float().cpu().numpy()
    top = int(row.argmax())
    floor = float(row[top]) + float(w2[top] @ u)
    # the margin keeps a token whose rounded bound falls a hair under the floor in the race
    candidates = np.flatnonzero(row + norms * float(u.norm()) >= floor - 1e-4 * (1 + abs(floor)))
    if candidates.size > row.size // 8:
        return argmax(base + w2 @ u)
    index = torch.from_numpy(candidates).to(base.device)
    return int(candidates[argmax(base[index] + w2[index] @ u)])


class Proposal(NamedTuple):
    tokens: list[int]  # [gamma'] target-vocabulary ids, gamma' <= gamma (may be empty)
    probs: torch.Tensor | None  # [gamma', V] proposal distributions; None = greedy / one-hot (n-gram)
    confidences: list[float] | None  # [gamma'] estimated P(accept k | prefix accepted), when the drafter has them


# ---------------------------------------------------------------------------------------------------------------------
# Drafters


class Drafter:
    """Base: keeps the token sequence (last entry = pending token) and the last proposal.

    reset(tokens, target_hidden): start a sequence; target_hidden [len(tokens)-1, K*H] are the target layer outputs
        of every token but the pending one (None for drafters that read no target state).
    propose(gamma, temperature, generator) -> Proposal
    accept(num_accepted, next_token, target_hidden): the first `num_accepted` drafts were accepted and `next_token`
        is the new pending token; target_hidden [num_accepted+1, K*H] are the states of the old pending token and
        the accepted drafts (the positions that just became verified).
    """

    layer_ids: list[int] = []  # target layers whose outputs this drafter reads (HF layer-output ids)
    default_gamma: int = 4

    def reset(self, tokens: list[int], target_hidden: torch.Tensor | None) -> None:
        self.tokens = list(tokens)
        self.last = Proposal([], None, None)

    def propose(self, gamma: int, temperature: float, generator: torch.Generator) -> Proposal:
        raise NotImplementedError

    def accept(self, num_accepted: int, next_token: int, target_hidden: torch.Tensor | None) -> None:
        self.tokens += self.last.tokens[:num_accepted] + [next_token]


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


class DSparkDrafter(Drafter):
    """DSpark / DFlash block drafter.

    use_cache=True keeps each layer's context keys/values (`DSparkModel.extend_context`) and projects only newly
    verified positions; the block pass (`DSparkModel.cached_block`) attends to all of them, since every cached
    position is < anchor. The projection runs when the next block is drafted, so a round's draft time holds all of
    the drafter's work (as Eagle3's does). use_cache=False calls `DSparkModel.forward` on the full context every
    round: the reference the cached path is tested against.

    A draft with a drafting vocabulary (`model.draft_vocab`, token_map.pt) scores those rows of lm_head and the
    Markov head only, as one packed matrix built per generation (the weights may change between generations: OPD).
    full_vocab=True drafts over the whole vocabulary whatever the map, as SGLang and vLLM serve it (two drafters may
    share one model, one with its map and one without: eval/run.py served_drafters).
    """

    def __init__(self, model: DSparkModel, use_cache: bool = True, full_vocab: bool = False):
        self.model = model.eval()
        self.layer_ids = list(model.config.target_layer_ids)
        self.default_gamma = model.block_size
        self.use_cache = use_cache
        self.full_vocab = full_vocab

    @torch.no_grad()
    def reset(self, tokens, target_hidden):
        super().reset(tokens, target_hidden)
        self.hidden = target_hidden  # the verified positions' states: all of them (recompute) or those not cached yet
        self.context = ContextCache()
        # per generation: the weights cannot change within one
        model = self.model
        self.vocab = vocab = None if self.full_vocab else model.draft_vocab  # with the head rows below
        self.head = model.lm_head
        self.w2 = None if model.markov_head is None else model.markov_head.markov_w2.weight
        if vocab is not None:
            with torch.inference_mode(False):  # an inference tensor cannot be packed (it keeps no version counter)
                self.head = torch.nn.Linear(model.config.hidden_size, len(vocab), bias=False).requires_grad_(False)
                self.head.weight.data = model.lm_head.weight[vocab]
                pack_linears(self.head)
            self.w2 = None if self.w2 is None else self.w2[vocab]
        self.w2_norms = None if self.w2 is None else self.w2.norm(dim=1)

    @torch.no_grad()
    def accept(self, num_accepted, next_token, target_hidden):
        super().accept(num_accepted, next_token, target_hidden)
        self.hidden = torch.cat([self.hidden, target_hidden], dim=0)

    def _block_recompute(self, anchor: int) -> torch.Tensor:
        model = self.model
        device = _device(model)
        ids = torch.tensor([self.tokens], device=device)
        # The anchor's own row is a placeholder: the mask hides context positions >= anchor.
        hidden = torch.cat([self.hidden.to(device), self.hidden.new_zeros(1, self.hidden.shape[1]).to(device)])
        anchors = torch.tensor([[anchor]], device=device)
        return model(ids, hidden[None], anchors, attn_impl="sdpa")[0, 0]

    @torch.no_grad()
    def block_states(self) -> torch.Tensor:
        """[block_size, H] prediction states of the block anchored at the pending token (prediction k -> a+k)."""
        if self.use_cache:
            if self.hidden.shape[0] or self.context.layers is None:  # (a one-token prompt has no state to cache)
                self.model.extend_context(self.context, self.hidden)
                self.hidden = self.hidden[:0]
            return self.model.cached_block(self.tokens[-1], self.context)
        return self._block_recompute(len(self.tokens) - 1)  # anchor = the number of verified positions

    @torch.no_grad()
    def propose(self, gamma, temperature, generator):
        model = self.model
        h = self.block_states()[:gamma]
        device = h.device
        # draft_logits = lm_head(h_k) + Markov bias from the drafted token k-1 (k=1: the anchor), so drafts are drawn
        # left to right; the rnn head carries a state over the whole drafted prefix, hence the prefix recomputation
        # there. lm_head(h_k) does not depend on the drafts: one pass over the vocabulary matrix for the whole block
        # (once per token, it cost more than the rest of the draft together). DFlash has no head: lm_head alone.
        markov = model.markov_head
        rnn = markov is not None and markov.head_type == "rnn"
        base = vocab_logits(h, self.head.weight)
        vocab = self.vocab
        if model.candidate_selector is not None:  # DFlash2: the selector's best path through each slot's top K
            self.last = self._selector_proposal(h, base, temperature, generator)
            return self.last
        if markov is None and is_greedy(temperature):  # DFlash at T=0: every draft at once
            tokens = argmax(base) if vocab is None else vocab[argmax(base)].tolist()
            self.last = Proposal(tokens, None, self._confidences(h, [self.tokens[-1], *tokens][:len(tokens)]))
            return self.last
        tokens, probs, prev = [], [], [self.tokens[-1]]
        for k in range(h.shape[0]):
            if markov is None:
                index, p = pick(base[k], temperature, generator)
            else:
                start = 0 if rnn else k
                u = markov.features(h[start: k + 1], torch.tensor(prev[start:], device=device))[-1]
                if is_greedy(temperature):
                    index, p = argmax_with_low_rank_bias(base[k], self.w2, u, self.w2_norms), None
                else:
                    index, p = pick(base[k] + self.w2 @ u, temperature, generator)
            token = index if vocab is None else int(vocab[index])
            if p is not None and vocab is not None:  # the proposal over the whole vocabulary, zero outside
                p = p.new_zeros(model.config.vocab_size).index_copy_(0, vocab, p)
            tokens.append(token)
            probs.append(p)
            prev.append(token)
        self.last = Proposal(tokens, None if is_greedy(temperature) or not tokens else torch.stack(probs),
                             self._confidences(h, prev[:-1]))
        return self.last

    def _selector_proposal(self, h, base, temperature, generator) -> Proposal:
        """The walk of modeling/selector.py over the lm_head's top K of every slot (among the drafting vocabulary when
        the draft has one), as SGLang's DFlash2DraftModel: candidates, edge scores, one path."""
        selector, vocab = self.model.candidate_selector, self.vocab
        unary, places = base.float().topk(selector.top_k, dim=-1)
        ids = places if vocab is None else vocab[places]
        scores = selector.edge_scores(h, unary, ids, self.tokens[-1])
        tokens, q, _ = walk(scores, ids, 0.0 if is_greedy(temperature) else temperature, generator)
        # sampled: the proposal over the whole vocabulary, zero outside each slot's candidates
        probs = None if q is None else q.new_zeros(len(tokens), self.model.config.vocab_size).scatter_(1, ids, q)
        return Proposal(tokens, probs, None)

    def _confidences(self, h: torch.Tensor, prev: list[int]) -> list[float] | None:
        """P(draft k accepted | drafts < k accepted) from the confidence head, given each draft's previous token."""
        if self.model.confidence_head is None or not prev:
            return None
        prev_ids = torch.tensor(prev, device=h.device)
        return torch.sigmoid(self.model.confidence_logits(h, prev_ids).float()).tolist()


class Eagle3Drafter(Drafter):
    """EAGLE3 chain drafting, the inference side of `Eagle3Model.forward_train`'s TTT.

    Step 0 at the last verified position t = n-1 reads fc(aux_t) and the embedding of x_{t+1} (the pending token);
    step k >= 1 reads the step-(k-1) pre-norm output at t and the embedding of draft k, at RoPE position t+k, and
    attends to the step-0 keys of positions <= t plus its own earlier steps at t (the TTT "diagonal"). The step-0
    keys/values of a position depend only on verified data, so they are computed once per position and kept;
    only the chain's diagonal keys are thrown away after each round.
    """

    def __init__(self, model: Eagle3Model):
        self.model = model.eval()
        self.layer_ids = list(model.config.eagle_config["eagle_aux_hidden_state_layer_ids"])
        self.default_gamma = int(getattr(model.config, "ttt_length", 7))
        self.layers = [model.midlayer, *model.layers.values()]

    @torch.no_grad()
    def reset(self, tokens, target_hidden):
        super().reset(tokens, target_hidden)
        self.todo = target_hidden  # aux rows whose step-0 keys are not computed yet
        self.kv = [([], []) for _ in self.layers]
        self.done = 0  # positions with step-0 keys
        self.h_last = None  # step-0 pre-norm output at the last verified position

    @torch.no_grad()
    def accept(self, num_accepted, next_token, target_hidden):
        super().accept(num_accepted, next_token, target_hidden)
        self.todo = torch.cat([self.todo, target_hidden], dim=0)

    def _run(self, token_ids, hidden, start, mask, caches):
        model = self.model
        embeds = model.embed_tokens(token_ids)[None].to(hidden.dtype)
        cos, sin = model.rotary_emb(hidden, start + torch.arange(hidden.shape[1], device=hidden.device)[None])
        for layer, cache in zip(self.layers, caches):
            hidden = layer(embeds, hidden, cos, sin, mask, cache)
        return hidden

    def _advance_context(self) -> None:
        m, new = self.done, self.todo.shape[0]
        if new == 0:
            return
        model = self.model
        device = _device(model)
        hidden = model.fc(self.todo.to(device=device, dtype=model.fc.weight.dtype))[None]
        # Position t consumes x_{t+1}; every such token is known (the last one is the pending token).
        ids = torch.tensor(self.tokens[m + 1: m + new + 1], device=device)
        causal = torch.ones(new, new, dtype=torch.bool, device=device).tril()
        mask = torch.cat([torch.ones(new, m, dtype=torch.bool, device=device), causal], dim=1)
        out = self._run(ids, hidden, m, mask, self.kv)
        for keys, values in self.kv:  # one tensor per layer keeps later concatenations cheap
            keys[:] = [torch.cat(keys, dim=2)]
            values[:] = [torch.cat(values, dim=2)]
        self.h_last, self.done, self.todo = out[:, -1:], m + new, self.todo[:0]

    @torch.no_grad()
    def propose(self, gamma, temperature, generator):
        n = len(self.tokens) - 1
        if n == 0 or gamma <= 0:  # nothing verified yet: no aux state to draft from
            self.last = Proposal([], None, None)
            return self.last
        model = self.model
        self._advance_context()
        device = _device(model)
        d2t = model.d2t.to(device)
        caches = [(list(k), list(v)) for k, v in self.kv]  # the chain's diagonal keys go to throwaway copies
        h, tokens, probs = self.h_last, [], []
        for step in range(gamma):
            if step > 0:
                mask = torch.ones(1, n + step, dtype=torch.bool, device=device)
                h = self._run(torch.tensor([tokens[-1]], device=device), h, n - 1 + step, mask, caches)
            logits = model.step_logits(model.norm(h))[0, -1]
            draft_id, p = pick(logits, temperature, generator)
            tokens.append(draft_id + int(d2t[draft_id]))
            if p is not None:  # draft-vocabulary distribution -> target vocabulary (zero outside the kept ids)
                full = p.new_zeros(model.config.vocab_size)
                full[torch.arange(p.shape[0], device=device) + d2t] = p
                probs.append(full)
        self.last = Proposal(tokens, torch.stack(probs) if probs else None, None)
        return self.last


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation of `prompt`, computed beforehand (`continuation`: the output ids),
    at no draft cost: every draft is accepted at T=0, so a loop run with it measures the loop's own overhead against
    the (gamma+1)-token verify limit (benchmarks/spec_loop.py)."""

    def __init__(self, prompt: list[int], continuation: list[int], gamma: int = 7):
        self.prompt_len, self.continuation, self.default_gamma = len(prompt), [int(t) for t in continuation], gamma

    def propose(self, gamma, temperature, generator):
        done = len(self.tokens) - self.prompt_len  # output tokens already in the sequence
        self.last = Proposal(self.continuation[done: done + gamma], None, None)
        return self.last


class DraftLMDrafter(Drafter):
    """A small HF causal LM with the target's tokenizer drafts a chain of gamma tokens with its own KV cache.

    The cache is kept for the longest prefix it shares with the sequence after acceptance (it holds the pending
    token and drafts 1..gamma-1), so each round feeds only the uncached tail. `vocab_size` aligns the draft's logits
    with the target's (padded embedding matrices differ between model sizes): extra columns are dropped, missing
    ones get probability 0.
    """

    def __init__(self, model, gamma: int = 4, vocab_size: int | None = None):
        self.model = model.eval()
        self.default_gamma = gamma
        self.vocab_size = vocab_size

    def reset(self, tokens, target_hidden):
        super().reset(tokens, target_hidden)
        self.cache, self.cached = DynamicCache(), []

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        size = self.vocab_size or logits.shape[-1]
        if logits.shape[-1] >= size:
            return logits[:size]
        return torch.cat([logits, logits.new_full((size - logits.shape[-1],), float("-inf"))])

    @torch.no_grad()
    def propose(self, gamma, temperature, generator):
        keep = 0
        while keep < min(len(self.cached), len(self.tokens) - 1) and self.cached[keep] == self.tokens[keep]:
            keep += 1
        crop_cache(self.cache, keep)
        device = _device(self.model)
        feed, tokens, probs = self.tokens[keep:], [], []
        for step in range(gamma):
            out = self.model(input_ids=torch.tensor([feed], device=device), past_key_values=self.cache,
                             use_cache=True)
            token, p = pick(self._logits(out.logits[0, -1]), temperature, generator)
            tokens.append(token)
            probs.append(p)
            feed = [token]
        # Cached now: the kept prefix plus everything fed (the tail and every draft but the last).
        self.cached = self.tokens + tokens[:-1] if tokens else self.tokens[:keep]
        greedy = is_greedy(temperature) or not tokens
        self.last = Proposal(tokens, None if greedy else torch.stack(probs), None)
        return self.last


# ---------------------------------------------------------------------------------------------------------------------
# Loading a trained draft


# The inference side of each registered model class.
DRAFTERS = {DSparkModel: DSparkDrafter, Eagle3Model: Eagle3Drafter}


def drop_token_map(model):
    """`model` drafting over the whole vocabulary, as SGLang and vLLM serve it: a block draft's token map (the
    loss.vocab_size tokens it trained over) dropped. Returns it."""
    if isinstance(model, DSparkModel):
        model.draft_vocab = None
    return model


def load_draft(draft_dir, target_model, *, dtype: torch.dtype | None = None, any_target: bool = False,
               full_vocab: bool = False) -> Drafter:
    """The drafter saved in `draft_dir` (a training draft folder or a serving export), on the target's device, in
    `dtype` (default: the target's dtype); a target with other weights than its own is refused unless `any_target`.
    full_vocab: draft over the whole vocabulary even where the folder has a token map, as the serving engines do."""
    model = load_draft_model(draft_dir, target_model, dtype=dtype, any_target=any_target)
    if full_vocab:
        drop_token_map(model)
    pack_linears(model)  # frozen: oneDNN products on a CPU, as the target's (modeling/cpu_linear.py)
    return DRAFTERS[type(model)](model)


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted count, next token): longest prefix equal to the target argmax, then the target argmax."""
    target_tokens = argmax(target_logits)
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, target_tokens[accepted]


def verify_sampling(draft_tokens: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                    temperature: float, generator: torch.Generator) -> tuple[int, int]:
    """(accepted count, next token) by rejection sampling; draft_probs None = one-hot proposals."""
    p_target = softmax_t(target_logits, temperature)
    vocab = p_target.shape[-1]
    for i, x in enumerate(draft_tokens):
        if draft_probs is None:
            q = F.one_hot(torch.tensor(x, device=p_target.device), vocab).to(p_target.dtype)
        else:  # a draft vocabulary may be padded differently: align it with the target's, zeros outside
            q = draft_probs[i].to(p_target.dtype)
            q = q[:vocab] if q.shape[0] >= vocab else F.pad(q, (0, vocab - q.shape[0]))
        u = torch.rand((), generator=generator, device=generator.device).to(p_target.device)
        if q[x] > 0 and u * q[x] < p_target[i, x]:  # u < p_t/p_d without dividing by a tiny p_d
            continue
        residual = (p_target[i] - q).clamp(min=0)
        # An all-zero residual means p_t == p_d up to rounding, where rejection has probability 0: fall back to p_t.
        return i, sample(residual if residual.sum() > 0 else p_target[i], generator)
    return len(draft_tokens), sample(p_target[len(draft_tokens)], generator)


# ---------------------------------------------------------------------------------------------------------------------
# Results and the loops


@dataclass(frozen=True, kw_only=True)
class Decoding:
    """How one prompt is decoded, by the speculative loop and by the plain loop beside it (eval/arms.py)."""

    max_new_tokens: int  # the output budget (the last round is cut at it)
    gamma: int | None = None  # drafts proposed a round; None: the drafter's default_gamma
    temperature: float = 0.0  # below GREEDY_BELOW greedy, else rejection sampling
    eos_token_id: int | list[int] | None = None  # the id(s) that end the output; None: only the budget does
    seed: int = 0  # this decode's torch.Generator (every random draw)
    # the first output token from the prompt's forward pass, no draft, as SGLang and vLLM do (eval/live.py's rounds)
    first_token_from_prefill: bool = False


@dataclass
class RoundRecord:
    proposed: int  # drafts verified this round
    accepted: int  # drafts accepted (tau = accepted + 1 counts the correction/bonus token)
    accept_flags: list[bool]  # per proposed position: accepted (i.e. the whole prefix up to it survived)
    confidences: list[float] | None  # DSpark confidence head, per proposed position
    emitted: int  # tokens appended to the output (accepted + 1, less on EOS / max_new_tokens truncation)
    cache_len: int  # target KV-cache length after the rollback
    draft_s: float
    verify_s: float


@dataclass
class GenerationResult:
    ids: list[int]  # generated tokens (prompt excluded); ends with EOS when EOS stopped generation
    rounds: list[RoundRecord] = field(default_factory=list)
    wall_s: float = 0.0  # whole call, prefill included
    prefill_s: float = 0.0  # the prompt's forward pass alone (the per-token and per-round costs exclude it)

    @property
    def accept_len(self) -> float:
        """tau: mean over rounds of accepted drafts + 1 (DeepSpec's accept_len)."""
        return sum(r.accepted + 1 for r in self.rounds) / max(len(self.rounds), 1)


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(i) for i in eos_token_id}


def sync_clock(device: torch.device) -> float:
    if device.type == "cuda":  # kernels are asynchronous: time what ran, not what was queued
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _emit(out: list[int], new: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Append `new` to `out` up to the budget and through the first EOS; True when generation must stop."""
    for token in new:
        out.append(token)
        if token in eos or len(out) >= max_new_tokens:
            return True
    return False


@torch.inference_mode()
def speculative_generate(target, drafter: Drafter, prompt_ids, how: Decoding, *,
                         schedule: Callable[[list[float]], int] | None = None) -> GenerationResult:
    """Generate from `target` with `drafter` proposing up to how.gamma tokens per round, decoding as `how` says; the
    target's runner captures the layers the drafter reads (drafter.layer_ids). schedule: called with each round's
    draft confidences, returns how many of the drafts to verify (DSpark's verify scheduler, eval/scheduler.py
    VerifySchedule); None verifies them all."""
    max_new_tokens, temperature = how.max_new_tokens, how.temperature
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    gamma = drafter.default_gamma if how.gamma is None else how.gamma
    eos, greedy = _eos_set(how.eos_token_id), is_greedy(temperature)
    device = _device(target)
    generator = torch.Generator(device=device).manual_seed(how.seed)
    result = GenerationResult([])
    start = sync_clock(device)
    if max_new_tokens <= 0:
        return result
    with TargetRunner(target, drafter.layer_ids) as runner:
        if how.first_token_from_prefill:
            logits, hidden = runner.forward(prompt, logits="last")
            first, _ = pick(logits[-1], temperature, generator)
            tokens = prompt + [first]
            done = _emit(result.ids, [first], max_new_tokens, eos)
        else:
            # The last prompt token is the first pending token: the first round drafts the first output token, with
            # the same "context < anchor" view as every later round.
            _, hidden = runner.forward(prompt[:-1], logits="none")
            tokens, done = prompt, False
        result.prefill_s = sync_clock(device) - start
        drafter.reset(tokens, hidden)
        while not done:
            t0 = sync_clock(device)
            proposal = drafter.propose(gamma, temperature, generator)
            drafts = list(proposal.tokens[:gamma])
            if schedule is not None and drafts:
                if proposal.confidences is None:
                    raise ValueError("a verify schedule reads the drafter's confidences, and this drafter gives none "
                                     "(only a DSpark draft with a confidence head does)")
                drafts = drafts[: schedule(proposal.confidences[: len(drafts)])]
            t1 = sync_clock(device)
            verified = runner.length
            logits, hidden = runner.forward([tokens[-1]] + drafts)
            if greedy:
                accepted, next_token = verify_greedy(drafts, logits)
            else:
                probs = None if proposal.probs is None else proposal.probs[: len(drafts)]
                accepted, next_token = verify_sampling(drafts, probs, logits, temperature, generator)
            # Keep the old pending token and the accepted drafts; the new pending token is not in the cache yet.
            runner.crop(verified + accepted + 1)
            new = drafts[:accepted] + [next_token]
            before = len(result.ids)
            stop = _emit(result.ids, new, max_new_tokens, eos)
            t2 = sync_clock(device)
            conf = proposal.confidences[: len(drafts)] if proposal.confidences is not None else None
            result.rounds.append(RoundRecord(len(drafts), accepted, [i < accepted for i in range(len(drafts))],
                                             conf, len(result.ids) - before, runner.length, t1 - t0, t2 - t1))
            if stop:
                break
            tokens = tokens + new
            drafter.accept(accepted, next_token, None if hidden is None else hidden[: accepted + 1])
    result.wall_s = sync_clock(device) - start
    return result


@torch.inference_mode()
def target_generate(target, prompt_ids, max_new_tokens: int, temperature: float = 0.0, eos_token_id=None,
                    seed: int = 0) -> GenerationResult:
    """Plain autoregressive decoding with the same cached target (one token per forward)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    eos = _eos_set(eos_token_id)
    device = _device(target)
    generator = torch.Generator(device=device).manual_seed(seed)
    result = GenerationResult([])
    start = sync_clock(device)
    with TargetRunner(target) as runner:
        # same cache layout as speculative_generate: the last prompt token is fed by the first step
        runner.forward(prompt[:-1], logits="none")
        result.prefill_s = sync_clock(device) - start
        token = prompt[-1]
        while len(result.ids) < max_new_tokens:
            logits, _ = runner.forward([token])
            token, _ = pick(logits[-1], temperature, generator)
            if _emit(result.ids, [token], max_new_tokens, eos):
                break
    result.wall_s = sync_clock(device) - start
    return result
