"""eval.py end to end on the tiny Qwen3: report files and keys, exact match at T=0, the DSpark calibration and
scheduler outputs in SGLang's file formats, and the n-gram baseline in the same harness."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, eval_cli
from data.sources.prompts import eval_prompts, is_holdout
from eval.report import ReportSettings, acceptance_metrics, round_timing
from eval.run import EvalDecode, ScheduleError, run_eval, run_eval_stage
from eval.spec_decode import RoundRecord
from export.serving import save_sts
from modeling.target import load_target
from train.algorithms import BlockAlgorithm
from core.recipe import load_recipe


def test_acceptance_metrics_by_hand():
    rounds = [RoundRecord(3, 3, [True] * 3, None, 4, 0, 0, 0), RoundRecord(3, 1, [True, False, False], None, 2, 0, 0, 0),
              RoundRecord(2, 0, [False, False], None, 1, 0, 0, 0)]
    m = acceptance_metrics(rounds, 3)
    assert m["accept_len"] == pytest.approx((4 + 2 + 1) / 3)
    assert m["accept_rate_at_k"] == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    # conditional: position 2 reached by rounds with >= 1 accepted (2 of them), survived by 1
    assert m["cond_accept_rate_at_k"] == pytest.approx([2 / 3, 1 / 2, 1 / 1])
    assert m["verify_rate"] == pytest.approx(7 / (4 + 4 + 3))


def test_round_timing_by_hand():
    # 2 rounds: draft 10 ms, verify 40 ms, 10 ms rest each; 6 tokens out (tau 3); a plain step costs 20 ms.
    rounds = [RoundRecord(3, 2, [True, True, False], None, 3, 0, 0.010, 0.040)] * 2
    t = round_timing(rounds, 3, spec_decode_s=0.120, spec_tokens=6, target_decode_s=0.200, target_tokens=10)
    assert t["draft_ms"] == pytest.approx(10) and t["verify_ms"] == pytest.approx(40)
    assert t["other_ms"] == pytest.approx(10) and t["round_ms"] == pytest.approx(60)
    assert t["target_step_ms"] == pytest.approx(20) and t["verify_vs_step"] == pytest.approx(2)
    assert t["limit_speedup"] == pytest.approx(4 * 20 / 40)  # gamma + 1 tokens per verify
    assert t["tau_limit_speedup"] == pytest.approx(3 * 20 / 40)
    assert t["decode_speedup"] == pytest.approx(6 / 0.120 * 0.020)  # = 1.0
    assert t["loop_efficiency"] == pytest.approx(40 / 60)  # the share of a round spent verifying
    assert round_timing([], 3, spec_decode_s=0, spec_tokens=0, target_decode_s=0, target_tokens=0) == {}


@pytest.fixture(scope="module")
def random_dspark(tiny_qwen3, tmp_path_factory):
    recipe = load_recipe("dspark_qwen3_8b", [f"target.name_or_path={tiny_qwen3}", "draft.num_layers=1",
                                             "draft.markov_rank=8", "draft.block_size=3"])
    torch.manual_seed(0)
    module = BlockAlgorithm.build(recipe, load_target(str(tiny_qwen3)), None)
    path = tmp_path_factory.mktemp("draft") / "final"
    module.save_draft(path)
    return path


def test_eval_writes_the_report_and_is_exact(random_dspark, tiny_qwen3, prompt_file, tmp_path):
    report = run_eval(EvalDecode(draft=str(random_dspark), target_name=str(tiny_qwen3), dataset=str(prompt_file),
                                 num_samples=3, temperature=0.0, block_size=None, max_new_tokens=10),
                      ReportSettings(out_dir=tmp_path))
    for key in ("accept_len", "accept_rate_at_k", "cond_accept_rate_at_k", "exact_match", "spec_tokens_per_s",
                "target_tokens_per_s", "speedup", "temperature", "num_samples", "block_size"):
        assert key in report
    assert report["exact_match"] == 1.0 and report["num_samples"] == 3 and report["block_size"] == 3
    assert 1.0 <= report["accept_len"] <= 4.0 and len(report["accept_rate_at_k"]) == 3
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["accept_len"] == report["accept_len"]
    assert "| tau |" in (tmp_path / "report.md").read_text()
    timing = report["timing"]
    assert timing["draft_ms"] > 0 and timing["verify_ms"] > 0 and timing["target_step_ms"] > 0
    assert timing["draft_ms"] + timing["verify_ms"] + timing["other_ms"] == pytest.approx(timing["round_ms"])
    assert 0 < timing["loop_efficiency"] <= 1 and timing["verify_tokens"] == 4
    assert "Where a round's time goes" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "accept_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # DSpark's confidence head: STS and SPS files in the schema SGLang reads, nothing else in them
    sts = json.loads((tmp_path / "sts.json").read_text())
    assert set(sts) <= {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
    assert len(sts["temperatures"]) == 3 and all(t > 0 for t in sts["temperatures"])
    sps = json.loads((tmp_path / "sps_table.json").read_text())
    assert set(sps) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    assert {row["policy"] for row in report["scheduler"]["rows"]} >= {"scheduler", "fixed_gamma=3"}


def test_eval_too_short_to_calibrate_still_writes_its_report(random_dspark, tiny_qwen3, prompt_file, tmp_path,
                                                             capsys, drill):
    """One prompt, one token: one round, too few to fit STS on some rounds and measure it on others. The report is
    written anyway (it used to end in "need at least 2 rounds to split" after decoding, with nothing written), saying
    what was skipped and why."""
    drill("bad-input", "eval.py --num-samples 1 --max-new-tokens 1 of a DSpark draft with a confidence head")
    out = tmp_path / "eval"
    assert eval_cli().main(["--draft", str(random_dspark), "--target", str(tiny_qwen3), "--dataset", str(prompt_file),
                            "--num-samples", "1", "--max-new-tokens", "1", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["num_rounds"] == 1 and report["exact_match"] == 1.0
    assert "calibration" not in report and "scheduler" not in report and not (out / "sts.json").exists()
    assert "1 round, too few" in report["calibration_skipped"] and "--max-new-tokens" in report["calibration_skipped"]
    assert "## Calibration and scheduler simulation: skipped" in (out / "report.md").read_text()
    assert "calibration and scheduler simulation skipped" in capsys.readouterr().out


def test_the_eval_stage_draws_the_held_out_split_training_left_out(random_dspark, tiny_qwen3, tmp_path):
    """The eval stage's prompts of a training source are its held-out split under the recipe's own
    data.holdout_fraction and seed (it used to draw the default 5% whatever the recipe said)."""
    recipe = load_recipe("dspark_qwen3_8b", [f"target.name_or_path={tiny_qwen3}", "data.sources=[{name: wordmath}]",
                                             "data.holdout_fraction=0.01", "eval.dataset=wordmath",
                                             "eval.num_samples=2", "eval.max_new_tokens=2",
                                             "eval.ngram_baseline=false"])
    report = run_eval_stage(recipe, random_dspark, tmp_path / "eval", load_target(str(tiny_qwen3)))
    expected = [p.id for p in eval_prompts("wordmath", 2, recipe.seed, holdout_fraction=0.01)]
    assert [s["id"] for s in report["samples"]] == expected
    assert all(is_holdout(i, 0.01, recipe.seed) for i in expected)


def test_confidence_schedule_run_is_exact_and_reports_what_it_verified(random_dspark, tiny_qwen3, prompt_file,
                                                                       tmp_path):
    """`--schedule confidence` end to end: the loop's verify costs profiled to gamma + 1 tokens, the STS read, every
    output equal to the target's greedy one, and the report saying how many drafts a round were verified; the
    calibration is not fitted on a scheduled run (it saw only the drafts it admitted)."""
    sts = tmp_path / "sts.json"
    save_sts(sts, [1.0, 2.0, 4.0])
    report = run_eval(EvalDecode(draft=str(random_dspark), target_name=str(tiny_qwen3), dataset=str(prompt_file),
                                 num_samples=3, temperature=0.0, block_size=None, max_new_tokens=10,
                                 verify_schedule="confidence", sts_path=str(sts)),
                      ReportSettings(out_dir=tmp_path / "run"))
    assert report["exact_match"] == 1.0 and "calibration" not in report
    schedule = report["verify_schedule"]
    assert schedule["policy"] == "confidence" and list(schedule["temperatures"]) == [1.0, 2.0, 4.0]
    sps = json.loads((tmp_path / "run" / "loop_sps_table.json").read_text())
    assert sps["sample_batch_tokens"] == [1, 2, 3, 4] and min(sps["sample_steps_per_sec"]) > 0
    assert 0.0 <= report["mean_verified_drafts"] <= 3.0
    assert "Verify schedule `confidence`" in (tmp_path / "run" / "report.md").read_text()
    save_sts(sts, [1.0, 2.0])  # calibrated for 2 draft positions, asked to schedule 3
    with pytest.raises(ScheduleError, match="2 temperatures for 3 draft positions"):
        run_eval(EvalDecode(draft=str(random_dspark), target_name=str(tiny_qwen3), dataset=str(prompt_file),
                            num_samples=1, temperature=0.0, block_size=None, max_new_tokens=4,
                            verify_schedule="confidence", sts_path=str(sts)),
                 ReportSettings(out_dir=tmp_path / "short"))


def test_ngram_baseline_from_the_command_line(tiny_qwen3, prompt_file, tmp_path):
    done = subprocess.run([sys.executable, "eval.py", "--draft", "ngram", "--target", str(tiny_qwen3), "--dataset",
                           str(prompt_file), "--num-samples", "2", "--max-new-tokens", "8", "--block-size", "3",
                           "--temperature", "0.8", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[eval]" in done.stdout and "tau" in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["exact_match"] is None and report["temperature"] == 0.8 and report["accept_len"] >= 1.0
    assert "calibration" not in report  # no confidence head, no calibration


def test_draft_lm_baseline_with_the_target_as_draft_accepts_everything(tiny_qwen3, prompt_file, tmp_path):
    """`lm:<model>` loads a causal LM as drafter in the target's dtype; the target drafting for itself is always right."""
    report = run_eval(EvalDecode(draft=f"lm:{tiny_qwen3}", target_name=str(tiny_qwen3), dataset=str(prompt_file),
                                 num_samples=2, temperature=0.0, block_size=3, max_new_tokens=8),
                      ReportSettings(out_dir=tmp_path, scheduler=False))
    assert report["exact_match"] == 1.0
    assert report["accept_rate_at_k"][0] == 1.0 and report["accept_len"] > 3.0  # only a budget-cut last round < 4


def test_hf_generate_baseline_and_shared_baselines(tiny_qwen3, prompt_file, tmp_path):
    """--hf-generate times plain HF generate on the same prompts; its greedy output is the target loop's. A shared
    baselines dict decodes each prompt's HF generate once for several drafters (the plain loop is decoded beside
    every eval's drafters instead: eval/arms.py)."""
    baselines = {}
    first = run_eval(EvalDecode(draft="ngram", target_name=str(tiny_qwen3), dataset=str(prompt_file), num_samples=2,
                                temperature=0.0, block_size=3, max_new_tokens=8),
                     ReportSettings(out_dir=tmp_path / "a", scheduler=False, hf_generate=True), baselines=baselines)
    assert first["hf_generate_match"] == 1.0 and first["hf_generate_tokens_per_s"] > 0
    assert first["speedup_vs_generate"] == pytest.approx(first["spec_tokens_per_s"] / first["hf_generate_tokens_per_s"])
    assert len(baselines) == 2 and "HF `generate`" in (tmp_path / "a" / "report.md").read_text()
    kept = dict(baselines)
    second = run_eval(EvalDecode(draft=f"lm:{tiny_qwen3}", target_name=str(tiny_qwen3), dataset=str(prompt_file),
                                 num_samples=2, temperature=0.0, block_size=3, max_new_tokens=8),
                      ReportSettings(out_dir=tmp_path / "b", scheduler=False, hf_generate=True), baselines=baselines)
    assert baselines == kept  # reused, not decoded again
    assert second["hf_generate_tokens_per_s"] == first["hf_generate_tokens_per_s"]


def test_ngram_side_by_side_in_the_same_report(tiny_qwen3, prompt_file, tmp_path):
    """ngram_baseline (the eval stage's default): the n-gram drafter decodes the same prompts with the same target, and
    the report gives the draft's tau as a ratio of its."""
    report = run_eval(EvalDecode(draft=f"lm:{tiny_qwen3}", target_name=str(tiny_qwen3), dataset=str(prompt_file),
                                 num_samples=2, temperature=0.0, block_size=3, max_new_tokens=8),
                      ReportSettings(out_dir=tmp_path, scheduler=False, ngram_baseline=True))
    ngram = json.loads((tmp_path / "ngram" / "report.json").read_text())
    assert report["ngram_baseline"]["accept_len"] == ngram["accept_len"] and ngram["draft"] == "ngram"
    assert ngram["target_tokens_per_s"] == report["target_tokens_per_s"]  # the same plain decodes, beside both
    assert report["tau_vs_ngram"] == pytest.approx(report["accept_len"] / ngram["accept_len"])
    assert report["tau_vs_ngram"] > 1.0  # the target drafting for itself accepts more than n-gram lookup
    assert "n-gram drafter on the same prompts" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_records_keep_prompt_id_and_source_and_report_per_source_ratios(tiny_qwen3, tmp_path, temperature):
    """Every eval record keeps its prompt id and source (quality.py's held-out file: benchmark ids inside a prompt
    file), with the tokens and rounds behind its tau; with the n-gram baseline, report.json and report.md hold tau /
    n-gram with a paired interval per source, copy-heavy / rest and overall, at the eval's temperature."""
    prompts = tmp_path / "eval_prompts.jsonl"
    rows = [{"id": "mtbench:81", "turns": ["Write a travel blog post about Hawaii."]},
            {"id": "humaneval:HumanEval/0", "turns": ["def add(a, b):\n    return a + b\n\nadd(1, 2)"]},
            {"id": "mtbench:82", "turns": ["Repeat: one two three one two three one two three"]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_eval(EvalDecode(draft=f"lm:{tiny_qwen3}", target_name=str(tiny_qwen3), dataset=str(prompts),
                                 num_samples=0, temperature=temperature, block_size=3, max_new_tokens=8),
                      ReportSettings(out_dir=tmp_path / "run", scheduler=False, ngram_baseline=True))
    samples = report["samples"]
    assert [(s["id"], s["source"]) for s in samples] == [("eval_prompts:mtbench:81", "mtbench"),
                                                         ("eval_prompts:humaneval:HumanEval/0", "humaneval"),
                                                         ("eval_prompts:mtbench:82", "mtbench")]
    assert all(s["round_tokens"] / s["rounds"] == pytest.approx(s["accept_len"]) for s in samples)
    on_disk = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [s["id"] for s in on_disk["samples"]] == [s["id"] for s in samples]
    vs = on_disk["vs_ngram"]
    assert vs["temperature"] == temperature
    rows = {r["group"]: r for r in vs["rows"]}
    assert {"humaneval", "mtbench", "all"} <= set(rows) and rows["mtbench"]["records"] == 2
    assert rows["all"]["tau"] == pytest.approx(report["accept_len"])
    assert rows["all"]["ratio"] == pytest.approx(report["tau_vs_ngram"])
    assert rows["all"]["low"] <= rows["all"]["ratio"] <= rows["all"]["high"]
    assert rows["all"]["ngram_tau"] == pytest.approx(report["ngram_baseline"]["accept_len"])
    text = (tmp_path / "run" / "report.md").read_text()
    assert f"## Against the n-gram drafter per source (T={temperature})" in text
    assert "| mtbench | 2 |" in text and "| all | 3 |" in text
