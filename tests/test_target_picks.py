"""Your own target in one command (issue 48 item 3): what `train/main.py --target ... --prompts ... --family ...` picks
from a target's config and tokenizer (modeling/target_picks.py), against the hand-written recipes where they exist,
on tiny random targets of other architectures, what it refuses (naming the --set that fixes it), that a --set wins,
and one whole run on a target that is neither SmolLM2 nor Qwen3.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, set_args
from core.recipe import FAMILIES, compose_recipe, load_recipe
from data.assets import build_qwen3_tokenizer, make_tiny_target
from data.sources.registry import read_source, resolve_source
from modeling.target import load_target, load_tokenizer
from modeling.target_picks import non_embedding_params, pick_dtype, pick_for_target, pick_layer_ids, pick_mask_token
from pipeline import main
from train.algorithms import DEFAULT_MASK_TOKEN_ID

PROBES = [[{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello. How can I help?"},
           {"role": "user", "content": "Write a haiku about the sea."}]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root, tokenizer = tmp_path_factory.mktemp("own"), build_qwen3_tokenizer()
    return lambda arch, layers=12, tok=tokenizer: make_tiny_target(root / f"{arch}-{layers}", arch, tokenizer=tok,
                                                                   num_layers=layers)


@pytest.fixture(scope="module")
def qwen3_8b_config(tmp_path_factory):
    """Qwen3-8B's shape (its config, no weights) and the real Qwen3 tokenizer: the picks read nothing else."""
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("qwen3-8b-config")
    Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                dtype="bfloat16").save_pretrained(path)
    build_qwen3_tokenizer().save_pretrained(path)
    return str(path)


def test_layer_ids_follow_the_hand_written_recipes():
    for recipe, layers in (("dspark_smollm2_135m", 30), ("dspark_qwen3_8b", 36), ("dspark_qwen3_14b", 40),
                           ("dflash_qwen3_4b", 36), ("eagle3_qwen3_8b", 36), ("eagle3_qwen3_14b", 40)):
        family = recipe.split("_")[0]
        assert pick_layer_ids(layers, family)[0] == load_recipe(recipe).target.layer_ids, recipe
    # SmolLM2's Eagle3 recipe reads a subset of the block drafters' layers so that one cache serves all three
    # families; a target of its own gets SGLang's [2, L/2, L-3]
    assert pick_layer_ids(30, "eagle3")[0] == [2, 15, 27] != load_recipe("eagle3_smollm2_135m").target.layer_ids
    for layers in (2, 3, 4, 5, 6):  # shallow: distinct ids, never the last layer (the engines cannot capture it)
        for family in ("dspark", "eagle3"):
            ids, _ = pick_layer_ids(layers, family)
            assert ids == sorted(set(ids)) and ids[0] >= 0 and ids[-1] <= layers - 2, (layers, family, ids)
    assert pick_layer_ids(1, "dspark")[0] is None


@pytest.mark.parametrize("arch", ["llama3", "gemma3", "deepseek-v3", "qwen3-moe"])
def test_picks_on_tiny_targets(tiny, arch):
    path = tiny(arch)
    tokenizer = load_tokenizer(path)
    picks = pick_for_target(path, "dspark", [], on_gpu=False)
    assert picks.refusals == []
    assert picks.fields["target"] == {"layer_ids": [1, 3, 5, 7, 9], "dtype": "float32"}
    # the Qwen3 vocabulary make_tiny_target writes: the first row past the tokenizer, as the Qwen3 recipes
    qwen3_mask = load_recipe("dspark_qwen3_8b").draft.mask_token_id
    assert picks.fields["draft"]["mask_token_id"] == len(tokenizer) == qwen3_mask
    assert picks.fields["draft"]["num_layers"] == 2 and picks.fields["draft"]["markov_rank"] == 64  # a tiny target
    assert len(picks.lines) == 7 and all(": " in line for line in picks.lines)  # each pick says why
    # the parameters the size is picked by are the real model's, experts and MLA included
    model = load_target(path)
    embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
    assert non_embedding_params(model.config) == sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    # the recipe the driver composes from the picks is valid, and runs the family's draft
    recipe = compose_recipe(["dspark", "own"], {**picks.fields, "target": {**picks.fields["target"],
                                                                          "name_or_path": path}}, [], "x")
    assert recipe.family == "dspark" and recipe.target.layer_ids == [1, 3, 5, 7, 9]


def test_mask_token_picks_on_real_tokenizers(smollm2_tokenizer):
    """SmolLM2 (vocabulary = tokenizer): a special token no chat renders, the one its recipes use (<|endoftext|>, 0)."""
    mask, why = pick_mask_token(smollm2_tokenizer, 49152, {smollm2_tokenizer.eos_token_id})
    assert mask == DEFAULT_MASK_TOKEN_ID == 0 and "<|endoftext|>" in why
    rendered = smollm2_tokenizer.apply_chat_template(PROBES[0], tokenize=True, return_dict=False)
    assert mask not in rendered
    # one whose every special token ends a turn has none to give: refused, not guessed
    specials = set(smollm2_tokenizer.added_tokens_decoder)
    assert pick_mask_token(smollm2_tokenizer, 49152, specials)[0] is None


def test_smollm2_picks_match_its_recipes():
    """The real SmolLM2 target: every pick equals its hand-written recipe's, but Eagle3's layers (see above)."""
    for family in FAMILIES:
        recipe = load_recipe(f"{family}_smollm2_135m")
        fields = pick_for_target("smollm2-135m-instruct", family, [], on_gpu=False).fields
        if family != "eagle3":
            assert fields["target"]["layer_ids"] == recipe.target.layer_ids
            assert fields["draft"]["mask_token_id"] == DEFAULT_MASK_TOKEN_ID  # the recipes' null means it
            assert fields["draft"]["num_layers"] == recipe.draft.num_layers == 2
        if family == "dspark":
            assert fields["draft"]["markov_rank"] == recipe.draft.markov_rank == 64
        if family == "dflash2":
            assert fields["draft"]["selector_rank"] == recipe.draft.selector_rank == 64
        if family == "eagle3":
            assert fields["draft"] == {"draft_vocab_size": recipe.draft.draft_vocab_size}
        # float32: the checkpoint's, and what the recipes' auto runs on a CPU
        assert fields["target"]["dtype"] == "float32"


def test_a_large_target_gets_deepspecs_draft(qwen3_8b_config):
    """Qwen3-8B's shape: the dspark_qwen3_8b recipe's layers, MASK, draft depth and Markov rank; bf16 on a GPU."""
    recipe = load_recipe("dspark_qwen3_8b")
    picks = pick_for_target(qwen3_8b_config, "dspark", [], on_gpu=True)
    assert picks.fields["target"] == {"layer_ids": recipe.target.layer_ids, "dtype": "bfloat16"}
    assert picks.fields["draft"] == {"mask_token_id": recipe.draft.mask_token_id,
                                     "num_layers": recipe.draft.num_layers, "markov_rank": recipe.draft.markov_rank}
    dflash2 = pick_for_target(qwen3_8b_config, "dflash2", [], on_gpu=True).fields["draft"]
    assert (dflash2["num_layers"], dflash2["selector_rank"]) == (load_recipe("dflash2_qwen3_8b").draft.num_layers,
                                                                 load_recipe("dflash2_qwen3_8b").draft.selector_rank)
    eagle3 = pick_for_target(qwen3_8b_config, "eagle3", [], on_gpu=False).fields
    assert eagle3["target"]["layer_ids"] == load_recipe("eagle3_qwen3_8b").target.layer_ids
    assert eagle3["draft"] == {"draft_vocab_size": load_recipe("eagle3_qwen3_8b").draft.draft_vocab_size}
    assert pick_dtype("bfloat16", on_gpu=False)[0] == "float32" and pick_dtype("float32", on_gpu=True)[0] == "bfloat16"


def test_a_set_wins_over_the_picks(tiny):
    path = tiny("llama3")
    sets = ["target.layer_ids=[2, 4]", "draft.mask_token_id=5", "draft.num_layers=3"]
    picks = pick_for_target(path, "dspark", sets, on_gpu=False)
    assert "layer_ids" not in picks.fields["target"] and picks.fields["draft"] == {"markov_rank": 64}
    assert not any(line.startswith(("target.layer_ids", "draft.mask_token_id", "draft.num_layers"))
                   for line in picks.lines)
    recipe = compose_recipe(["dspark", "own"], picks.fields, sets, "x")
    assert (recipe.target.layer_ids, recipe.draft.mask_token_id, recipe.draft.num_layers) == ([2, 4], 5, 3)


def test_what_cannot_be_picked_is_refused_naming_the_set(tiny, tmp_path, capsys):
    """A tokenizer without a chat template (a base model's) and a one-layer target: one error line each, naming the
    --set that fixes it; nothing is written. With the --set, the run goes on."""
    from transformers import AutoTokenizer

    base_tokenizer = AutoTokenizer.from_pretrained(tiny("qwen3"))
    base_tokenizer.chat_template = None
    path = make_tiny_target(tmp_path / "base", "llama3", tokenizer=base_tokenizer, num_layers=1)
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is a fjord?\n\nName a prime number.\n")
    out = tmp_path / "run"
    assert main(["--target", path, "--prompts", str(prompts), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--set target.chat_template=FILE" in err
    assert "--set target.layer_ids=[...]" in err
    assert not out.exists()
    template = tmp_path / "chatml.jinja"
    template.write_text(load_tokenizer(tiny("qwen3")).chat_template)
    sets = [f"target.chat_template={template}", "target.layer_ids=[0]"]
    picks = pick_for_target(path, "dspark", sets, on_gpu=False)
    assert picks.refusals == [] and any(line.startswith("target.chat_template = ") for line in picks.lines)
    # the recipe's template is the one every stage renders chats with
    assert load_tokenizer(path, str(template)).chat_template == template.read_text()
    assert main(["--target", path, "--prompts", str(prompts), "--out", str(out), "--stages", "regenerate",
                 "--set", "target.chat_template=/no/such.jinja"]) == 2
    assert "target.chat_template: no file '/no/such.jinja'" in capsys.readouterr().err
    assert main(["--target", path, "--out", str(out), *set_args({"target.chat_template": template,
                                                                 "target.layer_ids": [0]})]) == 2
    assert "--prompts FILE" in capsys.readouterr().err


def test_a_prompt_file_that_holds_no_prompts_is_refused_up_front(tiny, tmp_path, monkeypatch, capsys, drill):
    """`--prompts dir/prompts.csv` (relative) used to be tried as a hub dataset at the regenerate stage, and an empty
    .txt file to end there in a ValueError traceback: both are refused before anything is written, rc 2."""
    drill("bad-input", "--prompts: a relative .csv file, an empty .txt file")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "prompts.csv").write_text("prompt\nhello\n")
    (tmp_path / "empty.txt").write_text("")
    for prompts, says in (("dir/prompts.csv", "prompt file 'dir/prompts.csv' is not in a prompt format"),
                          ("empty.txt", "file empty.txt is empty (or blank): it holds no prompt")):
        out = tmp_path / "run"
        assert main(["--target", tiny("llama3", 6), "--prompts", prompts, "--stages", "regenerate", "--set",
                     "regen.backend=hf", "--out", str(out)]) == 2
        assert f"data.sources[0]: {says}" in capsys.readouterr().err
        assert not out.exists()


@pytest.fixture(scope="module")
def not_causal(tmp_path_factory):
    """Checkpoints that are no decoder-only causal LM, with a tokenizer beside each: a BERT (transformers loads it as
    BertLMHeadModel, attending both ways with a new head), a T5 (an encoder-decoder), and a Llama whose config.json
    names a dtype torch has not."""
    from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

    from data.assets import QWEN3_VOCAB_SIZE

    root, tokenizer = tmp_path_factory.mktemp("not-causal"), build_qwen3_tokenizer()
    BertModel(BertConfig(vocab_size=QWEN3_VOCAB_SIZE, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                         intermediate_size=128)).save_pretrained(root / "bert")
    T5ForConditionalGeneration(T5Config(vocab_size=QWEN3_VOCAB_SIZE, d_model=32, d_ff=64, num_layers=2, num_heads=2,
                                        d_kv=16)).save_pretrained(root / "t5")
    llama = Path(make_tiny_target(root / "float7", "llama3", tokenizer=tokenizer, num_layers=6))
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "dtype": "float7"}))
    for name in ("bert", "t5"):
        tokenizer.save_pretrained(root / name)
    return {"bert": (root / "bert", "attends both ways"), "t5": (root / "t5", "describes an encoder-decoder model"),
            "float7": (llama, "cannot be read as a model config (module 'torch' has no attribute 'float7')")}


@pytest.mark.parametrize("kind", ["bert", "t5", "float7"])
def test_a_target_that_is_no_causal_lm_is_refused_before_regenerating(kind, not_causal, tmp_path, capsys, drill):
    """A BERT target used to regenerate (hours, on a real run) and be refused only at the cache stage ('BertLMHeadModel
    has no .model.layers'); a T5 failed in transformers at the regenerate stage, a dtype of float7 in an
    AttributeError traceback: each is refused before anything is written, naming its config.json, for --target and
    for a recipe's target.name_or_path."""
    drill("bad-input", f"a {kind} target")
    path, says = not_causal[kind]
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is a fjord?\n")
    out = tmp_path / "run"
    assert main(["--target", str(path), "--prompts", str(prompts), "--stages", "regenerate", "--set",
                 "regen.backend=hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: --target: {path / 'config.json'}" in err and says in err, err
    assert main(["--recipe", "dspark_smollm2_135m", "--stages", "regenerate,cache", "--out", str(out),
                 *set_args({"target.name_or_path": path, "regen.backend": "hf"})]) == 2
    err = capsys.readouterr().err
    assert f"target.name_or_path: {path / 'config.json'}" in err and says in err, err
    assert not out.exists()


TEMPLATES = {  # --set target.chat_template value (FILE: the file written with the bytes), what the refusal says
    "123": (None, "target.chat_template: 123 is not a path: give a Jinja chat template file"),
    "[unclosed": (None, "--set target.chat_template: the value is not valid YAML"),
    "binary": (bytes(range(128, 256)) * 16, "is not UTF-8 text (invalid start byte at byte 0)"),
    "jinja error": (b"{% if %}\n", ", line 1: not a Jinja template (Expected an expression"),
}


@pytest.mark.parametrize("case", TEMPLATES)
def test_a_chat_template_that_cannot_be_one_is_refused_up_front(case, tiny, tmp_path, capsys, drill):
    """`--set target.chat_template=` 123 used to be a TypeError in pick_for_target, '[unclosed' a YAML traceback, a
    binary file a UnicodeDecodeError, and a Jinja syntax error a TemplateSyntaxError naming '<unknown>' at the
    regenerate stage: each is one error line, rc 2, before anything is written (with --recipe too)."""
    drill("bad-input", f"--set target.chat_template: {case}")
    content, says = TEMPLATES[case]
    value = case
    if content is not None:
        value = str(tmp_path / "template.jinja")
        Path(value).write_bytes(content)
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is a fjord?\n")
    out = tmp_path / "run"
    assert main(["--target", tiny("llama3", 6), "--prompts", str(prompts), "--stages", "regenerate", "--set",
                 "regen.backend=hf", "--set", f"target.chat_template={value}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    if content is not None:  # (123 and "[unclosed" the recipe schema and its YAML refuse)
        assert main(["--recipe", "dspark_smollm2_135m", "--stages", "regenerate", "--out", str(out), "--set",
                     f"target.chat_template={value}"]) == 2
        err = capsys.readouterr().err
        assert says.removeprefix("target.chat_template: ") in err, err
    assert not out.exists()


def test_a_target_without_tokenizer_files_is_refused_naming_them(tiny, tmp_path, capsys, drill):
    """A folder with the config and weights but no tokenizer used to end in transformers' '...sentencepiece or
    tiktoken installed' traceback."""
    import shutil

    drill("bad-input", "--target: a folder without tokenizer files")
    path = tmp_path / "notok"
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny("llama3", 6)) / name, path / name)
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is a fjord?\n")
    assert main(["--target", str(path), "--prompts", str(prompts), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: no tokenizer can be loaded from it" in err and "tokenizer.json" in err, err
    assert not (tmp_path / "run").exists()


def test_a_text_prompt_file_is_one_prompt_a_line(tmp_path):
    prompts = tmp_path / "mine.txt"
    prompts.write_text("What is a fjord?\n\n  Name a prime number.  \n")
    rows = read_source(resolve_source(str(prompts), None), "train", None)
    assert [list(p.turns) for p in rows] == [["What is a fjord?"], ["Name a prime number."]]
    assert len({p.id for p in rows}) == 2


@pytest.mark.slow
def test_one_command_on_a_tiny_llama3(tiny, tmp_path):
    """The issue's must-show: one command, no recipe, a Llama 3 target (make_tiny_target's: the Qwen3 tokenizer, whose
    153k-row vocabulary a random model samples nearly all of; with SmolLM2's 49k tokens it answers with ids no
    tokenizer decodes), through regenerate, cache, train, eval and export; the export carries the picks."""
    path = tiny("llama3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Tell me one fact about the number {i}."]}) + "\n"
                               for i in range(24)))
    out = tmp_path / "run"
    sets = {"data.num_prompts": 12, "regen.backend": "hf", "regen.max_new_tokens": 16, "train.max_steps": 4,
            "train.global_batch_size": 2, "train.save_every": 4, "draft.num_anchors": 8, "eval.num_samples": 2,
            "eval.max_new_tokens": 16}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), "--target", path, "--prompts", str(prompts),
                          "--family", "dspark", "--out", str(out), *set_args(sets)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    picked = [line for line in run.stdout.splitlines() if line.startswith("[pick] ")]
    assert any("target.layer_ids = [1, 3, 5, 7, 9]" in line for line in picked), picked
    assert any("draft.mask_token_id = 151669" in line for line in picked), picked  # past the tokenizer
    assert "recipe dspark_llama3-12 (dspark)" in run.stdout
    exported = json.loads((out / "export" / "sglang" / "config.json").read_text())
    assert exported["mask_token_id"] == 151669 and exported["num_hidden_layers"] == 2
    assert json.loads((out / "eval" / "report.json").read_text())["accept_len"] >= 1.0
    # a --set chat template is the one the engine is told to render requests with (the same text here)
    template = tmp_path / "template.jinja"
    template.write_text(load_tokenizer(path).chat_template)
    again = subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), "--target", path, "--prompts",
                            str(prompts), "--out", str(out), "--stages", "export",
                            *set_args({**sets, "target.chat_template": template})],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[pick] target.chat_template = " in again.stdout
    command = next(line for line in again.stdout.splitlines() if line.startswith("[export] serve it"))
    argv = shlex.split(command.split(" with: ", 1)[1])
    from sglang.srt.server_args import prepare_server_args

    assert prepare_server_args(argv[argv.index("sglang.launch_server") + 1:]).chat_template == str(template)
