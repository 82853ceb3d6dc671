"""A pruned draft vocabulary: the most frequent supervised target tokens, and the maps between its ids and the target's.

Eagle3 drafts over `draft_vocab_size` of them (its `d2t`/`t2d` buffers, SGLang's names), a block drafter trained with
`loss.vocab_size` over its own (`draft_vocab`, token_map.pt), and the cache stage counts the tokens they are chosen
from (data/states/capture.py). It imports nothing of the project, so each of them (modeling/, data/, train/, export/)
imports it from here instead of from another's model file.

    counts = count_tokens(((ids, mask) for ids, mask in dataset), vocab_size)   # [V] int64
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size)                     # [Vd] offsets, [V] bool
    target_ids = draft_to_target(draft_ids, d2t); draft_ids = target_to_draft(target_ids, t2d)   # -1: not kept
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Counts [vocab_size] int64 of the tokens at supervised positions (loss_mask != 0) over (input_ids, loss_mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in samples:
        ids = torch.as_tensor(input_ids).reshape(-1)
        mask = torch.as_tensor(loss_mask).reshape(-1).bool()
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} differ in length")
        kept = ids[mask].long()
        if kept.numel() and (kept.min() < 0 or kept.max() >= vocab_size):
            raise ValueError(f"token id out of range 0..{vocab_size - 1}: min {kept.min()}, max {kept.max()}")
        counts += torch.bincount(kept, minlength=vocab_size)
    return counts


def build_vocab_mapping(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64 offsets, t2d [V] bool) for the `draft_vocab_size` most frequent target tokens.

    Ties go to the lower id, so unseen tokens (count 0) fill the remainder lowest id first. Kept ids are sorted by
    target id; draft id i is the i-th kept id and target_id = i + d2t[i] (SGLang: hot_token_id = d2t + arange).
    """
    counts = torch.as_tensor(token_counts).reshape(-1)
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size}")
    # A stable descending sort keeps equal counts in ascending id order: that is the tie-break.
    order = torch.sort(counts, descending=True, stable=True).indices
    kept = torch.sort(order[:draft_vocab_size]).values.long()
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def draft_to_target(ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Draft ids -> target ids (any shape)."""
    return ids + d2t.to(ids.device)[ids]


def target_to_draft(ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids (any shape); target ids outside the draft vocab map to -1 (callers mask them)."""
    t2d = t2d.to(ids.device)
    index = torch.cumsum(t2d.long(), 0) - 1  # draft id of each kept target id, by rank among kept ids
    return torch.where(t2d[ids], index[ids], torch.full_like(ids, -1))


def mapping_agrees(d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    """Whether arange(Vd) + d2t are exactly the ids where t2d is True, in order (both on any device)."""
    kept = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.cpu()
    return torch.equal(kept, torch.nonzero(t2d.cpu()).reshape(-1))
