"""DFlash2's candidate selector: the DFlash backbone's per-slot top-K candidates, rescored by the transition from the
previous slot's pick, and the best path walked left to right.

What it is (SGLang 0.5.23 `sglang/srt/models/dflash.py` CandidateSelector, vLLM 0.32 `qwen3_dflash2.py`, speculators
0.9.0 `models/dflash2`; the tensor names are theirs, so the state dict loads as it is)
    For prediction k of a block with state h_k, candidates c (the lm_head's top K at h_k, unary logit u_k[c]) and the
    previous token p (the anchor for k = 1, else the pick at k-1):
        score_k(p, c) = u_k[c] + < A[p] * (W h_k), B[c] >
    A = `predecessor_codebook` [V, r], B = `successor_codebook` [V, r], W = `hidden_projection` [r, H]: a rank-r
    bigram table over the vocabulary, modulated per slot by the draft state. Greedy walk (T = 0): pick_1 =
    argmax_c score_1(anchor, c), pick_k = argmax_c score_k(pick_{k-1}, c); at T > 0 each pick is drawn from
    softmax(score_k(pick_{k-1}, .) / T) over the K candidates, which is the proposal distribution the verifier's
    rejection sampling reads (zero outside the candidates).

Training (speculators' objective): the teacher-forced predecessor is the true previous token (block_targets'
prev_ids); the K candidates are the draft's own top K with the label put in place of the K-th when it is absent
(`training_candidates`), and the loss is the K-way cross-entropy of the scores against the label's place, weighed
per position like the DFlash CE (train/loss.py, loss.selector_alpha).

    selector = CandidateSelector(hidden=576, vocab=49152, rank=64, top_k=16)
    cands, place = training_candidates(logits.topk(16).indices, labels)       # [..., K], [...]
    scores = logits.gather(-1, cands) + selector.transition(h, prev_ids, cands)
    tokens, probs = walk(edge_scores, candidate_ids, temperature=0.0)          # inference
"""

from __future__ import annotations

import torch
from torch import nn

INIT_STD = 0.02  # speculators' initializer_range


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or not 2 <= top_k <= vocab_size:
            raise ValueError(f"selector rank must be >= 1 and top_k in [2, vocab {vocab_size}], got {rank}, {top_k}")
        self.top_k = int(top_k)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            weight.normal_(0.0, INIT_STD)

    def transition(self, hidden: torch.Tensor, prev_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """[..., H], [...], [..., K] -> [..., K]: < A[prev] * W h, B[c] > for each candidate c (teacher-forced)."""
        context = self.predecessor_codebook[prev_ids] * self.hidden_projection(hidden).to(self.predecessor_codebook)
        return (context.unsqueeze(-2) * self.successor_codebook[candidate_ids]).sum(-1)

    def edge_scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidate_ids: torch.Tensor,
                    anchor: int) -> torch.Tensor:
        """[S, H], [S, K], [S, K] -> [S, K, K]: score[k, p, c] of candidate c at slot k after candidate p of slot
        k-1 (slot 0: after the anchor, the same for every p), what SGLang's `build_lattice` returns for one block."""
        pred_ids = torch.cat([candidate_ids.new_full((1, candidate_ids.shape[1]), anchor), candidate_ids[:-1]])
        context = self.predecessor_codebook[pred_ids] * self.hidden_projection(hidden)[:, None].to(
            self.predecessor_codebook)  # [S, K(p), r]
        return unary[:, None, :].float() + torch.einsum("spr,scr->spc", context, self.successor_codebook[
            candidate_ids]).float()


def training_candidates(topk_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's top K per prediction with the label put in place of the K-th when absent (speculators'
    `selector_training_candidates`): ([..., K] candidate ids, [...] the label's place among them)."""
    match = topk_ids == labels.unsqueeze(-1)
    present = match.any(-1)
    place = torch.where(present, match.long().argmax(-1), topk_ids.shape[-1] - 1)
    candidates = topk_ids.clone()
    candidates[..., -1] = torch.where(present, topk_ids[..., -1], labels)
    return candidates, place


def walk(scores: torch.Tensor, candidate_ids: torch.Tensor, temperature: float,
         generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None, list[int]]:
    """One path through `edge_scores` [S, K, K]: (the S tokens, their proposal distributions over the K candidates
    [S, K] (None at T = 0), the candidate places). Greedy: each slot's argmax given the previous pick, as SGLang's
    `sample_path` for a greedy row."""
    place, tokens, probs, places = 0, [], [], []
    for k in range(scores.shape[0]):
        row = scores[k, place]  # slot 0's rows are all the anchor's
        if temperature <= 0:
            place = int(row.argmax())
        else:
            p = torch.softmax(row.float() / temperature, dim=-1)
            place = int(torch.multinomial(p, 1, generator=generator))
            probs.append(p)
        places.append(place)
        tokens.append(int(candidate_ids[k, place]))
    return tokens, (torch.stack(probs) if probs else None), places
