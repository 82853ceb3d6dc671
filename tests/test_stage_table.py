"""The pipeline's stage table: one row a stage (folder, outputs, skip, job builder, runner), walked in order by
run_stages; each job object is built from the recipe; `draftsmith train` runs all six rows end to end on a tiny
target, as `train/main.py` does."""

from __future__ import annotations

import dataclasses
import json

from conftest import tiny_overrides
from core import stage
from core.dist import Dist
from core.recipe import load_recipe
from data.states.capture import CacheJob
from data.regen.regenerate import RegenJob
from draftsmith import main as draftsmith
from export.convert import ExportJob
from export.serving import STS_FILENAME
from pipeline import STAGE_DIRS, STAGE_TABLE, STAGES, EvalStageJob, RunState

TINY = {"draft.num_layers": 1, "draft.num_anchors": 6, "draft.block_size": 3, "draft.markov_rank": 8,
        "train.global_batch_size": 2, "train.micro_batch_size": 1, "train.max_steps": 2, "train.save_every": 2,
        "train.warmup_ratio": 0.0, "regen.temperature": 0.0, "opd.rounds": 1, "opd.rollout_records": 2,
        "opd.steps_per_round": 1, "eval.num_samples": 2, "eval.max_new_tokens": 6, "eval.ngram_baseline": False,
        "eval.allow_training_prompts": True}


def test_the_table_is_the_stages_in_order():
    assert STAGES == tuple(row.name for row in STAGE_TABLE) == ("regenerate", "cache", "train", "opd", "eval",
                                                                "export")
    assert tuple(STAGE_DIRS.values()) == stage.STAGE_DIRS  # core/stage.py sweeps these folders
    assert all(row.outputs and callable(row.job) and callable(row.run) for row in STAGE_TABLE)


def test_each_job_is_built_from_the_recipe(tmp_path):
    rows = {row.name: row for row in STAGE_TABLE}
    recipe = load_recipe("dspark_smollm2_135m")
    run = RunState(recipe, tmp_path, Dist(), tokenizer="tok", get_target=lambda: "target",
                   get_target_parts=lambda: "what the drafter reads of it")
    assert rows["regenerate"].job(run) == RegenJob(recipe, tmp_path / "regen", run.dist, run.get_target, "tok")
    assert rows["cache"].job(run) == CacheJob(recipe, tmp_path / "regen", tmp_path / "cache", run.dist,
                                              run.get_target, "tok")  # cache.backend hf runs the target
    engine = dataclasses.replace(run, recipe=load_recipe("dspark_smollm2_135m", ["cache.backend=engine"]))
    assert rows["cache"].job(engine).get_target is run.get_target_parts  # the engine runs it: the parts
    assert rows["eval"].job(run) == EvalStageJob(tmp_path / "train" / "final", tmp_path / "eval")
    assert rows["export"].job(run) == ExportJob(tmp_path / "train" / "final", "sglang", tmp_path / "export" / "sglang",
                                                verifier="smollm2-135m-instruct")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / STS_FILENAME).write_text("{}")  # an eval's calibration ships with the export
    assert rows["export"].job(run).sts_path == tmp_path / "eval" / STS_FILENAME
    assert [row.name for row in STAGE_TABLE if row.skip(recipe)] == ["opd"]  # opd.rounds 0
    online = load_recipe("dspark_smollm2_135m", ["train.hidden_states=online", "opd.rounds=1"])
    assert [row.name for row in STAGE_TABLE if row.skip(online)] == ["cache"]
    assert rows["eval"].job(RunState(online, tmp_path, Dist(), None, None, None)).draft_dir == tmp_path / "opd" / "final"


def test_draftsmith_train_walks_every_stage(tiny_qwen3, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--recipe", "dspark_qwen3_8b", "--out", str(out), *tiny_overrides(tiny_qwen3, prompt_file,
                                                                                           **TINY)]
    assert draftsmith(args) == 0
    printed = capsys.readouterr().out
    timed = [line.split("]")[0][1:] for line in printed.splitlines() if "] stage time" in line]
    assert timed == list(STAGES)
    assert all(stage.is_done(out / folder) for folder in STAGE_DIRS.values())
    assert json.loads((out / "opd" / "DONE.json").read_text())["rounds"]
    assert (out / "export" / "sglang" / "model.safetensors").is_file() and "accept length tau =" in printed
