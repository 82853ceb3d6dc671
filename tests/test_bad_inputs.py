"""Bad input drill: every value below used to be accepted and to fail late (after regeneration, after training) or
never. Each is now refused by `train/main.py` (or `eval.py`) before anything is loaded or written, with exit code 2
and a message that names the key, flag or file and what a valid value is."""

import pytest

from conftest import ROOT, eval_cli, tiny_overrides
from pipeline import main

# (--set overrides, --stages, fragments the error must hold)
CASES = [
    ({"train.micro_batch_size": 0}, "train", ["train.micro_batch_size must be > 0, got 0"]),
    ({"train.save_every": 0}, "train", ["train.save_every must be > 0, got 0"]),
    ({"train.log_every": 0}, "train", ["train.log_every must be > 0, got 0"]),
    ({"loss.loss_decay_gamma": 0}, "train", ["loss.loss_decay_gamma must be > 0, got 0.0"]),
    ({"train.lr": "nan"}, "train", ["train.lr must be a finite number, got nan"]),
    ({"train.lr": "-1.0e-4"}, "train", ["train.lr must be > 0"]),
    ({"train.max_grad_norm": ".inf"}, "train", ["train.max_grad_norm must be a finite number, got inf"]),
    ({"train.warmup_ratio": 2}, "train", ["train.warmup_ratio must be in [0, 1]"]),
    ({"train.adam_beta2": 1}, "train", ["train.adam_beta2 must be in [0, 1)"]),
    ({"train.ema_decay": 1}, "train", ["train.ema_decay must be in [0, 1)", "got 1"]),
    ({"regen.top_p": 7}, "regenerate", ["regen.top_p must be in (0, 1]", "got 7"]),
    ({"regen.top_k": -5}, "regenerate", ["regen.top_k must be >= 1, or 0 / -1"]),
    ({"regen.temperature": -0.5}, "regenerate", ["regen.temperature must be >= 0"]),
    ({"regen.max_concurrency": 0}, "regenerate", ["regen.max_concurrency must be > 0, got 0"]),
    ({"regen.backend": "openai", "regen.server_urls": "[localhost:30000]"}, "regenerate",
     ["regen.server_urls[0]: 'localhost:30000' is not an http(s) URL"]),
    ({"regen.request_timeout_s": 0}, "regenerate", ["regen.request_timeout_s must be > 0"]),
    ({"regen.request_attempts": 0}, "regenerate", ["regen.request_attempts must be > 0, got 0"]),
    ({"regen.backend": "vllm", "regen.engine_python": "/nonexistent/python"}, "regenerate",
     ["regen.backend vllm: no python at '/nonexistent/python'", "make venv-vllm"]),
    ({"regen.backend": "sglang", "regen.engine_python": "/nonexistent/python"}, "regenerate",
     ["regen.backend sglang: no python at '/nonexistent/python'", "make venv-sglang", "regen.engine_python"]),
    ({"regen.server_startup_s": 0}, "regenerate", ["regen.server_startup_s must be > 0, got 0"]),
    ({"draft.num_anchors": 0}, "train", ["draft.num_anchors must be > 0, got 0"]),
    ({"loss.ce_alpha": -1}, "train", ["loss.ce_alpha must be >= 0"]),
    ({"train.feature_noise": -0.1}, "train", ["train.feature_noise must be >= 0"]),
    ({"target.layer_ids": "[1, -3]"}, "cache", ["target.layer_ids must be decoder layer indices >= 0"]),
    # checked against the target's config (40 layers), before regeneration rather than after it
    ({"target.layer_ids": "[1, 8, 99]"}, "regenerate,cache",
     ["target.layer_ids [1, 8, 99]: [99] out of range", "40 decoder layers (valid ids 0..39)"]),
    ({"draft.mask_token_id": 10**7}, "train", ["draft.mask_token_id 10000000 is outside the target vocabulary"]),
    # an eval set named wrong used to be found only after training
    ({"eval.dataset": "mtbenhc"}, "train,eval", ["eval.dataset: unknown prompt source 'mtbenhc'",
                                                "Did you mean 'mtbench'?"]),
    ({"eval.dataset": "/nonexistent/eval.jsonl"}, "eval", ["eval.dataset: file /nonexistent/eval.jsonl not found"]),
    ({"data.sources": "[{name: /nonexistent/prompts.jsonl}]"}, "regenerate",
     ["data.sources[0]: file /nonexistent/prompts.jsonl not found"]),
    ({"data.sources": "[{name: sharegpt, weight: -1}]"}, "regenerate", ["data.sources[].weight must be > 0"]),
    ({"train.global_batch_size": 5, "train.micro_batch_size": 2}, "train",
     ["train.global_batch_size=5 must be a multiple of train.micro_batch_size × ranks = 2 × 1"]),
    ({"train.lr": "[1"}, "train", ["--set train.lr=[1: the value is not valid YAML", "column"]),
    ({"opd.steps_per_round": 0}, "train,opd", ["opd.steps_per_round must be > 0, got 0"]),
    ({"train.hidden_states": "disk"}, "train", ["train.hidden_states"]),
    # each used to fail late: in eval after 93 s of work, out of memory after regenerate and cache, with the hub's
    # 'Repo id must be in the form ...' after loading the recipe; a name used to write outside runs/
    ({"seed": -1}, "regenerate,cache,train,eval", ["seed must be in [0, 2**32)", "got -1"]),
    ({"draft.block_size": 100000}, "regenerate,cache,train", ["draft.block_size 100000", "GiB of activations",
                                                             "block drafters use 7-16"]),
    # a cache the disk may not hold used to be refused by the cache stage, after 5-12 hours of regeneration
    ({"data.num_prompts": 10**9, "data.allow_fewer": "true", "data.max_length": 4096}, "regenerate,cache",
     ["train.hidden_states cache: not enough free space for the hidden-state cache (at most data.num_prompts "
      "1,000,000,000 x data.max_length 4,096 tokens", "--set train.hidden_states=online", "--stages regenerate"]),
    ({"target.name_or_path": "/nonexistent/Qwen3-8B"}, "regenerate",
     ["target.name_or_path: no such model folder '/nonexistent/Qwen3-8B'"]),
    ({"target.name_or_path": "./models/qwen3"}, "regenerate", ["no such model folder './models/qwen3'"]),
    ({"target.name_or_path": str(ROOT / "recipes")}, "regenerate", ["is not a model folder (no config.json in it)"]),
    # a stage whose input no stage wrote used to end in a traceback ('No such file ...train/final/config.json')
    ({}, "eval", ["--stages eval reads", "train/final, which no finished train stage wrote", "--stages train,eval"]),
    ({}, "export", ["--stages export reads", "no finished train stage wrote"]),
    ({}, "train", ["--stages train reads", "cache, which no finished cache stage wrote"]),
    ({"name": "../../../escape"}, "regenerate", ["name '../../../escape' must be a plain name", "runs/<name>"]),
    ({"name": "/tmp/abs"}, "regenerate", ["name '/tmp/abs' must be a plain name"]),
]


@pytest.mark.parametrize("sets,stages,fragments", CASES,
                         ids=[next(iter(c[0]), "--stages") + "=" + str(next(iter(c[0].values()), c[1])) for c in CASES])
def test_bad_value_is_refused_before_any_work(sets, stages, fragments, tiny_qwen3, prompt_file, tmp_path, capsys,
                                              drill):
    drill("bad-input", f"--set {sets}")
    out = tmp_path / "run"
    code = main(["--recipe", "dspark_qwen3_8b", "--stages", stages, "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file, **sets))
    err = capsys.readouterr().err
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, err
    assert not out.exists()  # nothing half-written, nothing marked done


def test_malformed_yaml_names_the_file(tmp_path, capsys, drill):
    drill("bad-input", "malformed recipe YAML")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("family: dspark\ntrain: {max_steps: 10\n")
    out = tmp_path / "run"
    assert main(["--recipe", str(recipe), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{recipe} is not valid YAML" in err and f'in "{recipe}", line 2' in err and "<unicode string>" not in err
    assert not out.exists()


# eval.py: (arguments, a fragment the error must hold); each refused with usage and exit code 2 before the target loads
EVAL_CASES = [
    (["--num-samples", "0"], "--num-samples must be > 0, got 0"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be > 0, got -3"),
    (["--temperature", "nan"], "--temperature must be >= 0"),
    (["--draft", "/nonexistent/draft"], "--draft /nonexistent/draft: not a draft folder"),
    (["--dataset", "mtbenhc"], "Did you mean 'mtbench'?"),
    (["--dataset", "/nonexistent/prompts.jsonl"], "--dataset: file /nonexistent/prompts.jsonl not found"),
    (["--target", "/nonexistent/model"], "--target /nonexistent/model: no such model folder"),
    (["--schedule", "confidence"], "--schedule confidence needs a DSpark draft folder"),
    (["--sts", "/nonexistent/sts.json"], "--sts calibrates the confidence schedule"),
    (["--schedule", "confidence", "--sts", "/nonexistent/sts.json"], "--sts /nonexistent/sts.json: [Errno 2]"),
    # used to fail after decoding every prompt (numpy's "expected non-negative integer" in the scheduler simulation)
    (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
]


@pytest.mark.parametrize("args,fragment", EVAL_CASES, ids=[" ".join(c[0]) for c in EVAL_CASES])
def test_eval_cli_refuses_bad_arguments_before_loading_anything(args, fragment, tmp_path, capsys, drill):
    drill("bad-input", "eval.py " + " ".join(args))
    cli = eval_cli()
    defaults = {"--draft": "ngram", "--target": "smollm2-135m-instruct", "--dataset": "mtbench"}
    argv = [arg for flag, value in defaults.items() if flag not in args for arg in (flag, value)]
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as refused:
        cli.main(argv + args + ["--out", str(out)])
    assert refused.value.code == 2
    assert fragment in capsys.readouterr().err
    assert not out.exists()


# eval.py with a trained 7-position block draft: each used to fail only after the target loaded (--lookup-first: a
# traceback from LookupFirstDrafter), or after decoding every prompt (--block-size 8: a round proposes 7 drafts, so
# position 8's calibration had no rounds, "ece_before[7] nan")
DRAFT_CASES = [
    (["--block-size", "8"], "is a block draft of 7 positions (its config.json's block_size)"),
    (["--lookup-first", "-1"], "--lookup-first must be in 0..3"),
    (["--lookup-first", "4"], "--lookup-first must be in 0..3"),
]


@pytest.mark.parametrize("args,fragment", DRAFT_CASES, ids=[" ".join(c[0]) for c in DRAFT_CASES])
def test_eval_cli_refuses_what_the_draft_cannot_do_before_loading_anything(args, fragment, tmp_path, capsys, drill):
    from test_export import make_block_draft

    drill("bad-input", "eval.py --draft <7-position block draft> " + " ".join(args))
    draft = make_block_draft(tmp_path / "draft", markov_rank=4, confidence=True, gamma=7)
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as refused:
        eval_cli().main(["--draft", str(draft), "--target", "smollm2-135m-instruct", "--dataset", "mtbench",
                         "--out", str(out)] + args)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    assert not out.exists()


def test_eval_block_size_limit_is_the_block_drafts_own(tmp_path):
    """--block-size up to the block draft's block_size passes, and an Eagle3 chain drafts as many steps as asked."""
    from types import SimpleNamespace

    from test_export import make_block_draft, make_eagle3_draft

    cli = eval_cli()
    block = make_block_draft(tmp_path / "block", markov_rank=0, gamma=7)
    eagle3 = make_eagle3_draft(tmp_path / "eagle3")  # ttt_length 3
    for draft, block_size in ((block, 7), (eagle3, 8)):
        args = SimpleNamespace(num_samples=1, max_new_tokens=2, block_size=block_size, temperature=0.0, seed=0,
                               lookup_first=0, draft=str(draft), sts=None, schedule="fixed", live=False,
                               dataset="mtbench", dataset_path=None, target="smollm2-135m-instruct")
        assert cli.argument_problems(args) == []
