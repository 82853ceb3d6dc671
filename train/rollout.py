"""Rollouts replayed: the speculative loop's rounds along an answer of the target's, from one drafter pass.

At T=0 the speculative loop emits the target's own greedy answer whatever the drafter proposes. At T>0 a loop that
accepts a draft iff it equals the token the target samples there (and emits the target's token at the first mismatch)
emits the target's own sample just as losslessly, so a sampled answer is such a loop's output. Either way a round's
drafts depend only on the verified tokens (through the target's states of them) and, inside the accepted prefix, on
drafted tokens that equal the answer's. So for an answer with the target's states along it, every round can be
replayed from ONE teacher-forced pass of the drafter over all anchors: the round whose pending token sits at position
a accepts the longest prefix of its (argmax) drafts equal to the answer's tokens a+1, a+2, ..., and the next round's
pending token is at a + accepted + 1 (tests/test_spec_decode.py checks the rounds equal the real loop's at T=0,
tests/test_opd.py a step-by-step exact-match loop's along sampled answers). It costs one drafter forward per answer
and no target step. eval/replay.py turns the rounds into held-out acceptance figures; train/opd.py uses
the rounds' starts, where verification has just rejected a draft, as the positions to train on.

    matches = draft_matches(model, record, gamma)        # [T, gamma] bool: anchor a's draft j equals token a+j
    rounds = replay_rounds(matches, first, end, gamma)   # accepted drafts per round, and where each round starts
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from modeling.dspark import DSparkModel, block_targets
from modeling.eagle3 import Eagle3Model
from modeling.vocab import draft_to_target

ANCHORS_PER_PASS = 256  # bounds the dense block mask of one DSpark pass: [A * block_len, T + A * block_len]


class ReplayedRound(NamedTuple):
    proposed: int
    accepted: int
    #: position of the round's pending token (the last verified one): the anchor its drafts start from
    pending: int = -1


@torch.no_grad()
def draft_matches(model, record: dict, gamma: int) -> torch.Tensor:
    """[T, gamma] bool for one cached record: entry [a, j-1] says whether the greedy draft j of a round whose pending
    token is at position a equals input_ids[a + j] (False where a + j is past the sequence)."""
    device = next(model.parameters()).device
    ids = record["input_ids"].long().to(device)[None]
    hidden = record["hidden_states"].to(device=device, dtype=next(model.parameters()).dtype)[None]
    seq = ids.shape[1]
    if isinstance(model, DSparkModel):
        if gamma > model.block_size:
            raise ValueError(f"gamma {gamma} > the draft's block size {model.block_size}")
        out = torch.zeros(seq, gamma, dtype=torch.bool, device=device)
        everything = torch.ones_like(ids, dtype=torch.bool)
        for start in range(1, seq, ANCHORS_PER_PASS):  # anchor 0 sees no context (training never samples it)
            anchors = torch.arange(start, min(seq, start + ANCHORS_PER_PASS), device=device)[None]
            labels, prev_ids, _, valid = block_targets(ids, everything, anchors, model.block_size)
            states = model(ids, hidden, anchors, attn_impl="sdpa")
            drafts = model.greedy_drafts(states, prev_ids)  # prev_ids: true tokens = the accepted drafts
            out[anchors[0]] = ((drafts == labels) & valid)[0, :, :gamma]
        return out.cpu()
    if isinstance(model, Eagle3Model):
        steps = model.forward_train(ids, hidden, None, ttt_length=gamma)  # step k at t drafts token t + k + 2
        out = torch.zeros(seq, gamma, dtype=torch.bool)
        positions = torch.arange(seq)
        for k, state in enumerate(steps):
            drafts = draft_to_target(model.step_logits(state)[0].argmax(-1), model.d2t).cpu()  # [T]
            # pending token at a: step k runs at t = a - 1 and drafts token a + k + 1, i.e. draft j = k + 1
            a = positions[1:]
            target = a + k + 1
            ok = target < seq
            out[a[ok], k] = drafts[a[ok] - 1] == ids[0, target[ok]].cpu()
        return out
    raise TypeError(f"no replay for {type(model).__name__}")


def replay_rounds(matches: torch.Tensor, first_pending: int, end: int, gamma: int) -> list[ReplayedRound]:
    """The loop's rounds over answer tokens first_pending+1 .. end-1 (end: one past the answer's last token)."""
    rounds, a = [], first_pending
    while a < end - 1:
        accepted = 0
        while accepted < gamma and a + accepted + 1 < end and bool(matches[a, accepted]):
            accepted += 1
        rounds.append(ReplayedRound(gamma, accepted, a))
        a += accepted + 1
    return rounds


def answer_span(record: dict, max_new_tokens: int | None = None, eos_token_id=None) -> tuple[int, int]:
    """(first pending position, end) of the record's first answer: the last prompt token, and one past the answer's
    last supervised token (the end-of-turn token included), cut at max_new_tokens. With eos_token_id (an id or a list)
    the answer ends at its first such token, as the loop stops there: a template's end-of-turn text can go on past it
    (ChatML's newline after <|im_end|> is supervised)."""
    mask = record["loss_mask"].bool()
    supervised = mask.nonzero().flatten()
    if supervised.numel() == 0:
        raise ValueError("the record has no supervised (answer) token")
    first = int(supervised[0])
    end = first
    while end < mask.numel() and mask[end]:
        end += 1
    if max_new_tokens is not None:
        end = min(end, first + max_new_tokens)
    if eos_token_id is not None:
        stops = torch.as_tensor(eos_token_id).flatten()
        at_eos = torch.isin(record["input_ids"][first:end].long(), stops).nonzero().flatten()
        if at_eos.numel():
            end = first + int(at_eos[0]) + 1
    return first - 1, end
