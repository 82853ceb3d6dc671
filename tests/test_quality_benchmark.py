"""benchmarks/quality.py and its shared helpers (benchmarks/harness.py): training arms (--arm) parsed into recipe
overrides, refused when malformed, and compared with the family's recipe run checkpoint by checkpoint; the final
drafts against prompt lookup per source with the oracle chooser beside each ratio; which prompt each held-out cache
record is."""

import json
import subprocess
import sys

import pytest
import yaml

from benchmarks import data_scaling, harness, quality
from conftest import ROOT
from eval.compare import paired_ratio


def test_arm_becomes_recipe_overrides():
    assert harness.parse_arm("decay1.5-layers3:loss.loss_decay_gamma=1.5,draft.num_layers=3") == (
        "decay1.5-layers3", ["--set", "loss.loss_decay_gamma=1.5", "--set", "draft.num_layers=3"])


def test_an_arm_that_changes_the_cache_caches_again():
    # the shared cache is made with the recipe's cache keys; an arm reading it with another encoding would be refused
    assert quality.reads_own_cache(harness.parse_arm("raw:cache.encoding=raw")[1])
    assert quality.reads_own_cache(harness.parse_arm("x:loss.ce_alpha=1,cache.encoding=raw")[1])
    assert not quality.reads_own_cache(harness.parse_arm("decay:loss.loss_decay_gamma=1.5")[1])
    assert not quality.reads_own_cache([])  # the recipe's own run


@pytest.mark.parametrize("item", ["decay", "decay:", ":loss.loss_decay_gamma=1.5", "decay:loss.loss_decay_gamma",
                                  "a/b:train.lr=1e-3", "decay:loss.loss_decay_gamma=1.5,oops"])
def test_malformed_arm_is_refused_before_any_work(item, tmp_path):
    out = tmp_path / "q"
    done = subprocess.run([sys.executable, "benchmarks/quality.py", "--out", str(out), "--arm", item], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert f"argument --arm: {item!r}: expected NAME:KEY=VALUE" in done.stderr
    assert not out.exists()


def test_arm_ratios_pair_checkpoints_of_equal_steps():
    curves = {"dspark": [{"step": 600, "replayed_tau": 1.5}, {"step": 1200, "replayed_tau": 1.6}],
              "dspark-decay": [{"step": 600, "replayed_tau": 1.56}, {"step": 1200, "replayed_tau": 1.68}]}
    assert quality.arm_ratios(curves, [("dspark-decay", "dspark")]) == [
        "dspark-decay / dspark: 1.040 / 1.050 at steps 600 / 1200"]


def test_arm_interval_comes_from_resampling_the_same_prompts():
    # prompt 0 gains a lot, prompts 1-3 lose a little: the ratio is above 1, the interval spans 1
    recipe = {"step": 8, "replayed_tau": 1.0, "per_record_tokens": [10, 10, 10, 10], "per_record_rounds": [10] * 4}
    arm = {"step": 8, "replayed_tau": 40 / 38, "per_record_tokens": [10] * 4, "per_record_rounds": [5, 11, 11, 11]}
    ratio, low, high = paired_ratio(arm, recipe)
    assert ratio == pytest.approx(40 / 38)
    assert low < 1.0 < high
    line, = quality.arm_ratios({"d": [recipe], "d-x": [arm]}, [("d-x", "d")])
    assert line == f"d-x / d: {ratio:.3f} [{low:.3f}, {high:.3f}] at steps 8"
    # every prompt gains: the whole interval is above 1
    arm["per_record_rounds"] = [8, 8, 9, 9]
    arm["replayed_tau"] = 40 / 34
    ratio, low, high = paired_ratio(arm, recipe)
    assert low > 1.0


def test_family_ratios_compare_final_drafts_of_unequal_steps():
    # the families train for the same budget, so their final checkpoints fall at different steps: last against last
    dspark = [{"step": 600, "minutes": 10.5, "replayed_tau": 1.2},
              {"step": 1200, "minutes": 21.0, "replayed_tau": 1.6, "per_record_tokens": [20, 20],
               "per_record_rounds": [10, 15]}]
    dflash = [{"step": 715, "minutes": 10.4, "replayed_tau": 1.1},
              {"step": 1430, "minutes": 20.9, "replayed_tau": 40 / 28, "per_record_tokens": [20, 20],
               "per_record_rounds": [12, 16]}]
    line, = quality.family_ratios({"dspark": dspark, "dflash": dflash})
    value, low, high = paired_ratio(dspark[-1], dflash[-1])
    assert value == pytest.approx(1.6 / (40 / 28))
    assert 1.0 < low <= high  # both prompts gain
    assert line == (f"dspark / dflash: {value:.3f} [{low:.3f}, {high:.3f}] (final drafts: 1200 / 1430 steps, "
                    "21.0 / 20.9 training min)")
    assert quality.family_ratios({"dflash": dflash, "eagle3": dflash}) == []  # no DSpark, nothing to compare


def test_a_finished_run_keeps_its_steps_on_a_budget_rerun(tmp_path):
    # --budget-s probes the seconds a step; a rerun must not probe a finished run again (new steps: its stage refuses)
    train = tmp_path / "dflash" / "train"
    train.mkdir(parents=True)
    (train / "settings.json").write_text(json.dumps({"train": {"max_steps": 1430}}))
    assert quality.finished_steps(tmp_path / "dflash") is None  # begun, not done: probed and trained as new
    (train / "DONE.json").write_text("{}")
    assert quality.finished_steps(tmp_path / "dflash") == 1430
    assert quality.finished_steps(tmp_path / "eagle3") is None


def test_ngram_ratios_pair_each_final_draft_with_lookup_on_the_same_prompts():
    ngram = {"replayed_tau": 2.0, "per_record_tokens": [30, 10], "per_record_rounds": [10, 10]}
    curves = {"dspark": [{"step": 600, "replayed_tau": 9.0},
                         {"step": 1200, "replayed_tau": 1.5, "per_record_tokens": [30, 30],
                          "per_record_rounds": [20, 20]}]}
    line, = quality.ngram_ratios(curves, ngram)
    value, low, high = paired_ratio(curves["dspark"][-1], ngram)
    assert value == pytest.approx(1.5 / 2.0) and low < high  # the final draft, not the 9.0 of the earlier checkpoint
    assert line == f"dspark / n-gram: {value:.3f} [{low:.3f}, {high:.3f}] (step 1200; n-gram replayed tau 2.000)"
    # the replay's oracle chooser between the draft and lookup, beside the ratio
    curves["dspark"][-1]["oracle"] = {"replayed_tau": 2.0, "per_record_tokens": [30, 30], "per_record_rounds": [15, 15]}
    line, = quality.ngram_ratios(curves, ngram)
    assert line.endswith("(step 1200; n-gram replayed tau 2.000; oracle chooser 2.000)")


def test_data_scaling_fits_a_line_in_log_conversations_and_says_it_extrapolates():
    assert data_scaling.parse_sizes("1280:1200,256:480") == [(256, 480), (1280, 1200)]
    for bad in ("256", "256:480", "a:b,1:2", "0:5,10:20"):
        with pytest.raises(Exception, match="PROMPTS:STEPS"):
            data_scaling.parse_sizes(bad)
    a, b = data_scaling.log_fit([(100, 1.2), (1000, 1.4), (10000, 1.6)])
    assert (a, b) == (pytest.approx(0.8), pytest.approx(0.2))
    assert data_scaling.conversations_for(2.0, a, b) == pytest.approx(1e6)
    assert data_scaling.conversations_for(2.0, 1.5, -0.1) == float("inf")
    row = {"prompts": 256, "conversations": 100, "answer_tokens": 12000, "steps": 480, "taus": [1.1, 1.2],
           "ngram_tau": 1.8, "over_ngram": (1.2 / 1.8, None, None),
           "generalization": {"training records": 2.0, "in-distribution held-out": 1.5}}
    rows = [row, {**row, "conversations": 1000, "taus": [1.3, 1.4]}]
    lines = data_scaling.report(rows, data_scaling.final_fit(rows), 2.0, 1.0)
    assert "| 256 | 100 | 12,000 | 480 | 1.100 / 1.200 | 1.800 | 0.667 | 2.00 / 1.50 |" in lines
    assert "tau = 0.800 + 0.200 * log10(conversations)" in "\n".join(lines)
    assert any(line.startswith("Extrapolated, not measured: tau 2.0 at ~1e+06 conversations") for line in lines)


def _result(curves: dict, ngram: dict, records: list[dict]) -> dict:
    """A quality.json as main writes it, with two eval records and made-up loop figures."""
    report = {"accept_len": 1.5, "exact_match": 1.0, "spec_tokens_per_s": 50.0, "speedup": 1.1,
              "speedup_vs_generate": 1.2, "accept_rate_at_k": [0.5] * 7}
    loop_rows = {"temperature": 0.0, "rows": [{"group": "all", "records": 2, "tau": 1.5, "ngram_tau": 1.25,
                                               "ratio": 1.2, "low": 1.1, "high": 1.3, "wins": 2}]}
    return {"gamma": 7, "eval_sources": ["mtbench", "humaneval"], "num_eval_prompts": 2, "max_new_tokens": 128,
            "train_sources": "[sharegpt]", "train_records": 10, "train_tokens": 1000, "data_s": 60.0,
            "budget_s": None, "steps": 8, "nproc": 1, "target_tokens_per_s": 45.0, "hf_generate_tokens_per_s": 40.0,
            "drafters": {"dspark": {"steps": 8, "train_s": 30.0, "report": report}, "ngram": {"report": report}},
            "ratios": {"dspark/ngram": 1.2}, "curves": curves, "arms": [], "records": records, "ngram": ngram,
            "vs_ngram": quality.replayed_vs_ngram(curves, ngram, records), "loop_vs_ngram": {"dspark": loop_rows}}


def test_quality_report_prints_per_source_tables_with_the_oracle_chooser():
    """quality.md: each final draft against prompt lookup per source and copy-heavy / rest, replayed (with the
    oracle chooser's tau beside each ratio) and in the real loop; the loop's dspark / n-gram ratio gets the
    replayed oracle beside it."""
    records = [{"id": "eval_prompts:mtbench:81", "source": "mtbench"},
               {"id": "eval_prompts:humaneval:HumanEval/0", "source": "humaneval"}]
    ngram = {"replayed_tau": 2.0, "per_record_tokens": [10, 30], "per_record_rounds": [10, 10]}  # 1.0 / 3.0
    final = {"step": 8, "minutes": 0.5, "replayed_tau": 1.75, "per_record_tokens": [15, 20],
             "per_record_rounds": [10, 10], "oracle": {"replayed_tau": 2.25, "per_record_tokens": [15, 30],
                                                       "per_record_rounds": [10, 10]}}
    result = _result({"dspark": [final]}, ngram, records)
    rows = {r["group"]: r for r in result["vs_ngram"]["dspark"]}
    assert rows["mtbench"]["ratio"] == pytest.approx(1.5) and rows["humaneval"]["ratio"] == pytest.approx(2 / 3)
    assert rows["copy-heavy (n-gram tau > 2.5)"]["records"] == 1 and rows["rest"]["oracle_tau"] == pytest.approx(1.5)
    text = quality.markdown(result)
    assert "- dspark/ngram: 1.200 (oracle chooser of the two, replayed: tau 2.250)" in text
    assert "dspark against the n-gram drafter in the real loop, per source (T=0.0):" in text
    assert "| all | 2 | 1.500 | 1.250 | 1.200 [1.100, 1.300] | 2 |" in text
    assert "dspark / n-gram: 0.875" in text and "oracle chooser 2.250)" in text
    assert "dspark, final draft against prompt lookup per source (replayed, T=0):" in text
    assert "| humaneval | 1 | 2.000 | 3.000 | 0.667 [0.667, 0.667] | 0 | 3.000 |" in text
    # results saved before the per-record tallies were kept still print, without the tables
    old = {"step": 8, "minutes": 0.5, "replayed_tau": 1.75}
    assert quality.replayed_vs_ngram({"dspark": [old]}, ngram, records) == {}


def test_eval_records_name_the_cached_records_in_cache_order(tiny_qwen3, tmp_path):
    """harness.eval_records: the held-out cache's records are the regenerated ones in order, less those the cache
    stage drops (too few supervised tokens): each keeps its prompt id and source, so per-record tallies can be
    split by source."""
    from core.recipe import load_recipe, recipe_to_dict

    recipe = load_recipe("dspark_qwen3_8b", [f"target.name_or_path={tiny_qwen3}", "data.min_loss_tokens=20"])
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    (tmp_path / "regen").mkdir()
    long = " ".join(f"word{i}" for i in range(40))
    rows = [("eval_prompts:mtbench:81", long), ("eval_prompts:gsm8k:3", "ok"),
            ("eval_prompts:humaneval:HumanEval/0", long)]
    (tmp_path / "regen" / "records.jsonl").write_text("".join(json.dumps(
        {"id": pid, "source": "eval_prompts", "conversations": [{"role": "user", "content": "question"},
                                                               {"role": "assistant", "content": answer}]}) + "\n"
        for pid, answer in rows))
    assert harness.eval_records(tmp_path) == [{"id": "eval_prompts:mtbench:81", "source": "mtbench"},
                                              {"id": "eval_prompts:humaneval:HumanEval/0", "source": "humaneval"}]


def test_add_source_takes_prompt_files_and_training_sources_never_held_out_ones(tmp_path):
    import argparse

    from benchmarks.harness import parse_source, training_sources

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    extra = [parse_source("libcode=1"), parse_source(f"{prompts}=0.5")]
    assert training_sources(None, extra) == (f"[{{name: sharegpt, weight: 1.0}}, {{name: 'libcode', weight: 1.0}}, "
                                             f"{{name: '{prompts.resolve()}', weight: 0.5}}]")
    for bad in ("humaneval=1", "mtbench=1", "gsm8k=1", "libcode=0", "libcode=nan", f"{tmp_path / 'none.jsonl'}=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_source(bad)
