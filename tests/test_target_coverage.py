"""Target coverage, measured on a handful of transformers' causal-LM model types: benchmarks/target_coverage.py builds
each one tiny and random from its config class's defaults and runs DraftSmith's pre-flight on it. A Llama and a
GPT-NeoX pass; BERT (its LM head attends both ways) and Mamba (its cache cannot be rolled back to reproduce an
uncached forward) are refused, each naming the step and why; BLT, too big at its defaults shrunk, is not built; and no
type fails with a traceback. ~20 s on 2 CPU cores; `python benchmarks/target_coverage.py` walks all of them.
"""

from __future__ import annotations

import pytest

from benchmarks.target_coverage import LAYERS, VOCAB, _fewer_layers, counts, markdown, run_coverage, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


def test_the_defaults_shrink_by_one_rule_per_key_kind():
    mistral = tiny_config("mistral")
    assert (mistral.num_hidden_layers, mistral.hidden_size, mistral.num_attention_heads, mistral.num_key_value_heads,
            mistral.head_dim, mistral.intermediate_size, mistral.vocab_size) == (LAYERS, 64, 4, 2, 16, 128, VOCAB)
    assert mistral.sliding_window == 8  # a window the prompt runs past
    assert tiny_config("llama").num_key_value_heads == 4  # as many as its heads, as at its defaults (no GQA)
    assert tiny_config("deepseek_v3").num_key_value_heads == 4  # MLA: one key and value per head
    gpt2 = tiny_config("gpt2")  # the same kinds under GPT-2's names
    assert (gpt2.n_layer, gpt2.n_embd, gpt2.n_head, gpt2.vocab_size) == (LAYERS, 64, 4, VOCAB)
    assert gpt2.eos_token_id < VOCAB
    mixtral = tiny_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    # a per-layer list keeps every kind of layer, twice where the full stack has several
    assert _fewer_layers(["sliding"] * 5 + ["full"] + ["sliding"] * 5 + ["full"]) == ["sliding", "sliding", "full",
                                                                                       "full"]
    assert _fewer_layers(["a", "b", "c", "d", "e"]) == ["a", "b", "c", "d"]
    gemma3 = tiny_config("gemma3_text")
    assert sorted(set(gemma3.layer_types)) == ["full_attention", "sliding_attention"]
    assert len(gemma3.layer_types) == LAYERS


def test_each_verdict_and_no_traceback():
    rows = {row["type"]: row for row in run_coverage(["llama", "gpt_neox", "bert", "mamba", "blt"])}
    verdicts = {name: row["verdict"] for name, row in rows.items()}
    assert verdicts == {"llama": "pass", "gpt_neox": "pass", "bert": "refused", "mamba": "refused",
                        "blt": "could not build"}, rows
    assert "attends both ways" in rows["bert"]["reason"]
    assert "the cached decode" in rows["mamba"]["reason"]
    assert "M parameters at its defaults shrunk" in rows["blt"]["reason"]
    assert rows["llama"]["class"] == "LlamaForCausalLM" and rows["llama"]["parameters"] > 0
    found = counts(list(rows.values()))
    assert found["FAIL"] == 0 and found["timed out"] == 0
    table = markdown(list(rows.values()), "dspark", "x", 1.0)
    assert "| bert | BertLMHeadModel | refused | at attention that looks only back" in table
    assert "| pass | 2 | 40.0% | 50.0% |" in table and "Met: 0 FAIL" in table
    assert "- attention that looks only back: 1 (bert)" in table
