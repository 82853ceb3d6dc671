"""Online hidden states (train.hidden_states: online): the train stage runs the target itself and no cache is written.
Every family trains and evaluates end to end on the real SmolLM2 target with no cache on disk; on the tiny Qwen3, an
online run (killed and resumed on the way) logs exactly the losses of the offline run on the same rows."""

import json
import shutil

import pytest
import torch

from conftest import run_cli, set_args, tiny_overrides
from core import stage
from core.dist import Dist
from core.recipe import load_recipe
from data.states.capture import CacheJob, open_cache, run_cache
from data.states.online import OnlineRecords
from modeling.target import load_target, load_tokenizer
from pipeline import main
from test_trainer import TRAIN, assert_same_run, metrics


def test_online_run_equals_offline_run_and_resumes_exactly(tiny_qwen3, prompt_file, tmp_path, drill):
    drill("kill", "kill -9 at train:3, online hidden states")
    offline, online = tmp_path / "offline", tmp_path / "online"
    # One conversation per target forward in both runs: a padded batch of other rows may round a state differently.
    sets = {**TRAIN, "train.max_steps": 6, "train.save_every": 2, "cache.batch_size": 1}
    base = ["--recipe", "dspark_qwen3_8b", "--out"]
    done = run_cli(base + [str(offline), "--stages", "regenerate,cache,train"] + tiny_overrides(tiny_qwen3, prompt_file, **sets))
    assert done.returncode == 0, done.stderr[-3000:]

    # the same regenerated records, trained online: killed after step 3, then resumed from the step-2 checkpoint
    online.mkdir()
    shutil.copytree(offline / "regen", online / "regen")
    args = base + [str(online), "--stages", "regenerate,cache,train"] + tiny_overrides(tiny_qwen3, prompt_file, **sets, **{"train.hidden_states": "online"})
    killed = run_cli(args, {"DRAFTSMITH_KILL_AT": "train:3"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_cli(args)  # every stage: regenerate is complete, cache is skipped, train resumes
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[cache] skipped: train.hidden_states is online" in resumed.stdout and "resuming from" in resumed.stdout
    assert not (online / "cache").exists()

    assert_same_run(online, offline)  # every loss, norm and rate, and the final weights, exactly
    assert all(row["hidden_s"] > 0 for row in metrics(online))


def three_records(tmp_path):
    regen = tmp_path / "regen"
    regen.mkdir()
    conversations = [[{"role": "user", "content": f"What is {i} + {i}?"},
                      {"role": "assistant", "content": f"{i} + {i} is {2 * i}."}] for i in range(3)]
    (regen / "records.jsonl").write_text("".join(json.dumps({"id": str(i), "conversations": conversation}) + "\n"
                                                 for i, conversation in enumerate(conversations)))
    stage.mark_done(regen, {})
    return regen


def test_online_identity_pins_the_states_dtype_and_encoding(tiny_qwen3, tmp_path):
    """The train stage pins its data's identity: resuming an online run whose states would be rounded (cache.dtype)
    or encoded (cache.encoding) otherwise is refused as a changed setting, as another cache is offline."""
    regen = three_records(tmp_path)
    model, tokenizer = load_target(str(tiny_qwen3)), load_tokenizer(str(tiny_qwen3))
    identities = set()
    for sets in (["cache.encoding=raw"], ["cache.dtype=float32"], ["cache.dtype=float16"], []):  # [] = fp8, bf16
        recipe = load_recipe("dspark_qwen3_8b", [f"target.name_or_path={tiny_qwen3}", "data.min_loss_tokens=1", *sets])
        identities.add(OnlineRecords(recipe, regen, tokenizer, lambda: model).manifest["index_sha256"])
    assert len(identities) == 4


@pytest.mark.parametrize("encoding", ["raw", "fp8"])
def test_online_states_are_what_an_offline_run_reads_back(tiny_qwen3, tmp_path, encoding):
    """Bit for bit, cache.dtype's rounding and cache.encoding's round trip included: the run above, without training."""
    recipe = load_recipe("dspark_qwen3_8b", [f"target.name_or_path={tiny_qwen3}", f"cache.encoding={encoding}",
                                             "cache.batch_size=1", "data.min_loss_tokens=1"])
    regen = three_records(tmp_path)
    model, tokenizer = load_target(str(tiny_qwen3)), load_tokenizer(str(tiny_qwen3))
    run_cache(CacheJob(recipe, regen, tmp_path / "cache", Dist(), lambda: model, tokenizer))
    offline = open_cache(recipe, tmp_path / "cache", model.config.hidden_size, tokenizer)
    assert offline.manifest["codec"] == encoding
    online = OnlineRecords(recipe, regen, tokenizer, lambda: model)
    assert len(online) == len(offline) == 3
    for i, record in enumerate(online.with_hidden([online[i] for i in range(len(online))])):
        for key in ("hidden_states", "last_hidden_state"):
            assert record[key].dtype == offline[i][key].dtype == torch.bfloat16
            assert torch.equal(record[key].view(torch.int16), offline[i][key].view(torch.int16)), (i, key)


def test_both_model_kinds_train_online_on_smollm2_with_no_cache(tmp_path, capsys):
    sets = {"data.sources": "[{name: mtbench}]", "data.num_prompts": 2, "data.min_loss_tokens": 1,
            "data.max_length": 160, "regen.backend": "hf", "regen.max_new_tokens": 16, "regen.batch_size": 2, "train.hidden_states": "online",
            "draft.num_layers": 1, "draft.num_anchors": 8, "draft.block_size": 3, "draft.ttt_length": 3,
            "train.global_batch_size": 2, "train.micro_batch_size": 1, "train.max_steps": 2, "train.save_every": 2,
            "train.log_every": 1, "train.warmup_ratio": 0.0,
            "eval.dataset": "humaneval", "eval.num_samples": 1, "eval.max_new_tokens": 8}
    regen = tmp_path / "regen-once"
    assert main(["--recipe", "dflash_smollm2_135m", "--out", str(regen), "--stages", "regenerate"] + set_args(sets)) == 0
    # DFlash is DSpark's model without the Markov and confidence heads: the same online path, so DSpark stands for both
    for family, extra in (("dspark", {"draft.markov_rank": 8}), ("eagle3", {"draft.draft_vocab_size": 256})):
        out = tmp_path / family
        out.mkdir()
        shutil.copytree(regen / "regen", out / "regen")  # the three recipes share their data and regeneration keys
        capsys.readouterr()
        assert main(["--recipe", f"{family}_smollm2_135m", "--out", str(out)] + set_args({**sets, **extra})) == 0
        printed = capsys.readouterr().out
        assert "[cache] skipped" in printed and "(hidden states: online)" in printed
        visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # .draftsmith.lock stays
        assert visible == ["eval", "export", "recipe.yaml", "regen", "train"], family
        rows = metrics(out)
        assert [r["step"] for r in rows] == [1, 2] and all(r["hidden_s"] > 0 and r["loss"] > 0 for r in rows)
        report = json.loads((out / "eval" / "report.json").read_text())
        assert report["exact_match"] == 1.0 and report["accept_len"] >= 1.0


@pytest.mark.parametrize("family", ["dspark", "eagle3"])
def test_online_states_never_leave_the_targets_device(tiny_qwen3, tmp_path, family):
    """G10: from the target's forward to the draft's input, online states stay on the target's device. Here that is
    PyTorch's `meta` device, where a copy to the host raises ("Cannot copy out of meta tensor"): the forward, the
    recipe's fp8 rounding and the Trainer's padding all run, and the batch the draft gets is still on it. (Eager
    attention: sdpa's mask check reads one flag of the attention mask on the host, a sync but no state.)"""
    from train.algorithms import attach_hidden, get_algorithm

    recipe = load_recipe(f"{family}_qwen3_8b", [f"target.name_or_path={tiny_qwen3}", "data.min_loss_tokens=1",
                                                "cache.batch_size=2", "draft.num_anchors=4"])
    assert recipe.cache.encoding == "fp8"
    regen = three_records(tmp_path)
    model, tokenizer = load_target(str(tiny_qwen3)), load_tokenizer(str(tiny_qwen3))
    online = OnlineRecords(recipe, regen, tokenizer, lambda: model)
    model.set_attn_implementation("eager")
    model.to("meta")
    meta = torch.device("meta")
    records = [online[i] for i in range(len(online))]
    batch = get_algorithm(family).make_batch(recipe, records, seeds=[(0, 0, i) for i in range(3)], device=meta)
    batch = attach_hidden(batch, online.with_hidden(records), meta, torch.bfloat16)
    width, hidden = max(len(r["input_ids"]) for r in records), model.config.hidden_size
    layers = len(recipe.target.layer_ids)
    assert batch["hidden_states"].device == meta and batch["hidden_states"].shape == (3, width, layers * hidden)
    assert batch["last_hidden_state"].device == meta and batch["last_hidden_state"].shape == (3, width, hidden)
    with pytest.raises(NotImplementedError, match="meta tensor"):  # the probe works: a host copy would have raised
        batch["hidden_states"].cpu()
