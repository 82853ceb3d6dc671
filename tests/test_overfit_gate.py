"""The overfit gate, an overfit check by design: each drafter family memorises a handful of greedy answers of the real
SmolLM2-135M-Instruct target and then reaches tau >= 6 (gamma 7, T=0) on THOSE SAME prompts, through the whole
pipeline (regenerate, cache, train) and the lossless speculative loop. It proves the training signal works; it says
nothing about prompts the drafter never saw (benchmarks/quality.py measures that).

Recipes: recipes/{dspark,dflash,eagle3}_smollm2_135m_overfit.yaml (recipes/base/overfit.yaml: one sequence and 8
anchors per step, CE, target-initialised layers). Before them the smollm2 recipes reached tau 1.76 on 16 such prompts.
The prompts, and the trained drafters the live vLLM checks serve too, come from conftest's `overfit_drafts`.
"""

from __future__ import annotations

import pytest
import torch

from core.recipe import load_recipe
from data.capture import open_cache
from eval.replay import replay_records
from eval.run import run_eval
from modeling.registry import load_draft_model
from modeling.target import load_tokenizer

GATE_TAU = 6.0


@pytest.mark.parametrize("family", ["dspark", "dflash", "eagle3"])
def test_each_family_memorises_its_training_answers(family, overfit_drafts, tmp_path, record_property):
    gate = overfit_drafts
    final = gate.draft(family)  # trained here, or already by the live vLLM check (the same session fixture)
    recipe = load_recipe(f"{family}_smollm2_135m_overfit")
    report = run_eval(draft=str(final), target_name="smollm2-135m-instruct", dataset=str(gate.prompts),
                      out_dir=tmp_path / "eval", num_samples=0, temperature=0.0, block_size=7,
                      max_new_tokens=recipe.eval.max_new_tokens, scheduler=False, target=gate.target,
                      baselines=gate.baselines)
    rates = ", ".join(f"{v:.2f}" for v in report["accept_rate_at_k"])
    record_property("figure", f"overfit gate {family}: tau {report['accept_len']:.3f} on its {report['num_samples']} "
                              f"training prompts (gate {GATE_TAU}), accept@k {rates}")
    assert report["exact_match"] == 1.0  # lossless, whatever the drafter
    assert report["accept_len"] >= GATE_TAU, f"{family} memorised too little: tau {report['accept_len']:.3f}"

    # The replay of the loop over the cached answers (eval/replay.py) agrees with the loop where drafts are long (within
    # 5%: the two cut the last round of an answer differently, one round in ~8 per prompt here).
    cache = open_cache(recipe, gate.data / "cache", 576, load_tokenizer("smollm2-135m-instruct"))
    model = load_draft_model(final).float()
    with torch.no_grad():
        replayed = replay_records(model, [cache[i] for i in range(len(cache))], 7, recipe.eval.max_new_tokens)
    assert abs(replayed["accept_len"] - report["accept_len"]) <= 0.05 * report["accept_len"]
