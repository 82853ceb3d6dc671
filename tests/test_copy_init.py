"""train/copy_init.py: draft.init_copy starts a block drafter's first attention layer as prompt lookup, so that before
any training its first draft is right where the next token follows an earlier occurrence of the pending token."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.recipe import RecipeError, load_recipe
from eval.replay import replay_records
from modeling.dspark import DSparkModel, build_dspark_config
from modeling.target import capture_hidden_states
from train.algorithms import _init_draft
from train.copy_init import MATCH_DIMS, freeze_copy_attention, init_copy_attention

VOCAB, HIDDEN, LAYER_IDS = 200, 128, [0, 1, 3]


class Records(list):
    """The two things copy_init reads of a cache: records by index and `with_hidden` (a no-op for a cache)."""

    def with_hidden(self, records):
        return records


@pytest.fixture(scope="module")
def target_and_records():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
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


def copying_records(target, count: int = 8) -> Records:
    """Answers that restate their prompt (prompt + prompt), with made-up states: the first captured layer names the
    token and the one before it, the final-norm state predicts the answer's next token in the answer and some other
    token in the prompt (what the target would have said there is not what the prompt says)."""
    g = torch.Generator().manual_seed(3)
    words = torch.randperm(VOCAB - 8, generator=g)[:48] + 8  # 48 tokens: a linear read can name each one
    previous = torch.randn(VOCAB, HIDDEN, generator=g)
    embed, head = target.get_input_embeddings().weight, target.lm_head.weight
    records = Records()
    for _ in range(count):
        prompt = words[torch.randperm(len(words), generator=g)[:20]]  # no token twice: one earlier occurrence each
        ids = torch.cat([prompt, prompt])
        predicted = torch.cat([words[torch.randint(len(words), (len(prompt) - 1,), generator=g)], ids[len(prompt):],
                               ids[:1]])  # at j: the token the final-norm state predicts
        last = head[predicted] / head[predicted].norm(dim=-1, keepdim=True)
        first = embed[ids] + previous[torch.cat([ids[:1], ids[:-1]])]
        hidden = torch.cat([first, torch.randn(len(ids), HIDDEN, generator=g), last + 0.01 * torch.randn(
            len(ids), HIDDEN, generator=g)], dim=-1)
        records.append({"input_ids": ids, "loss_mask": (torch.arange(len(ids)) >= len(prompt)).to(torch.uint8),
                        "hidden_states": hidden, "last_hidden_state": last})
    return records


def test_copying_the_text_drafts_what_followed_where_the_prediction_there_was_other(target_and_records):
    # draft.copy_follows: text keys on the previous token, so it copies the prompt's next token; prediction copies the
    # target's prediction after the earlier occurrence, which in a prompt is not what the prompt says
    target, _ = target_and_records
    records = copying_records(target)
    right = {}
    for follows in ("prediction", "text"):
        model = draft(target)
        init_copy_attention(model, records, follows=follows)
        with torch.no_grad():
            right[follows] = replay_records(model, records, 4)
    assert right["text"]["lookup_hit_share"] > 0.9  # every answer token but the first restates the prompt
    assert right["prediction"]["first_draft_right_at_lookup_hits"] < 0.2
    assert right["text"]["first_draft_right_at_lookup_hits"] > 0.7  # measured 0.80 against 0.02
    assert right["text"]["accept_len"] > right["prediction"]["accept_len"] + 0.5
    with pytest.raises(ValueError, match="draft.copy_follows='next': prediction or text"):
        init_copy_attention(draft(target), records, follows="next")


def test_the_frozen_copy_start_stays_as_fitted_while_the_rest_trains(target_and_records):
    target, records = target_and_records
    model = draft(target).train()
    init_copy_attention(model, records, kv_heads=1)  # one of the two key/value heads copies, the other trains
    freeze_copy_attention(model, kv_heads=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                  weight_decay=0.0)  # the recipes' train.weight_decay
    record = records[0]
    for _ in range(3):
        states = model(record["input_ids"][None].long().clone(), record["hidden_states"][None].float().clone(),
                       torch.tensor([[12, 24, 36]]), attn_impl="sdpa")
        optimizer.zero_grad()
        states.pow(2).mean().backward()
        optimizer.step()
    after = model.state_dict()
    attn = model.layers[0].self_attn
    kv_rows = attn.head_dim
    q_rows = kv_rows * attn.num_heads // attn.num_kv_heads
    kept = {"fc.weight": MATCH_DIMS + kv_rows, "layers.0.self_attn.q_proj.weight": q_rows,
            "layers.0.self_attn.k_proj.weight": kv_rows, "layers.0.self_attn.v_proj.weight": kv_rows}
    for name, rows in kept.items():
        assert torch.equal(after[name][:rows], before[name][:rows]), name
        assert not torch.equal(after[name][rows:], before[name][rows:]), name  # the rest does train
    o_proj = "layers.0.self_attn.o_proj.weight"
    assert torch.equal(after[o_proj][:, :q_rows], before[o_proj][:, :q_rows])
    assert not torch.equal(after[o_proj][:, q_rows:], before[o_proj][:, q_rows:])
    assert torch.equal(after["layers.0.self_attn.q_norm.weight"], before["layers.0.self_attn.q_norm.weight"])
    assert not torch.equal(after["layers.0.mlp.up_proj.weight"], before["layers.0.mlp.up_proj.weight"])


def test_eagle3_refuses_the_copy_start():
    recipe = load_recipe("eagle3_smollm2_135m", ["draft.init_copy=trained"])
    with pytest.raises(ValueError, match="draft.init_copy=none"):
        _init_draft(torch.nn.Linear(1, 1), recipe, None, None)


def test_frozen_copy_refuses_weight_decay():
    # AdamW's decoupled decay shrinks weights whose gradient is zeroed: the frozen copy path would fade silently
    with pytest.raises(RecipeError, match="set train.weight_decay=0 or draft.init_copy=trained"):
        load_recipe("dspark_smollm2_135m", ["train.weight_decay=0.01"])  # the recipe starts init_copy: frozen
    assert load_recipe("dspark_smollm2_135m", ["train.weight_decay=0.01", "draft.init_copy=trained"])
