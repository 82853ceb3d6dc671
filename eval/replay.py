"""T=0 accept lengths without running the target: the speculative loop replayed over a cached greedy answer
(train/rollout.py explains why one teacher-forced drafter pass gives the loop's rounds). The replayed tau equals the
loop's up to the rounding of the cached states (bf16 by default) and the last round (drafts past the answer's end
count as rejected). Cheap enough for a learning curve; speed needs the real loop (eval/run.py).

    report = replay_records(model, records, gamma, max_new_tokens)   # {"accept_len", "accept_rate_at_k", ...}
"""

from __future__ import annotations

from eval.run import acceptance_metrics
from train.rollout import answer_span, draft_matches, replay_rounds


def replay_records(model, records, gamma: int, max_new_tokens: int | None = None) -> dict:
    """Replayed T=0 acceptance over the first answer of every record: the report fields of eval/run.py
    (accept_len, accept_rate_at_k, cond_accept_rate_at_k, verify_rate, num_rounds) plus per-record taus."""
    rounds, per_record = [], []
    for record in records:
        first, end = answer_span(record, max_new_tokens)
        mine = replay_rounds(draft_matches(model, record, gamma), first, end, gamma)
        rounds += mine
        per_record.append(sum(r.accepted + 1 for r in mine) / max(len(mine), 1))
    return {**acceptance_metrics(rounds, gamma), "per_record_accept_len": per_record}
