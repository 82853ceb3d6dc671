"""The overfit gate, an overfit check by design: each drafter family memorises a handful of greedy answers of the real
SmolLM2-135M-Instruct target and then reaches tau >= 6 (gamma 7, T=0) on THOSE SAME prompts, through the whole
pipeline (regenerate, cache, train) and the lossless speculative loop. It proves the training signal works; it says
nothing about prompts the drafter never saw (benchmarks/quality.py measures that).

Recipes: recipes/{dspark,dflash,eagle3}_smollm2_135m_overfit.yaml (recipes/base/overfit.yaml: one sequence and 8
anchors per step, CE, target-initialised layers). Before them the smollm2 recipes reached tau 1.76 on 16 such prompts.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import set_args
from core.recipe import load_recipe
from data.capture import open_cache
from eval.replay import replay_records
from eval.run import run_eval
from modeling.registry import load_draft_model
from modeling.target import load_target, load_tokenizer
from pipeline import main

PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that returns the sum of a list of numbers.",
    "Give me three tips for staying healthy.",
    "Explain what photosynthesis is to a ten-year-old.",
    "Write a short poem about the sea.",
    "What are the main differences between a cat and a dog as pets?",
    "How do I make a cup of tea?",
    "Summarize the plot of Romeo and Juliet.",
]
GATE_TAU = 6.0


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """The prompts, their greedy answers and the hidden-state cache, made once (the block drafters' five layers;
    Eagle3 reads its three of them)."""
    root = tmp_path_factory.mktemp("gate")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    data = root / "data"
    assert main(["--recipe", "dspark_smollm2_135m_overfit", "--stages", "regenerate,cache", "--out", str(data)]
                + set_args({"data.sources": f"[{{name: '{prompts}'}}]"})) == 0
    target = load_target("smollm2-135m-instruct")
    return {"prompts": prompts, "data": data, "target": target, "baselines": {}}


@pytest.mark.parametrize("family", ["dspark", "dflash", "eagle3"])
def test_each_family_memorises_its_training_answers(family, gate, tmp_path):
    recipe_name = f"{family}_smollm2_135m_overfit"
    out = tmp_path / "run"
    out.mkdir()
    for stage in ("regen", "cache"):
        (out / stage).symlink_to(gate["data"] / stage, target_is_directory=True)
    assert main(["--recipe", recipe_name, "--stages", "train", "--out", str(out)]
                + set_args({"data.sources": f"[{{name: '{gate['prompts']}'}}]"})) == 0

    recipe = load_recipe(recipe_name)
    report = run_eval(draft=str(out / "train" / "final"), target_name="smollm2-135m-instruct",
                      dataset=str(gate["prompts"]), out_dir=tmp_path / "eval", num_samples=0, temperature=0.0,
                      block_size=7, max_new_tokens=recipe.eval.max_new_tokens, scheduler=False,
                      target=gate["target"], baselines=gate["baselines"])
    rates = ", ".join(f"{v:.2f}" for v in report["accept_rate_at_k"])
    print(f"\n[gate] {family}: tau {report['accept_len']:.3f} on its {report['num_samples']} training prompts, "
          f"accept@k {rates}")
    assert report["exact_match"] == 1.0  # lossless, whatever the drafter
    assert report["accept_len"] >= GATE_TAU, f"{family} memorised too little: tau {report['accept_len']:.3f}"

    # The replay of the loop over the cached answers (eval/replay.py) agrees with the loop where drafts are long.
    cache = open_cache(recipe, gate["data"] / "cache", 576, load_tokenizer("smollm2-135m-instruct"))
    model = load_draft_model(out / "train" / "final").float()
    with torch.no_grad():
        replayed = replay_records(model, [cache[i] for i in range(len(cache))], 7, recipe.eval.max_new_tokens)
    assert abs(replayed["accept_len"] - report["accept_len"]) < 0.25
