"""T=0 accept lengths without running the target: the speculative loop replayed over a cached greedy answer
(train/rollout.py explains why one teacher-forced drafter pass gives the loop's rounds). The replayed tau equals the
loop's up to the rounding of the cached states (bf16 by default) and the last round at the max_new_tokens cut (drafts
past it count as rejected; the loop may accept them and stop there). Cheap enough for a learning curve; speed needs
the real loop (eval/run.py).

    report = replay_records(model, records, gamma, max_new_tokens, tokenizer.eos_token_id)  # {"accept_len", ...}
"""

from __future__ import annotations

import torch

from eval.run import acceptance_metrics
from eval.spec_decode import NgramDrafter
from train.rollout import answer_span, draft_matches, replay_rounds


def replay_records(model, records, gamma: int, max_new_tokens: int | None = None, eos_token_id=None) -> dict:
    """Replayed T=0 acceptance over the first answer of every record: the report fields of eval/run.py
    (accept_len, accept_rate_at_k, cond_accept_rate_at_k, verify_rate, num_rounds) plus per-record taus (and the
    tokens and rounds behind them), and
    whether the drafter copies: over every answer position, the share where prompt lookup (the n-gram drafter)
    proposes the right next token, and the drafter's first-draft accuracy there and at the other positions.
    model: a draft model, or an eval.spec_decode.NgramDrafter (prompt lookup needs no hidden states: its tau on the
    same records, the baseline beside a learning curve). eos_token_id: the tokenizer's, so that an answer ends where
    the loop stops (answer_span)."""
    rounds, record_tokens, record_rounds, hit_rows, right_rows = [], [], [], [], []
    for record in records:
        first, end = answer_span(record, max_new_tokens, eos_token_id)
        if isinstance(model, NgramDrafter):
            matches = lookup_matches(record["input_ids"].tolist(), gamma, model.max_n, model.min_n)
        else:
            matches = draft_matches(model, record, gamma)
        mine = replay_rounds(matches, first, end, gamma)
        rounds += mine
        record_tokens.append(sum(r.accepted + 1 for r in mine))
        record_rounds.append(len(mine))
        hit_rows.append(lookup_hits(record["input_ids"][None].long())[0, first: end - 1])  # pending positions
        right_rows.append(matches[first: end - 1, 0])
    hits, right = torch.cat(hit_rows), torch.cat(right_rows)
    return {**acceptance_metrics(rounds, gamma),
            "per_record_accept_len": [tokens / max(count, 1) for tokens, count in zip(record_tokens, record_rounds)],
            # tokens and rounds per record: tau over any subset of the records, e.g. a paired bootstrap of two drafts
            "per_record_tokens": record_tokens, "per_record_rounds": record_rounds,
            "lookup_hit_share": hits.float().mean().item() if hits.numel() else 0.0,
            "first_draft_right_at_lookup_hits": right[hits].float().mean().item() if hits.any() else 0.0,
            "first_draft_right_elsewhere": right[~hits].float().mean().item() if (~hits).any() else 0.0}


def lookup_hits(input_ids: torch.Tensor, max_n: int = 3, min_n: int = 1) -> torch.Tensor:
    """[B, S] bool: position a is True when prompt lookup over input_ids[: a + 1] proposes input_ids[a + 1] first."""
    return torch.stack([lookup_matches(ids, 1, max_n, min_n)[:, 0] for ids in input_ids.tolist()])


def lookup_matches(ids: list[int], gamma: int, max_n: int = 3, min_n: int = 1) -> torch.Tensor:
    """[S, gamma] bool, draft_matches for prompt lookup: entry [a, j-1] says whether the n-gram drafter, run over
    ids[: a + 1], proposes ids[a + j] as its draft j (False past its proposal or the sequence).

    The rule of eval's NgramDrafter: the most recent earlier occurrence of the last n tokens, n = max_n..min_n,
    proposes the (up to gamma) tokens that followed it. One pass, a dict per n of each n-gram's latest end.
    """
    out = torch.zeros(len(ids), gamma, dtype=torch.bool)
    latest_end = [dict() for _ in range(max_n + 1)]
    for a in range(len(ids) - 1):
        for n in range(min(max_n, a + 1), min_n - 1, -1):
            end = latest_end[n].get(tuple(ids[a - n + 1: a + 1]))
            if end is not None:
                proposal = ids[end + 1: min(end + 1 + gamma, a + 1)]
                for j, token in enumerate(proposal[: len(ids) - a - 1]):
                    out[a, j] = token == ids[a + j + 1]
                break
        for n in range(min_n, min(max_n, a + 1) + 1):
            latest_end[n][tuple(ids[a - n + 1: a + 1])] = a
    return out
