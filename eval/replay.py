"""T=0 accept lengths without running the target: the speculative loop replayed over a cached greedy answer
(train/rollout.py explains why one teacher-forced drafter pass gives the loop's rounds). The replayed tau equals the
loop's up to the rounding of the cached states (bf16 by default) and the last round at the max_new_tokens cut (drafts
past it count as rejected; the loop may accept them and stop there). Cheap enough for a learning curve; speed needs
the real loop (eval/run.py).

At T=0 the answer is fixed whoever drafts, so a per-round choice between prompt lookup's proposal and the drafter's
replays exactly too: the oracle chooser takes, each round, whichever proposal has the longer accepted prefix
(oracle_matches), the headroom of any rule that picks one of the two per round; the lookup-first rule
(eval.spec_decode.LookupFirstDrafter) takes lookup's whenever its match is at least n tokens long, a rule the
loop can run (lookup_first_matches).

    report = replay_records(model, records, gamma, max_new_tokens, tokenizer.eos_token_id)  # {"accept_len", ...}
"""

from __future__ import annotations

import torch

from eval.report import acceptance_metrics
from eval.lookup import NgramDrafter, lookup_first_matches, lookup_proposals
from train.rollout import answer_span, draft_matches, replay_rounds


def replay_records(model, records, gamma: int, max_new_tokens: int | None = None, eos_token_id=None) -> dict:
    """Replayed T=0 acceptance over the first answer of every record: the report fields of eval/report.py
    (accept_len, accept_rate_at_k, cond_accept_rate_at_k, verify_rate, num_rounds) plus per-record taus (and the
    tokens and rounds behind them), for a drafter other than prompt lookup the per-round oracle chooser between the
    two (`oracle`: its replayed_tau and per-record tokens and rounds) and the lookup-first rule at each match length
    n (`lookup_first`: {n: the same}), and whether the drafter copies: over every
    answer position, the share where prompt lookup (the n-gram drafter) proposes the right next token, and the
    drafter's first-draft accuracy there and at the other positions.
    model: a draft model, or an eval.spec_decode.NgramDrafter (prompt lookup needs no hidden states: its tau on the
    same records, the baseline beside a learning curve). eos_token_id: the tokenizer's, so that an answer ends where
    the loop stops (answer_span)."""
    lookup = model if isinstance(model, NgramDrafter) else NgramDrafter()
    rounds, chosen, hit_rows, right_rows, copied = [], [], [], [], {}
    for record in records:
        first, end = answer_span(record, max_new_tokens, eos_token_id)
        looked_up, order = lookup_proposals(record["input_ids"].tolist(), gamma, lookup.max_n, lookup.min_n)
        matches = looked_up if model is lookup else draft_matches(model, record, gamma)
        rounds.append(replay_rounds(matches, first, end, gamma))
        if model is not lookup:
            chosen.append(replay_rounds(oracle_matches(matches, looked_up), first, end, gamma))
            for n in range(lookup.min_n, lookup.max_n + 1):
                copied.setdefault(n, []).append(
                    replay_rounds(lookup_first_matches(matches, looked_up, order, n), first, end, gamma))
        hit_rows.append(looked_up[first: end - 1, 0])  # pending positions
        right_rows.append(matches[first: end - 1, 0])
    hits, right = torch.cat(hit_rows), torch.cat(right_rows)
    tally = record_tally(rounds)
    return {**acceptance_metrics([r for mine in rounds for r in mine], gamma),
            "per_record_accept_len": [tokens / max(count, 1) for tokens, count in
                                      zip(tally["per_record_tokens"], tally["per_record_rounds"])],
            # tokens and rounds per record: tau over any subset of the records, e.g. a paired bootstrap of two drafts
            **tally,
            "lookup_hit_share": hits.float().mean().item() if hits.numel() else 0.0,
            "first_draft_right_at_lookup_hits": right[hits].float().mean().item() if hits.any() else 0.0,
            "first_draft_right_elsewhere": right[~hits].float().mean().item() if (~hits).any() else 0.0,
            **({"oracle": record_tally(chosen, with_tau=True)} if chosen else {}),
            **({"lookup_first": {str(n): record_tally(mine, with_tau=True) for n, mine in copied.items()}}
               if copied else {})}


def record_tally(rounds: list[list], with_tau: bool = False) -> dict:
    """Per record (a list of its rounds each): the tokens its rounds gave (accepted + 1 each) and their count, the
    tally eval/compare.py pairs with another drafter's; with_tau: and tau over all of them (`replayed_tau`)."""
    tally = {"per_record_tokens": [sum(r.accepted + 1 for r in mine) for mine in rounds],
             "per_record_rounds": [len(mine) for mine in rounds]}
    if with_tau:
        tally["replayed_tau"] = sum(tally["per_record_tokens"]) / max(sum(tally["per_record_rounds"]), 1)
    return tally


def accepted_prefix(matches: torch.Tensor) -> torch.Tensor:
    """[S] how many drafts a round whose pending token is at each position accepts (its leading run of matches)."""
    return matches.long().cumprod(dim=1).sum(dim=1)


def oracle_matches(draft: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
    """[S, gamma] the matches of a chooser that, each round, verifies whichever proposal has the longer accepted
    prefix (the drafter's on a tie, which advances the same): replay_rounds over it gives the oracle's rounds, each
    advancing by the better of the two proposals."""
    return torch.where((accepted_prefix(draft) >= accepted_prefix(lookup))[:, None], draft, lookup)
