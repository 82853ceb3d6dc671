"""Prompt lookup (n-gram drafting): the free baseline every trained drafter is measured against, and its copy path.

    NgramDrafter          the loop's drafter: what followed the most recent earlier occurrence of the context's last
                          n tokens (n = max_n..min_n)
    LookupFirstDrafter    lookup's proposal when it matched at least min_n tokens, a trained drafter's otherwise
    lookup_proposals      the same rule over a whole sequence at once (eval/replay.py replays the loop's rounds with it)

    looked_up, order = lookup_proposals(ids, gamma)       # [S, gamma] matches, [S] matched length (0: no proposal)
"""

from __future__ import annotations

import torch

from eval import LOOKUP_MAX_N
from eval.spec_decode import Drafter, Proposal


class NgramDrafter(Drafter):
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n = max_n..min_n) in the
    sequence and propose what followed it. One-hot proposals (probs None)."""

    def __init__(self, max_n: int = LOOKUP_MAX_N, min_n: int = 1, gamma: int = 4):
        self.max_n, self.min_n, self.default_gamma = max_n, min_n, gamma

    def propose(self, gamma, temperature, generator):
        seq = self.tokens
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            suffix = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # most recent match first; never the suffix itself
                if seq[start: start + n] == suffix:
                    self.last = Proposal(seq[start + n: start + n + gamma], None, None)
                    return self.last
        self.last = Proposal([], None, None)
        return self.last


class LookupFirstDrafter(Drafter):
    """Prompt lookup first, the trained drafter otherwise: a round proposes what followed the most recent earlier
    occurrence of the context's last n >= min_n tokens when there is one (a copy, at lookup's precision and without
    the drafter's cost), else the drafter's own proposal. Each round is verified as usual, so the output is the
    target's own. No serving engine runs this rule (SGLang and vLLM serve one drafting method per server): it is
    measured (eval.py --lookup-first), never a serving default. Both drafters see every verified token and state."""

    def __init__(self, drafter: Drafter, min_n: int = 2, max_n: int = LOOKUP_MAX_N):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"lookup-first needs 1 <= min_n <= max_n, got min_n {min_n}, max_n {max_n}")
        self.drafter, self.lookup = drafter, NgramDrafter(max_n, min_n, drafter.default_gamma)
        self.layer_ids, self.default_gamma = drafter.layer_ids, drafter.default_gamma
        self.model = getattr(drafter, "model", None)

    def reset(self, tokens, target_hidden):
        super().reset(tokens, target_hidden)
        self.drafter.reset(tokens, target_hidden)
        self.copied_rounds = 0

    def propose(self, gamma, temperature, generator):
        self.lookup.tokens = self.tokens
        self.last = self.lookup.propose(gamma, temperature, generator)
        if self.last.tokens:
            self.copied_rounds += 1
        else:
            self.last = self.drafter.propose(gamma, temperature, generator)
        return self.last

    def accept(self, num_accepted, next_token, target_hidden):
        super().accept(num_accepted, next_token, target_hidden)
        self.drafter.last = self.last  # the proposal verified this round, whichever drafter made it
        self.drafter.accept(num_accepted, next_token, target_hidden)


def lookup_first_matches(draft: torch.Tensor, lookup: torch.Tensor, order: torch.Tensor, min_n: int) -> torch.Tensor:
    """[S, gamma] the matches of the lookup-first rule: lookup's proposal where it matched at least min_n tokens of
    the context (order, from lookup_proposals), the drafter's elsewhere."""
    return torch.where((order >= min_n)[:, None], lookup, draft)


def lookup_hits(input_ids: torch.Tensor, max_n: int = LOOKUP_MAX_N, min_n: int = 1) -> torch.Tensor:
    """[B, S] bool: position a is True when prompt lookup over input_ids[: a + 1] proposes input_ids[a + 1] first."""
    return torch.stack([lookup_matches(ids, 1, max_n, min_n)[:, 0] for ids in input_ids.tolist()])


def lookup_matches(ids: list[int], gamma: int, max_n: int = LOOKUP_MAX_N, min_n: int = 1) -> torch.Tensor:
    """[S, gamma] bool, draft_matches for prompt lookup: entry [a, j-1] says whether the n-gram drafter, run over
    ids[: a + 1], proposes ids[a + j] as its draft j (False past its proposal or the sequence)."""
    return lookup_proposals(ids, gamma, max_n, min_n)[0]


def lookup_proposals(ids: list[int], gamma: int, max_n: int = LOOKUP_MAX_N,
                     min_n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(lookup_matches [S, gamma], order [S] int: the length n of the context suffix lookup matched at each
    position, 0 where it proposes nothing).

    The rule of eval's NgramDrafter: the most recent earlier occurrence of the last n tokens, n = max_n..min_n,
    proposes the (up to gamma) tokens that followed it. One pass, a dict per n of each n-gram's latest end.
    """
    out = torch.zeros(len(ids), gamma, dtype=torch.bool)
    order = torch.zeros(len(ids), dtype=torch.long)
    latest_end = [dict() for _ in range(max_n + 1)]
    for a in range(len(ids) - 1):
        for n in range(min(max_n, a + 1), min_n - 1, -1):
            end = latest_end[n].get(tuple(ids[a - n + 1: a + 1]))
            if end is not None:
                proposal = ids[end + 1: min(end + 1 + gamma, a + 1)]
                for j, token in enumerate(proposal[: len(ids) - a - 1]):
                    out[a, j] = token == ids[a + j + 1]
                order[a] = n
                break
        for n in range(min_n, min(max_n, a + 1) + 1):
            latest_end[n][tuple(ids[a - n + 1: a + 1])] = a
    return out, order
