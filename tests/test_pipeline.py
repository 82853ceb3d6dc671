"""The regenerate and cache stages end to end: Qwen3 recipes on a tiny random Qwen3 with the real Qwen3 tokenizer,
two ranks, refusal of a mismatched or corrupted cache, and the real
SmolLM2 target."""

import json
import re
from collections import Counter

import pytest
import torch

from data.states.cache import CacheCorruptedError, CacheMismatchError
from data.states.capture import open_cache
from modeling.target import decoder_layers, load_tokenizer
from pipeline import main
from core.recipe import load_recipe

from conftest import run_cli, tiny_overrides


# each family and each size once (every recipe's layer ids and keys are checked against the tiny Qwen3 in test_recipes)
@pytest.mark.parametrize("name", ["dspark_qwen3_4b", "dflash_qwen3_8b", "eagle3_qwen3_14b"])
def test_qwen3_recipes_run_both_stages_on_a_tiny_qwen3(name, tiny_qwen3, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--recipe", name, "--stages", "regenerate,cache", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file)) == 0
    printed = capsys.readouterr().out
    assert "B/token" in printed and "tok/s" in printed
    records = [json.loads(line) for line in (out / "regen" / "records.jsonl").read_text().splitlines()]
    assert len(records) == 8
    recipe = load_recipe(name, ["target.name_or_path=" + str(tiny_qwen3)])
    tokenizer = load_tokenizer(str(tiny_qwen3))
    cache = open_cache(recipe, out / "cache", 64, tokenizer, verify=True)
    assert len(cache) == 8
    sample = cache[0]
    k = len(recipe.target.layer_ids)
    assert sample["hidden_states"].shape == (len(sample["input_ids"]), k * 64)
    assert sample["last_hidden_state"].shape == (len(sample["input_ids"]), 64)
    assert sample["hidden_states"].dtype == torch.bfloat16
    # the cached ids are the template rendering of the regenerated conversation, answers supervised
    assert sample["loss_mask"].sum() > 0
    assert tokenizer.decode(sample["input_ids"][:1]) == "<|im_start|>"


def test_multi_turn_replay_uses_own_answers(tiny_qwen3, prompt_file, tmp_path, monkeypatch):
    import modeling.target

    args = ["--recipe", "dspark_qwen3_8b", "--stages", "regenerate"] + tiny_overrides(
        tiny_qwen3, prompt_file, **{"regen.temperature": 0})
    # The random tiny Qwen3 never says its eos, and an answer cut at regen.max_new_tokens ends its conversation: no
    # second turn is asked after an answer that did not end.
    assert main(args + ["--out", str(tmp_path / "cut")]) == 0
    cut = [json.loads(line) for line in (tmp_path / "cut" / "regen" / "records.jsonl").read_text().splitlines()]
    assert all(r["truncated"] and len(r["response_ids"]) == 1 for r in cut)
    # With the token it says first (greedy) as its eos, its first answers end, and the second turns are asked.
    said_first = Counter(r["response_ids"][0][0] for r in cut).most_common(1)[0][0]

    def ending_tokenizer(name, chat_template=None):
        tokenizer = load_tokenizer(name, chat_template)
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(said_first)
        return tokenizer

    monkeypatch.setattr(modeling.target, "load_tokenizer", ending_tokenizer)  # what run_stages imports
    out = tmp_path / "run"
    assert main(args + ["--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "regen" / "records.jsonl").read_text().splitlines()]
    two_turn = [r for r in records if sum(m["role"] == "user" for m in r["conversations"]) == 2]
    assert two_turn, "the fixture has two-turn prompts"
    for record in two_turn:
        roles = [m["role"] for m in record["conversations"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert "regeneration discards" not in record["conversations"][1]["content"]
        assert len(record["response_ids"]) == 2


def test_two_ranks_split_the_work_and_match_one_rank(tiny_qwen3, prompt_file, tmp_path):
    args = ["--recipe", "dflash_qwen3_4b", "--stages", "regenerate,cache"] + tiny_overrides(tiny_qwen3, prompt_file)
    one = run_cli(args + ["--out", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_cli(args + ["--out", str(tmp_path / "two")], torchrun=2)
    assert two.returncode == 0, two.stderr[-3000:]
    for stage_dir in ("regen/records.jsonl", "cache/index.bin", "cache/manifest.json"):
        assert (tmp_path / "one" / stage_dir).read_bytes() == (tmp_path / "two" / stage_dir).read_bytes()


def test_a_cache_fed_train_stage_holds_only_the_targets_parts(tiny_qwen3, prompt_file, tmp_path, monkeypatch):
    """train.hidden_states cache, cache.backend hf: the train stage reads only the target's embedding, final norm and
    lm_head and the layers draft.init_layers copies, so the whole target regenerate and cache ran is cut down to them
    before the trainer builds (it used to hold it whole: 16.4 GB a rank for Qwen3-8B, of which it reads ~2.5 GB).
    No second load; every other decoder layer is on the meta device."""
    import modeling.target
    import train.trainer
    from test_trainer import TRAIN

    loads, held = [], []
    real_load, real_parts, real_train = (modeling.target.load_target, modeling.target.load_target_parts,
                                         train.trainer.run_train)
    monkeypatch.setattr(modeling.target, "load_target", lambda *a, **k: loads.append("whole") or real_load(*a, **k))
    monkeypatch.setattr(modeling.target, "load_target_parts",
                        lambda *a, **k: loads.append("parts") or real_parts(*a, **k))

    def run_train(job):
        held.append(job.get_target())
        return real_train(job)

    monkeypatch.setattr(train.trainer, "run_train", run_train)  # what pipeline's train stage imports
    sets = {**TRAIN, "train.max_steps": 1, "draft.num_layers": 2, "draft.init_layers": "target"}
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate,cache,train", "--out", str(tmp_path / "run")]
                + tiny_overrides(tiny_qwen3, prompt_file, **sets)) == 0
    assert loads == ["whole"] and len(held) == 1
    layers = decoder_layers(held[0])
    assert len(layers) == 40 and all(p.is_meta for layer in layers[:-2] for p in layer.parameters())
    assert not any(p.is_meta for layer in layers[-2:] for p in layer.parameters())  # the two draft.init_layers copies
    for kept in (held[0].get_input_embeddings(), held[0].model.norm, held[0].get_output_embeddings()):
        assert not any(p.is_meta for p in kept.parameters())


def test_target_parts_of_a_hub_id_load_from_its_snapshot_in_the_hub_cache(tiny_qwen3, tmp_path, monkeypatch):
    """The Qwen3 recipes name their target by hub id, and a cache-fed train stage loads only its parts: from the hub
    cache's snapshot, where from_pretrained put the model (load_target_parts used to refuse all but a folder)."""
    import shutil

    import huggingface_hub.constants
    from modeling.target import load_target, load_target_parts, weights_fingerprint

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny--qwen3"
    shutil.copytree(tiny_qwen3, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    parts = load_target_parts("tiny/qwen3")
    assert all(p.is_meta for layer in decoder_layers(parts) for p in layer.parameters())
    assert weights_fingerprint(parts) == weights_fingerprint(load_target(str(tiny_qwen3)))
    with pytest.raises(FileNotFoundError, match=r"'tiny/other': no local folder, and its hub snapshot cannot be read"):
        load_target_parts("tiny/other")


def test_cache_refuses_mismatch_and_corruption(tiny_qwen3, prompt_file, tmp_path, drill, capsys):
    drill("corruption", "a flipped byte in a cache shard (verify)")
    drill("bad-input", "a cache of other layers")
    drill("bad-input", "a cache of another target")
    drill("bad-input", "a rerun with other regen settings")
    out = tmp_path / "run"
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate,cache", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file)) == 0
    tokenizer = load_tokenizer(str(tiny_qwen3))
    other = load_recipe("dspark_qwen3_14b", ["target.name_or_path=" + str(tiny_qwen3)])
    with pytest.raises(CacheMismatchError, match="layer_ids"):
        open_cache(other, out / "cache", 64, tokenizer)
    renamed = load_recipe("dspark_qwen3_8b", ["target.name_or_path=Qwen/Qwen3-8B"])
    with pytest.raises(CacheMismatchError, match="target"):
        open_cache(renamed, out / "cache", 64, tokenizer)

    # rerunning into the same folder with other settings is refused, naming the key, as an error (exit code 2)
    capsys.readouterr()
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file, **{"regen.temperature": 0.1})) == 2
    refusal = capsys.readouterr().err
    assert refusal.startswith("error: ") and "regen.temperature" in refusal and "Traceback" not in refusal

    shard = sorted((out / "cache").glob("shard-*.bin"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    recipe = load_recipe("dspark_qwen3_8b", ["target.name_or_path=" + str(tiny_qwen3)])
    with pytest.raises(CacheCorruptedError, match=shard.name):
        open_cache(recipe, out / "cache", 64, tokenizer, verify=True)


def test_a_raw_cache_made_before_the_fp8_default_is_named_and_read_as_it_is(tiny_qwen3, prompt_file, tmp_path,
                                                                          capsys):
    """cache.encoding defaults to fp8 (half the bytes); a finished raw cache folder is refused by the default, with
    the key and the --set that reuses it, and a recipe saying raw skips the stage and reads the cache."""
    assert load_recipe("dspark_qwen3_8b").cache.encoding == "fp8"
    out = tmp_path / "run"
    raw = tiny_overrides(tiny_qwen3, prompt_file, **{"cache.encoding": "raw"})
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate,cache", "--out", str(out)] + raw) == 0
    assert json.loads((out / "cache" / "manifest.json").read_text())["codec"] == "raw"
    capsys.readouterr()
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "cache", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file)) == 2
    refusal = capsys.readouterr().err
    assert re.search(r"(?s)^error: .*cache\.encoding.*--set cache\.encoding=raw reads or resumes", refusal)
    done_before = (out / "cache" / "DONE.json").read_bytes()
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "cache", "--out", str(out)] + raw) == 0
    assert (out / "cache" / "DONE.json").read_bytes() == done_before  # skipped, not rebuilt


def test_auto_backend_regenerates_through_vllm_where_it_is_built_and_a_folder_keeps_its_choice(vllm_python, tmp_path,
                                                                                                 capsys, monkeypatch):
    """The SmolLM2 recipes' regen.backend auto: vLLM's server where a python with vLLM is found, else in-process with
    the fix named; a CUDA device keeps it in-process (the project's vLLM is the CPU build). A run says its choice and
    pins the concrete backend; a later run on the folder keeps it whatever it would choose now."""
    from data.regen.backends import choose_backend

    assert load_recipe("dspark_smollm2_135m").regen.backend == "auto"
    assert load_recipe("dspark_smollm2_135m_overfit").regen.backend == "hf"
    built = load_recipe("dspark_smollm2_135m", [f"regen.engine_python={vllm_python}"]).regen
    absent = load_recipe("dspark_smollm2_135m", [f"regen.engine_python={tmp_path / 'no-vllm' / 'python'}"]).regen
    assert choose_backend(built)[0] == "vllm"
    backend, why = choose_backend(absent)
    assert backend == "hf" and "no-vllm" in why and "make venv-vllm" in why
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        assert choose_backend(built)[0] == "hf"

    out = tmp_path / "auto"
    sets = ["--set", "data.sources=[{name: mtbench}]", "--set", "data.num_prompts=2", "--set", "data.max_turns=1",
            "--set", "regen.max_new_tokens=4", "--set", "data.min_loss_tokens=1"]
    run = ["--recipe", "dspark_smollm2_135m", "--stages", "regenerate", "--out", str(out)] + sets
    assert main(run + ["--set", f"regen.engine_python={tmp_path / 'no-vllm' / 'python'}"]) == 0
    assert "regen.backend auto: hf, in-process" in capsys.readouterr().out
    assert json.loads((out / "regen" / "settings.json").read_text())["regen"]["backend"] == "hf"
    assert main(run + ["--set", f"regen.engine_python={vllm_python}"]) == 0  # would choose vllm: keeps hf, skips
    assert "regen.backend auto" not in capsys.readouterr().out


def test_smollm2_target_regenerates_and_caches(tmp_path, capsys):
    out = tmp_path / "smol"
    assert main(["--recipe", "dspark_smollm2_135m", "--stages", "regenerate,cache", "--out", str(out),
                 "--set", "data.num_prompts=4", "--set", "regen.backend=hf",
                 "--set", "regen.max_new_tokens=12", "--set", "regen.batch_size=4", "--set", "data.min_loss_tokens=1",
                 "--set", "data.sources=[{name: mtbench}]", "--set", "regen.temperature=0"]) == 0
    printed = capsys.readouterr().out
    assert "B/token" in printed
    records = [json.loads(line) for line in (out / "regen" / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    recipe = load_recipe("dspark_smollm2_135m")
    cache = open_cache(recipe, out / "cache", 576, tokenizer, verify=True)
    sample = cache[0]
    assert sample["hidden_states"].shape[-1] == 5 * 576
    # greedy answers are real text from the target, and the supervised tokens are exactly the answers + <|im_end|>
    answer = records[0]["conversations"][-1]["content"]
    supervised = tokenizer.decode(sample["input_ids"][sample["loss_mask"].bool()])
    assert answer.strip() and answer.strip()[:20] in supervised
    # the final-norm state reproduces the target's next-token choice through the frozen lm_head
    from modeling.target import load_target

    model = load_target("smollm2-135m-instruct")
    ids = sample["input_ids"].long()[None]
    with torch.no_grad():
        logits = model(ids).logits[0].float()
        cached = model.lm_head(sample["last_hidden_state"].float())
    agree = (logits.argmax(-1) == cached.argmax(-1)).float().mean().item()
    assert agree > 0.95  # bf16 storage may flip near-ties only


def test_a_run_that_did_work_and_then_crashed_keeps_its_recipe(tiny_qwen3, prompt_file, tmp_path, monkeypatch, drill):
    """recipe.yaml is the recipe a folder's stages were last made with: a refused run leaves it as it was
    (tests/test_bad_inputs.py), a run whose stage pinned and wrote its folder before a crash leaves the new one."""
    import export.convert
    from core.io import write_checksums
    from test_export import make_block_draft

    drill("bad-input", "a crash after the export stage wrote its folder")
    out = tmp_path / "run"
    write_checksums(make_block_draft(out / "train" / "final", markov_rank=0, sample_from_anchor=False))
    (out / "train" / "DONE.json").write_text("{}")
    (out / "recipe.yaml").write_text("# an earlier recipe\n")

    def crash(*args, **kwargs):
        raise RuntimeError("a bug after the export was written")

    monkeypatch.setattr(export.convert, "serve_notes", crash)
    with pytest.raises(RuntimeError, match="a bug after the export"):
        main(["--recipe", "dspark_qwen3_8b", "--stages", "export", "--out", str(out)]
             + tiny_overrides(tiny_qwen3, prompt_file, **{"train.lr": 0.005}))
    assert (out / "export" / "sglang" / "model.safetensors").is_file()
    assert "lr: 0.005" in (out / "recipe.yaml").read_text()  # what export/settings.json was pinned with


def test_a_folder_made_before_a_key_existed_matches_at_its_default_and_not_otherwise(tmp_path):
    """An upgrade adds recipe keys (DFlash2 added draft.selector_rank and loss.selector_alpha): a train folder pinned
    before them resumes under the new version while they sit at their defaults (which keep the old behaviour), and is
    refused, naming the key, when the recipe sets one."""
    from dataclasses import asdict

    from core import stage

    recipe = load_recipe("dspark_smollm2_135m")
    now = {"family": recipe.family, "draft": asdict(recipe.draft), "loss": asdict(recipe.loss)}
    before = json.loads(json.dumps(now))
    del before["draft"]["selector_rank"], before["loss"]["selector_alpha"]
    stage.begin(tmp_path / "train", before)
    stage.begin(tmp_path / "train", now)  # the folder still matches
    assert json.loads((tmp_path / "train" / stage.SETTINGS_NAME).read_text()) == before  # and is not re-pinned
    changed = load_recipe("dspark_smollm2_135m", ["loss.selector_alpha=0.5"])
    with pytest.raises(stage.StageMismatchError, match=r"loss.selector_alpha: None in the folder, 0.5 now"):
        stage.begin(tmp_path / "train", {**now, "loss": asdict(changed.loss)})
