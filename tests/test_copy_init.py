"""train/copy_init.py: draft.init_copy starts a block drafter's first attention layer as prompt lookup, so that before
any training its first draft is right where the next token follows an earlier occurrence of the pending token."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.recipe import load_recipe
from eval.replay import replay_records
from modeling.dspark import DSparkModel, build_dspark_config
from modeling.target import capture_hidden_states
from train.algorithms import _init_draft
from train.copy_init import init_copy_attention

VOCAB, HIDDEN, LAYER_IDS = 200, 96, [0, 1, 3]


class Records(list):
    """The two things copy_init reads of a cache: records by index and `with_hidden` (a no-op for a cache)."""

    def with_hidden(self, records):
        return records


@pytest.fixture(scope="module")
def target_and_records():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval().requires_grad_(False)
    target.lm_head.weight.mul_(20.0)  # decisive greedy choices, like a trained model's
    g = torch.Generator().manual_seed(1)
    records = Records()
    for _ in range(8):
        prompt = torch.randint(8, VOCAB, (10,), generator=g)
        # the target's greedy answer: a random small model soon repeats itself, so prompt lookup has much to copy
        ids = target.generate(prompt[None], max_new_tokens=56, do_sample=False, min_new_tokens=56)[0]
        hidden, last = capture_hidden_states(target, ids[None], torch.ones_like(ids[None]), LAYER_IDS)
        records.append({"input_ids": ids, "loss_mask": (torch.arange(len(ids)) >= len(prompt)).to(torch.uint8),
                        "hidden_states": hidden[0], "last_hidden_state": last[0]})
    return target, records


def draft(target) -> DSparkModel:
    config = build_dspark_config(target.config, num_layers=2, block_size=4, target_layer_ids=LAYER_IDS,
                                 mask_token_id=5, markov_rank=0, enable_confidence_head=False)
    torch.manual_seed(2)
    return DSparkModel.from_target(config, target).eval()


def test_the_copy_start_drafts_what_prompt_lookup_would(target_and_records, record_property):
    target, records = target_and_records
    plain, started = draft(target), draft(target)
    names = {k: v.shape for k, v in started.state_dict().items()}
    init_copy_attention(started, records)
    assert {k: v.shape for k, v in started.state_dict().items()} == names  # an ordinary drafter to export and serve

    with torch.no_grad():
        before = replay_records(plain, records, 4)
        after = replay_records(started, records, 4)
    record_property("figure", f"copy start, untrained: first draft right at {after['first_draft_right_at_lookup_hits']:.2f} "
                              f"of the lookup positions ({after['lookup_hit_share']:.0%} of all; N(0, 0.02) start "
                              f"{before['first_draft_right_at_lookup_hits']:.2f}), tau {before['accept_len']:.3f} -> "
                              f"{after['accept_len']:.3f}")
    assert after["lookup_hit_share"] > 0.3  # the answers do repeat
    assert before["first_draft_right_at_lookup_hits"] < 0.1
    assert after["first_draft_right_at_lookup_hits"] > 0.6
    assert after["accept_len"] > before["accept_len"] + 0.3


def test_eagle3_refuses_the_copy_start():
    recipe = load_recipe("eagle3_smollm2_135m", ["draft.init_copy=true"])
    with pytest.raises(ValueError, match="draft.init_copy=false"):
        _init_draft(torch.nn.Linear(1, 1), recipe, None, None)
