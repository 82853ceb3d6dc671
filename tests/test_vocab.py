"""The pruned draft vocabulary (modeling/vocab.py): which tokens are kept, the id maps both ways, their check."""

from __future__ import annotations

import pytest
import torch

from modeling.vocab import build_vocab_mapping, count_tokens, draft_to_target, mapping_agrees, target_to_draft

V, VD = 200, 64


def test_vocab_mapping_hand_example():
    # id:      0  1  2  3  4  5  6  7
    counts = torch.tensor([5, 0, 9, 5, 0, 1, 9, 0])
    d2t, t2d = build_vocab_mapping(counts, 4)
    # top by count: 2 (9), 6 (9), then 0 and 3 tie at 5 -> both fit; sorted by id
    assert t2d.tolist() == [True, False, True, True, False, False, True, False]
    assert d2t.tolist() == [0 - 0, 2 - 1, 3 - 2, 6 - 3]
    # tie at the cut: 0 and 3 both have 5, only one slot left after 2 and 6 -> the lower id (0) wins
    d2t, t2d = build_vocab_mapping(counts, 3)
    assert torch.nonzero(t2d).reshape(-1).tolist() == [0, 2, 6]
    # fewer tokens seen than slots: fill with the lowest unseen ids (1, 4) after the 5 seen ones
    d2t, t2d = build_vocab_mapping(counts, 7)
    assert torch.nonzero(t2d).reshape(-1).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    # many ties (a real-vocab-sized count vector): an unstable sort scrambles these, the rule says lowest ids first
    big = torch.zeros(5000, dtype=torch.int64)
    big[4000:] = 1
    d2t, t2d = build_vocab_mapping(big, 1010)
    assert torch.nonzero(t2d).reshape(-1).tolist() == list(range(10)) + list(range(4000, 5000))
    with pytest.raises(ValueError):
        build_vocab_mapping(counts, 9)


def test_count_tokens_uses_supervised_positions_only():
    samples = [
        (torch.tensor([3, 4, 4, 7]), torch.tensor([0, 1, 1, 0])),
        ([1, 3, 3], [1, 1, 0]),
    ]
    counts = count_tokens(samples, 8)
    assert counts.tolist() == [0, 1, 0, 1, 2, 0, 0, 0]


def test_vocab_round_trip():
    d2t, t2d = build_vocab_mapping(torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(3)), VD)
    assert int(t2d.sum()) == VD and d2t.shape == (VD,)
    kept = torch.nonzero(t2d).reshape(-1)
    assert torch.equal(torch.arange(VD) + d2t, kept)  # offsets reproduce the kept ids
    assert mapping_agrees(d2t, t2d) and not mapping_agrees(d2t.flip(0), t2d) and not mapping_agrees(d2t[1:], t2d)
    draft_ids = target_to_draft(kept, t2d)
    assert torch.equal(draft_ids, torch.arange(VD))
    assert torch.equal(draft_to_target(draft_ids, d2t), kept)
    dropped = torch.nonzero(~t2d).reshape(-1)
    assert (target_to_draft(dropped, t2d) == -1).all()
    # batched shapes pass through
    ids = kept[torch.randint(0, VD, (2, 5))]
    assert torch.equal(draft_to_target(target_to_draft(ids, t2d), d2t), ids)
