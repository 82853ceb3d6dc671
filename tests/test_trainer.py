"""The one Trainer on the tiny Qwen3 (real Qwen3 tokenizer): every family trains and its loss falls, kill -9 and
resume continues with bit-identical losses (and weight average), 2-rank ZeRO-2 equals 1-rank with the same global
batch, a non-finite loss stops the run with the last good checkpoint intact, train.ema_decay's final draft is the
average of the steps' weights."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_cli, tiny_overrides
from core import stage
from core.dist import Dist
from core.io import write_checksums
from core.recipe import load_recipe
from modeling.registry import TARGET_WEIGHTS_KEY
from modeling.target import load_target, load_tokenizer, weights_fingerprint
from pipeline import training_records
from train.algorithms import get_algorithm
from train.trainer import TrainJob, build_module

TRAIN = {
    "draft.num_layers": 1, "draft.num_anchors": 6, "draft.block_size": 3, "draft.markov_rank": 8,
    "draft.draft_vocab_size": 512, "draft.ttt_length": 3,
    "train.global_batch_size": 4, "train.micro_batch_size": 1, "train.max_steps": 6, "train.save_every": 2,
    "train.log_every": 1, "train.lr": 3.0e-3, "train.warmup_ratio": 0.0, "train.zero_stage": 0,
}


@pytest.fixture(scope="module")
def prepared(tiny_qwen3, prompt_file, tmp_path_factory):
    """regenerate + cache once per layer set; tests copy the run folder and train into the copy."""
    runs = {}
    for recipe in ("dspark_qwen3_8b", "eagle3_qwen3_8b"):
        out = tmp_path_factory.mktemp(recipe)
        done = run_cli(["--recipe", recipe, "--stages", "regenerate,cache", "--out", str(out)]
                       + tiny_overrides(tiny_qwen3, prompt_file))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[recipe.split("_")[0]] = out
    return runs


def train_args(recipe, tiny_qwen3, prompt_file, out, stages="train", **extra):
    sets = dict(TRAIN)
    if not recipe.startswith("dspark"):
        del sets["draft.markov_rank"]  # DFlash and Eagle3 have no Markov head
    sets.update(extra)
    return ["--recipe", recipe, "--stages", stages, "--out", str(out)] + tiny_overrides(tiny_qwen3, prompt_file, **sets)


def copy_run(prepared, family, dest):
    shutil.copytree(prepared["eagle3" if family == "eagle3" else "dspark"], dest)
    return dest


def checkpoint_names(out):
    return sorted(p.name for p in (out / "train" / "checkpoints").glob("step-*"))


def metrics(out):
    return [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", ["dspark", "dflash", "dflash2", "eagle3"])
def test_each_family_trains_and_its_loss_falls(family, prepared, tiny_qwen3, prompt_file, tmp_path):
    out = copy_run(prepared, family, tmp_path / "run")
    # options ride along: DSpark's softmaxes over 512 tokens, DFlash's labels the target's, noise on Eagle3's features
    options = {"dspark": {"loss.vocab_size": 512}, "dflash": {"loss.ce_labels": "target"},
               "dflash2": {"loss.vocab_size": 512, "draft.selector_rank": 8, "draft.selector_top_k": 4},
               "eagle3": {"train.feature_noise": 0.1}}[family]
    done = run_cli(train_args(f"{family}_qwen3_8b", tiny_qwen3, prompt_file, out, stages="train,eval,export",
                              **options,
                              **{"train.max_steps": 10, "train.save_every": 5, "train.keep_checkpoints": 0,
                                 "eval.dataset": str(prompt_file), "eval.allow_training_prompts": "true",
                                 "eval.num_samples": 2, "eval.max_new_tokens": 8, "train.wandb_project": "ds-test"}))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert checkpoint_names(out) == ["step-0000005", "step-0000010"]
    assert rows[-1]["loss"] < rows[0]["loss"]
    for row in rows:
        assert len(row["accept_rate"]) == 3 and 1.0 <= row["tau"] <= 4.0
        assert row["grad_norm"] > 0 and row["lr"] > 0
    if family == "dspark":
        assert {"ce", "l1", "conf_bce"} <= set(rows[0])
    if family == "dflash2":  # the selector's own CE and teacher-forced accuracy, one per position
        assert rows[0]["selector_ce"] > 0 and len(rows[0]["selector_acc"]) == 3
    assert "training tau estimate" in done.stdout
    # the final draft is a plain folder of config + safetensors, named as the serving engines name things
    final = out / "train" / "final"
    config = json.loads((final / "config.json").read_text())
    weights = load_file(str(final / "model.safetensors"))
    # it names the weights of the target its hidden states came from (eval refuses another target of that shape)
    manifest = json.loads((out / "cache" / "manifest.json").read_text())
    assert config[TARGET_WEIGHTS_KEY] == manifest["meta"]["target_weights"] == \
        weights_fingerprint(load_target(str(tiny_qwen3)))
    if family == "eagle3":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert weights["lm_head.weight"].shape[0] == 512 and "d2t" in weights and "midlayer.self_attn.q_proj.weight" in weights
    else:
        assert config["architectures"] == ["Qwen3DSparkModel"]
        assert config["markov_rank"] == (8 if family == "dspark" else 0)
        assert any(k.startswith("markov_head.") for k in weights) == (family == "dspark")
        assert any(k.startswith("candidate_selector.") for k in weights) == (family == "dflash2")
    if family == "dflash2":  # successor rows outside the loss vocabulary: zero (no transition), never candidates
        assert 0 < int((weights["candidate_selector.successor_codebook"].abs().sum(1) > 0).sum()) <= 512
    if family == "dspark":  # Markov rows outside the loss vocabulary: zero (no bias) and never trained
        trained_rows = weights["markov_head.markov_w2.weight"].abs().sum(1) > 0
        assert 0 < int(trained_rows.sum()) <= 512
        # and it drafts among those 512 tokens (token_map.pt), which the eval stage reports
        token_map = torch.load(final / "token_map.pt", weights_only=True)
        assert len(token_map) == 512 and bool(trained_rows[token_map].all())
    elif family != "dflash2":
        assert not (final / "token_map.pt").exists()
    # tensorboard and offline wandb both got the run
    assert list((out / "train" / "tensorboard").glob("events.*"))
    assert list((out / "train" / "wandb").glob("offline-run-*/run-*.wandb"))
    # the eval stage ran the trained drafter losslessly and printed tau
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["exact_match"] == 1.0 and report["block_size"] == 3
    # held against the prompts it trained on, by what they say: the training file's, kept (an overfit check)
    trained = report["training_prompts"]
    assert trained["kept"] and trained["of"] == report["num_samples"] == 2 and trained["found"] >= 1, trained
    # the headline as the engines serve it, over the whole vocabulary; a token map's figure beside it
    assert report["draft_vocab_size"] is None
    assert report.get("token_map", {}).get("draft_vocab_size") == (512 if family in ("dspark", "dflash2") else None)
    assert family not in ("dspark", "dflash2") or report["token_map"]["exact_match"] == 1.0
    eval_done = json.loads((out / "eval" / "DONE.json").read_text())
    assert eval_done["accept_len"] == report["accept_len"]
    recorded = set(eval_done["outputs"])  # the report, and what export ships, recorded by size and sha256
    assert "report.json" in recorded and ("sts.json" in recorded) == (out / "eval" / "sts.json").is_file()
    assert "[eval]" in done.stdout and f"tau {report['accept_len']:.3f}" in done.stdout
    # and the export stage wrote the SGLang checkpoint of the family's serving algorithm
    exported = json.loads((out / "export" / "sglang" / "config.json").read_text())
    expected = {"dspark": "Qwen3DSparkModel", "dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel",
                "eagle3": "LlamaForCausalLMEagle3"}
    assert exported["architectures"] == [expected[family]]
    algorithm = {"dspark": "DSPARK", "dflash": "DFLASH", "dflash2": "DFLASH", "eagle3": "EAGLE3"}[family]
    assert (f"--speculative-algorithm {algorithm} --speculative-draft-model-path {out / 'export' / 'sglang'}"
            in done.stdout)  # the exact serving command
    assert f"tau = {report['accept_len']:.3f}" in done.stdout


def resume_run(zero_stage: int) -> dict:
    # 0.3: the early-step cap (1 + t) / (10 + t) decides steps 1-3, the decay itself steps 4-6
    return {"train.zero_stage": zero_stage, "train.dropout": 0.1, "train.ema_decay": 0.3}


@pytest.fixture(scope="module")
def uninterrupted(prepared, tiny_qwen3, prompt_file, tmp_path_factory):
    """clean(zero_stage): the run folder of the 6-step dspark run never killed, made once per ZeRO stage (with
    train.dropout: a resumed run must draw the masks the first run drew; with train.ema_decay: it must continue the
    average the first run kept)."""
    runs = {}

    def clean(zero_stage: int):
        if zero_stage not in runs:
            out = copy_run(prepared, "dspark", tmp_path_factory.mktemp(f"clean-zero{zero_stage}") / "run")
            done = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out, **resume_run(zero_stage)))
            assert done.returncode == 0, done.stderr[-3000:]
            runs[zero_stage] = out
        return runs[zero_stage]

    return clean


def strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_s", "hidden_s")} for r in rows]


def assert_same_run(a, b):
    """Every logged loss, norm and rate, and the final weights, exactly equal."""
    assert strip_timing(metrics(a)) == strip_timing(metrics(b))
    wa = load_file(str(a / "train" / "final" / "model.safetensors"))
    wb = load_file(str(b / "train" / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# Under ZeRO-0 the kills at train:3 and mid-save (train-save:4) are test_drills.py's, in one run folder.
@pytest.mark.parametrize("zero_stage,kill_at", [(2, "train:3")])
def test_kill_and_resume_continues_bit_exact(zero_stage, kill_at, prepared, uninterrupted, tiny_qwen3, prompt_file,
                                             tmp_path, drill):
    drill("kill", f"kill -9 at {kill_at}, ZeRO-{zero_stage}")
    clean, crashed = uninterrupted(zero_stage), copy_run(prepared, "dspark", tmp_path / "crash")
    extra = resume_run(zero_stage)
    # keep_checkpoints is not a result-changing setting: the resumed run may use another value (the default 2)
    killed = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, crashed, **extra,
                                **{"train.keep_checkpoints": 1}),
                     {"DRAFTSMITH_KILL_AT": kill_at})
    assert killed.returncode == -9
    assert (crashed / "train" / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    half = crashed / "train" / "checkpoints" / "step-0000004"
    assert half.is_dir() == (kill_at == "train-save:4") and not (half / "trainer_state.pt").exists()
    resumed = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, crashed, **extra))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert_same_run(crashed, clean)  # train/final: the weight average
    last = [run / "train" / "checkpoints" / "step-0000006" for run in (crashed, clean)]
    for name in ("ema.pt", "draft/model.safetensors"):  # the average, and the last step's own weights
        assert (last[0] / name).read_bytes() == (last[1] / name).read_bytes(), name
    # saves at 2 (killed run), 4 and 6: only the newest two (train.keep_checkpoints default) stay on disk
    assert checkpoint_names(crashed) == ["step-0000004", "step-0000006"]


def test_one_rank_of_two_killed_mid_training_then_the_rerun_continues_bit_exact(prepared, tiny_qwen3, prompt_file,
                                                                                 tmp_path, drill):
    drill("kill", "kill -9 of rank 1 of 2 at train:3, ZeRO-2")
    clean, crashed = copy_run(prepared, "dspark", tmp_path / "clean"), copy_run(prepared, "dspark", tmp_path / "crash")
    extra = {"train.zero_stage": 2, "train.ema_decay": 0.3}  # each rank averages; rank 0's is saved and resumed
    first = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, clean, **extra), torchrun=2)
    assert first.returncode == 0, first.stderr[-3000:]
    killed = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, crashed, **extra),
                     {"DRAFTSMITH_KILL_AT": "train:3", "DRAFTSMITH_KILL_RANK": "1"}, torchrun=2)
    assert killed.returncode != 0 and not (crashed / "train" / "DONE.json").exists()
    assert (crashed / "train" / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    resumed = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, crashed, **extra), torchrun=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert_same_run(crashed, clean)


def test_two_rank_zero2_matches_one_rank(prepared, tiny_qwen3, prompt_file, tmp_path):
    one, two = copy_run(prepared, "dspark", tmp_path / "one"), copy_run(prepared, "dspark", tmp_path / "two")
    # Adam divides by sqrt(v)+eps: at eps=1e-8 it turns fp32 reduction-order noise in near-zero gradients (rows of
    # unseen tokens) into lr-sized steps of either sign. A larger eps keeps the comparison about the gradients.
    # train.ema_decay: rank 0 averages the full weights ZeRO-2 all-gathers after each step, not its partition only
    extra = {"train.zero_stage": 2, "train.max_steps": 3, "train.save_every": 3, "train.adam_eps": 1.0e-4,
             "train.ema_decay": 0.2}
    first = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, one, **extra))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, two, **extra), torchrun=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "2 rank(s) × 1 × 2 accumulation" in second.stdout
    a = load_file(str(one / "train" / "final" / "model.safetensors"))
    b = load_file(str(two / "train" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    for x, y in zip(metrics(one), metrics(two)):
        assert abs(x["loss"] - y["loss"]) < 1e-4 * max(1.0, abs(x["loss"]))


def test_non_finite_loss_stops_with_last_good_checkpoint(prepared, tiny_qwen3, prompt_file, tmp_path):
    out = copy_run(prepared, "dspark", tmp_path / "run")
    done = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out,
                              **{"train.lr": 1.0e30, "train.save_every": 1, "train.max_grad_norm": 1.0e30}))
    assert done.returncode != 0
    assert "non-finite" in done.stderr
    latest = (out / "train" / "checkpoints" / "latest").read_text().strip()
    state = torch.load(out / "train" / "checkpoints" / latest / "trainer_state.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (out / "train" / "DONE.json").exists()


def test_eval_and_export_stages_run_again_when_their_inputs_change(prepared, tiny_qwen3, prompt_file, tmp_path,
                                                                    capsys):
    from pipeline import main

    out = copy_run(prepared, "dspark", tmp_path / "run")
    evals = {"eval.dataset": str(prompt_file), "eval.allow_training_prompts": "true", "eval.num_samples": 2,
             "eval.max_new_tokens": 6, "eval.ngram_baseline": False}

    def run(**extra):
        assert main(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out, stages="train,eval,export",
                               **{"train.max_steps": 2, **evals, **extra})) == 0
        return capsys.readouterr().out, json.loads((out / "eval" / "report.json").read_text())

    printed, first = run()
    assert first["max_new_tokens"] == 6 and "running it again" not in printed
    printed, again = run()  # nothing changed: both stages skip
    assert "eval is complete; skipping" in printed.replace(str(out / "eval"), "eval")
    assert "export is complete; skipping" in printed.replace(str(out / "export"), "export")
    printed, changed = run(**{"eval.max_new_tokens": 9})  # a changed eval.* key: never the old report
    assert "eval.max_new_tokens: 6 in the folder, 9 now" in printed and changed["max_new_tokens"] == 9
    assert json.loads((out / "eval" / "settings.json").read_text())["eval"]["max_new_tokens"] == 9

    # a retrained draft (other weights in train/final) is evaluated and exported again
    final = out / "train" / "final" / "model.safetensors"
    weights = load_file(str(final))
    weights["fc.weight"] = weights["fc.weight"] * 0.5
    save_file(weights, str(final))
    write_checksums(final.parent)  # as training records a folder it publishes (else refused as damaged)
    stage.mark_done(out / "train", stage.read_done(out / "train"), outputs=["final/checksums.json"])
    printed, _ = run(**{"eval.max_new_tokens": 9})
    assert "draft_sha256" in printed and "eval is complete" not in printed.replace(str(out / "eval"), "eval")
    exported = load_file(str(out / "export" / "sglang" / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], weights["fc.weight"])


def test_kill_after_the_final_save_resumes_to_done(prepared, tiny_qwen3, prompt_file, tmp_path, drill):
    drill("kill", "kill -9 after the final save")
    out = copy_run(prepared, "dspark", tmp_path / "run")
    killed = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out), {"DRAFTSMITH_KILL_AT": "train:6"})
    assert killed.returncode == -9
    assert (out / "train" / "checkpoints" / "latest").read_text().strip() == "step-0000006"
    resumed = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = json.loads((out / "train" / "DONE.json").read_text())
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    no_step = lambda row: {k: v for k, v in row.items() if k != "step"}  # noqa: E731
    assert done["last"] == no_step(rows[-1]) and done["first"] == no_step(rows[0])  # the real last step's metrics
    # train.ema_decay 0 (the default): train/final is the last step's weights, byte for byte, and nothing averages
    last = out / "train" / "checkpoints" / "step-0000006"
    assert (out / "train" / "final" / "model.safetensors").read_bytes() == \
        (last / "draft" / "model.safetensors").read_bytes()
    assert not list((out / "train" / "checkpoints").glob("*/ema.pt"))
    assert "ema_decay" not in json.loads((out / "train" / "settings.json").read_text())["train"]


def start_weights(args, out, tiny_qwen3):
    """The trainable drafter weights the train stage of `args` starts from, built here as it builds them."""
    sets = [args[i + 1] for i, arg in enumerate(args) if arg == "--set"]
    recipe = load_recipe(args[args.index("--recipe") + 1], sets)
    target = load_target(recipe.target.name_or_path, torch.device("cpu"), recipe.target.dtype)
    records = training_records(recipe, out, load_tokenizer(recipe.target.name_or_path), target)
    job = TrainJob(recipe, records, out / "train", Dist(), lambda: target)
    module = build_module(job, get_algorithm(recipe.family))
    return {name: p.detach().clone() for name, p in module.draft.named_parameters() if p.requires_grad}


def test_final_draft_is_the_average_of_the_steps_weights(prepared, tiny_qwen3, prompt_file, tmp_path):
    out = copy_run(prepared, "dspark", tmp_path / "run")
    decay = 0.2  # steps 1 and 2 take the early-step cap (0.1, 2/11), step 3 the decay itself
    args = train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out,
                      **{"train.max_steps": 3, "train.save_every": 1, "train.keep_checkpoints": 0,
                         "train.ema_decay": decay})
    done = run_cli(args)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpts = out / "train" / "checkpoints"
    steps = [load_file(str(ckpts / f"step-000000{s}" / "draft" / "model.safetensors")) for s in (1, 2, 3)]
    average = start_weights(args, out, tiny_qwen3)
    assert average and set(average) < set(steps[0])  # the frozen embedding and lm_head copies are not averaged
    for t, weights in enumerate(steps):  # recomputed here from each step's weights
        d = min(decay, (1 + t) / (10 + t))
        average = {name: value * d + weights[name] * (1 - d) for name, value in average.items()}
    final = load_file(str(out / "train" / "final" / "model.safetensors"))
    assert final.keys() == steps[-1].keys()
    for name, value in final.items():
        if name in average:
            torch.testing.assert_close(value, average[name], rtol=1e-6, atol=1e-7, msg=name)
        else:
            assert torch.equal(value, steps[-1][name]), name
    # not the last step's weights: those stay in the last checkpoint
    assert max(float((final[n] - steps[-1][n]).abs().max()) for n in average) > 1e-4
    assert json.loads((out / "train" / "settings.json").read_text())["train"]["ema_decay"] == decay
    # the folder is pinned to its decay: a rerun with another is refused, naming the key
    again = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out,
                               **{"train.max_steps": 3, "train.save_every": 1, "train.ema_decay": 0.5}))
    assert again.returncode != 0 and "train.ema_decay: 0.2 in the folder, 0.5 now" in again.stdout + again.stderr


