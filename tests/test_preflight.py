"""Any target, round 2 (issue 57): what a drafter reads of a target is found on the target's modules
(modeling/anatomy.py), and the pre-flight (eval/preflight.py) runs every target-dependent step before the first stage.
Targets that used to fail late, after regenerating or training (a norm epsilon under another config key: StarCoder2,
Phi; a stack at `.gpt_neox.layers`; MiniMax's own cache class in the eval loop), now pass it and their runs go on; a
target the loop cannot run (a Mamba stack, which ignores the cache it is handed) or a model that attends both ways is
refused in seconds, naming the architecture and the step, with nothing written.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import set_args
from core.recipe import load_recipe
from data.assets import build_qwen3_tokenizer, make_tiny_target
from eval.preflight import PreflightError, check_target, preflight_problems
from modeling.anatomy import decoder_layers, draft_dims, final_norm, norm_eps, norm_kind, norm_scale, stack_name
from modeling.dspark import build_dspark_config
from modeling.target import load_target
from pipeline import main

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread

TINY_SETS = {"target.layer_ids": "[0, 1, 2]", "draft.num_layers": 1, "draft.block_size": 3, "draft.markov_rank": 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root, tokenizer = tmp_path_factory.mktemp("preflight"), build_qwen3_tokenizer()
    return lambda arch: make_tiny_target(root / arch, arch, tokenizer=tokenizer)


def recipe(family="dspark", **sets):
    keys = {**TINY_SETS, **sets}
    if family != "dspark":
        keys.pop("draft.markov_rank")
    return load_recipe(f"{family}_qwen3_8b", [f"{k}={v}" for k, v in keys.items()])


@pytest.mark.parametrize("arch, stack, kind, eps", [
    ("gpt-neox", "layers", "layernorm", 1e-5), ("gpt2", "h", "layernorm", 1e-5),
    ("starcoder2", "layers", "layernorm", 1e-4), ("qwen3", "layers", "rmsnorm", 1e-6)])
def test_the_stack_and_the_norm_are_read_off_the_modules(tiny, arch, stack, kind, eps):
    """GPT-NeoX keeps its stack at .gpt_neox.layers and GPT-2 at .transformer.h; StarCoder2's LayerNorm epsilon is
    its config's norm_epsilon (no rms_norm_eps: the draft's config raised AttributeError after regenerate and cache).
    The draft takes the epsilon the target's final norm module holds, and the norm's factor is its weight, bias or
    not."""
    model = load_target(tiny(arch))
    assert stack_name(model) == stack and len(decoder_layers(model)) == 4
    norm = final_norm(model)
    assert norm_kind(norm, 64) == kind and norm_eps(norm) == pytest.approx(eps)
    torch.testing.assert_close(norm_scale(norm), norm.weight)
    config = build_dspark_config(model, num_layers=1, block_size=3, target_layer_ids=[0, 1, 2], mask_token_id=151669)
    assert config.rms_norm_eps == pytest.approx(eps) and config.hidden_act == "silu"
    assert draft_dims(model)["num_hidden_layers"] == 4


@pytest.mark.parametrize("arch", ["starcoder2", "phi", "gpt-neox", "minimax"])
@pytest.mark.parametrize("family", ["dspark", "eagle3"])
def test_targets_that_failed_late_pass_the_preflight(tiny, arch, family):
    """Each used to fail after hours of work: StarCoder2 and Phi building the draft, GPT-NeoX at the cache stage,
    MiniMax in eval (a DynamicCache handed to a model with its own cache class). Each now passes every step, its eval
    loop's output the target's own greedy output."""
    sets = {"draft.draft_vocab_size": 512, "draft.ttt_length": 3} if family == "eagle3" else {}
    report = check_target(load_target(tiny(arch)), recipe(family, **sets))
    assert report.passed[-1] == "eval loop lossless", report.line()
    assert any(step.startswith("final norm") for step in report.passed), report.line()


def _mamba(folder):
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    MambaForCausalLM(MambaConfig(vocab_size=151936, hidden_size=64, num_hidden_layers=4, state_size=8,
                                 intermediate_size=128)).save_pretrained(folder)
    build_qwen3_tokenizer().save_pretrained(folder)
    return folder


def test_a_target_the_loop_cannot_run_is_refused_in_seconds_before_any_stage(tmp_path, capsys, drill):
    """A Mamba stack keeps its state in `cache_params` and ignores the cache the loop hands it: its cached logits are
    not its own. Before, such a target regenerated, cached and trained before eval found it; now the whole run is
    refused before the first stage, naming the architecture and the step, in seconds, with nothing written."""
    drill("bad-input", "a target whose cache the speculative loop cannot run (Mamba)")
    target = _mamba(tmp_path / "mamba")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is a fjord?\nName three rivers.\n")
    out = tmp_path / "run"
    start = time.perf_counter()
    code = main(["--target", str(target), "--prompts", str(prompts), "--family", "dspark", "--stages",
                 "regenerate,cache,train,eval", "--out", str(out),
                 *set_args({"regen.backend": "hf", "data.num_prompts": 2, "data.max_length": 128})])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2 and not out.exists(), err
    assert "MambaForCausalLM" in err and "the cached decode with a rollback" in err, err
    assert seconds < 30, seconds


def test_an_encoder_found_only_by_running_it_is_refused():
    """A model that attends both ways without saying so (no is_causal flag for the config check to read) is found by
    the pre-flight: a later token moves an earlier position's state."""
    from transformers import RoFormerConfig, RoFormerForCausalLM

    torch.manual_seed(0)
    model = RoFormerForCausalLM(RoFormerConfig(vocab_size=151936, hidden_size=64, num_hidden_layers=4,
                                               num_attention_heads=4, intermediate_size=128)).eval()
    with pytest.raises(PreflightError, match=r"RoFormerForCausalLM.*attention that looks only back.*both ways"):
        check_target(model, recipe())


def test_the_preflight_runs_once_per_target_and_prints_what_passed(tiny, tmp_path, capsys, monkeypatch):
    """pipeline.check_inputs runs it last, on rank 0: its line names each step; a second run of the same target in
    the process reuses the pass, and a later process (a resumed run) reads it back from $DRAFTSMITH_HOME/preflight;
    a run whose target stages are all done does not load the target at all."""
    from eval import preflight

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    path = tiny("gpt-neox")
    run = recipe(**{"target.name_or_path": path})
    start = time.perf_counter()
    assert preflight_problems(run, ["regenerate", "cache"], tmp_path / "run") == []
    first = time.perf_counter() - start
    line = capsys.readouterr().out
    assert "pre-flight of GPTNeoXForCausalLM: decoder stack .layers of 4" in line and "eval loop lossless" in line
    assert len(list((tmp_path / "home" / "preflight").glob("*.json"))) == 1
    for forget in (False, True):
        if forget:
            monkeypatch.setattr(preflight, "_PASSED", {})  # a new process
        start = time.perf_counter()
        assert preflight_problems(run, ["train"], tmp_path / "run") == []
        assert time.perf_counter() - start < first / 2
        assert ("remembered in" in capsys.readouterr().out) == forget
    assert preflight_problems(run, ["export"], tmp_path / "run") == [] and capsys.readouterr().out == ""


def test_a_near_tie_in_half_precision_is_a_note_not_a_refusal(tiny):
    """On a GPU the target runs in bf16, where the cached and the uncached forwards sum in other orders and may break a
    near-tie apart: the eval-loop step marks a token whose top two logits lie within rounding, and a difference there
    is noted; in float32 nothing is a tie, and any difference is a refusal."""
    from eval.preflight import _greedy

    ids = [(7919 * i + 11) % 30000 for i in range(12)]
    for dtype, flat in ((torch.bfloat16, True), (torch.float32, False)):
        model = load_target(tiny("qwen3"), dtype=str(dtype).removeprefix("torch."))
        head = model.get_output_embeddings().weight
        with torch.no_grad():  # every row nearly the first: flat logits, every token a near-tie
            head.copy_(head[:1].expand_as(head) + (1e-3 if flat else 1.0) * head)
        tokens, ties = _greedy(model, ids, 3)
        assert len(tokens) == 3 and ties == [flat] * 3, (dtype, ties)
