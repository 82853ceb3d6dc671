"""benchmarks/quality.py and its shared helpers (benchmarks/harness.py): training arms (--arm) parsed into recipe
overrides, refused when malformed, and compared with the family's recipe run checkpoint by checkpoint; the final
drafts against prompt lookup per source with the oracle chooser beside each ratio; which prompt each held-out cache
record is."""

import argparse
import json
import math
import re
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


def test_alpha_from_tau_inverts_the_accept_length_of_a_per_draft_acceptance():
    assert data_scaling.tau_from_alpha(0.5) == pytest.approx((1 - 0.5 ** 8) / 0.5)
    assert data_scaling.tau_from_alpha(1.0) == 8.0 and data_scaling.tau_from_alpha(0.0) == 1.0
    for alpha in (0.0, 0.05, 0.3, 0.55, 0.8, 0.97):
        assert data_scaling.alpha_from_tau(data_scaling.tau_from_alpha(alpha)) == pytest.approx(alpha, abs=1e-9)
    assert data_scaling.alpha_from_tau(0.9) == 0.0  # a draft never accepted
    with pytest.raises(ValueError, match="not below gamma \\+ 1 = 8"):
        data_scaling.alpha_from_tau(8.0)


def test_both_scaling_fits_recover_the_parameters_of_synthetic_points():
    c, d = 0.3, -0.12  # 1 - alpha = 10^c * tokens^d
    rows = [{"answer_tokens": t, "tau": data_scaling.tau_from_alpha(1 - 10 ** (c + d * math.log10(t)))}
            for t in (1e4, 3e4, 1e5, 4e5)]
    fits = data_scaling.scaling_fits(rows)
    assert (fits["power_law"]["c"], fits["power_law"]["d"]) == (pytest.approx(c), pytest.approx(d))
    truth = data_scaling.tau_from_alpha(1 - 10 ** (c + d * 6))
    assert data_scaling.predicted_tau(fits, 1e6)["power_law"] == pytest.approx(truth)
    assert data_scaling.tokens_for(truth, fits)["power_law"] == pytest.approx(1e6, rel=1e-6)
    line = data_scaling.scaling_fits([{"answer_tokens": 100, "tau": 1.2}, {"answer_tokens": 1000, "tau": 1.4},
                                      {"answer_tokens": 10000, "tau": 1.6}])["log_linear"]
    assert (line["a"], line["b_per_decade"]) == (pytest.approx(0.8), pytest.approx(0.2))
    flat = {"log_linear": {"a": 1.5, "b_per_decade": -0.1}, "power_law": {"c": -0.3, "d": 0.01}}
    assert data_scaling.tokens_for(2.0, flat) == {"log_linear": math.inf, "power_law": math.inf}


@pytest.mark.parametrize("bad", ["240:200,400", "240,480", "240,480:200", "a,b:1,2", "0,5:1,2", "240,480:200,x",
                                 "240,240:200,400"])
def test_grid_parser_refuses_bad_input_naming_it(bad):
    assert data_scaling.parse_grid("480,240:400,200") == ([240, 480], [200, 400])
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(repr(bad))}: expected PROMPTS,PROMPTS"):
        data_scaling.parse_grid(bad)


@pytest.mark.parametrize("argv, says", [
    (["--grid", "8,16:4,8", "--steps", "5"], "--steps: set by this script for every point"),
    (["--grid", "8,16:4,8", "--predict", "24:4"], "--predict 24:4: the fits are through the final drafts at 8 steps"),
    (["--grid", "8,16:4,8", "--predict", "16:8"], "--predict 16:8: that data size is on the grid"),
    (["--grid", "8,16:4,8", "--seed-point", "8:5"], "--seed-point 8:5 is not on the grid")])
def test_data_scaling_refuses_what_would_break_the_grid_before_any_run(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data_scaling, "run_quality", lambda *a: pytest.fail("ran a point"))
    with pytest.raises(SystemExit) as stopped:
        data_scaling.main(["--out", str(tmp_path / "s"), *argv])
    assert stopped.value.code == 2 and says in capsys.readouterr().err


def _fake_point(run, data_dir, prompts, steps, seed):
    """What quality.py --curve-only leaves for a point: 100 answer tokens a prompt, and a final draft whose rejection
    rate follows a power law in them (more steps: a little lower; seed 43: tau +0.002), on two held-out records."""
    tokens = prompts * 100
    tau = data_scaling.tau_from_alpha(1 - 10 ** (0.3 - 0.12 * math.log10(tokens)) * (1.0 if steps == 8 else 1.1))
    tau += 0.002 if seed == 43 else 0.0
    for stage, content in (("cache/manifest.json", {"num_records": prompts - 1,
                                                    "meta": {"loss_token_counts": [[5, tokens - 40], [9, 40]]}}),
                           ("regen/DONE.json", {"generated_tokens": tokens + 7})):
        (data_dir / "train-data" / stage).parent.mkdir(parents=True, exist_ok=True)
        (data_dir / "train-data" / stage).write_text(json.dumps(content))
    run.mkdir(parents=True, exist_ok=True)
    final = {"step": steps, "minutes": 1.0, "replayed_tau": tau, "per_record_tokens": [tau * 900, tau * 1100],
             "per_record_rounds": [900, 1100]}
    (run / "curves.json").write_text(json.dumps({
        "data_s": 60.0, "curves": {"dspark": [final]}, "records": [{"id": "e:mtbench:1"}, {"id": "e:humaneval:2"}],
        "ngram": {"replayed_tau": 1.8, "per_record_tokens": [1800, 1800], "per_record_rounds": [1000, 1000]},
        "trained": {"dspark": {"generalization": {"training records": 2.0, "in-distribution held-out": 1.5}}}}))


def test_grid_shares_each_data_size_and_writes_the_prediction_before_running_it(tmp_path, monkeypatch, capsys):
    out, calls = tmp_path / "scaling", []

    def fake_run(run, data_dir, prompts, steps, flags, log):
        seed = int(flags[flags.index("--set") + 1].split("=")[1]) if "--set" in flags else 42
        saved = out / "scaling.json"
        calls.append({"run": run, "data_dir": data_dir, "flags": flags,
                      "saved": json.loads(saved.read_text()) if saved.is_file() else None})
        _fake_point(run, data_dir, prompts, steps, seed)

    monkeypatch.setattr(data_scaling, "run_quality", fake_run)
    assert data_scaling.main(["--out", str(out), "--grid", "8,16:4,8", "--seeds", "2", "--predict", "24:8",
                              "--eval-per-source", "1", "--add-source", "libcode=1"]) == 0
    assert [c["run"].relative_to(out).as_posix() for c in calls] == [
        "p8/s4", "p8/s8", "p16/s4", "p16/s8", "p16/s8-seed43", "p24/s8"]
    assert [c["data_dir"].name for c in calls] == ["p8", "p8", "p16", "p16", "p16", "p24"]  # one regeneration a size
    for c in calls:  # quality.py's own flags pass through to every point
        assert c["flags"][:6] == ["--families", "dspark", "--eval-per-source", "1", "--add-source", "libcode=1"]
    assert ["--set" in c["flags"] for c in calls] == [False] * 4 + [True, False]
    # the prediction was on disk before its point ran, and no measurement was in it
    before = calls[-1]["saved"]["prediction"]
    assert before["measured_before_prediction"] is False and "measured_tau" not in before
    assert before["answer_tokens"] == pytest.approx(2400) and before["tokens_per_prompt"] == pytest.approx(100)
    result = json.loads((out / "scaling.json").read_text())
    assert (result["fits"]["power_law"]["c"], result["fits"]["power_law"]["d"]) == (pytest.approx(0.3),
                                                                                   pytest.approx(-0.12))
    prediction = result["prediction"]
    assert prediction["tau"]["power_law"] == pytest.approx(prediction["measured_tau"])  # the points follow the law
    assert prediction["seed_spread"] == pytest.approx(0.002)
    printed = capsys.readouterr().out
    assert "| 16 | 15 | 1,600 | 8 | 43 |" in printed and "| 24 (predicted point) | 23 | 2,400 | 8 | 42 |" in printed
    assert "- data: 16 / 8 prompts at 4 steps: " in printed and "- steps: 8 / 4 steps at 16 prompts: " in printed
    assert "(log10(1 - alpha) = 0.300 -0.1200 * log10(tokens);" in printed
    assert "seed 43 / seed 42 at 16:8: tau" in printed and "(difference +0.002)" in printed
    assert re.search(r"power-law fit [0-9.]+ \(miss [+-]0\.000, inside the seed spread 0\.002", printed)


def test_in_distribution_prompts_follow_the_data_runs_seed_not_training_overrides(tmp_path, monkeypatch):
    """A second training seed (--set seed=43) must not move the in-distribution split: it is the data run's."""
    from core.recipe import load_recipe, recipe_to_dict
    from data.sources.prompts import load_prompts

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "turns": [f"question {i}"]}) + "\n" for i in range(60)))
    sources = f"[{{name: '{prompts}'}}]"
    monkeypatch.setattr(harness, "answer_and_cache", lambda *a: None)
    chosen = {}
    for seed in (42, 43):
        data_run = tmp_path / f"data{seed}"
        data_run.mkdir()
        recipe = load_recipe("dspark_smollm2_135m", [f"seed={seed}", "data.holdout_fraction=0.3"])
        (data_run / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
        harness.prepare_in_distribution_data(data_run, data_run, sources, 5, 8, 1, tmp_path / "log")
        chosen[seed] = [json.loads(line)["id"] for line in
                        (data_run / "in_distribution_prompts.jsonl").read_text().splitlines()]
        assert chosen[seed] == [p.id for p in load_prompts(yaml.safe_load(sources), 5, 0.3, seed, split="holdout")]
    assert chosen[42] != chosen[43]


def test_calibration_prompts_are_each_training_sources_unseen_prompts(tmp_path):
    """verify_schedule.py --calibration-run: per source, prompts of the run's held-out split (never trained on)."""
    from core.recipe import load_recipe, recipe_to_dict
    from data.sources.prompts import load_prompts

    files = {}
    for name in ("a", "b"):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"id": str(i), "turns": [f"{name} question {i}"]}) + "\n"
                                       for i in range(40)))
    sources = f"[{{name: '{files['a']}'}}, {{name: '{files['b']}'}}]"
    recipe = load_recipe("dspark_smollm2_135m", [f"data.sources={sources}", "data.holdout_fraction=0.25",
                                                 "data.num_prompts=50"])
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    written = harness.holdout_prompt_file(tmp_path, 3, tmp_path / "out" / "calibration.jsonl")
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    trained = {p.id for p in load_prompts(yaml.safe_load(sources), 50, 0.25, recipe.seed)}
    assert len(rows) == 6 and [r["id"].split(":")[0] for r in rows] == ["a"] * 3 + ["b"] * 3
    assert trained and not trained & {r["id"] for r in rows}  # none of them a training prompt
    assert all(len(r["turns"]) == 1 for r in rows)


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


def test_family_source_tables_pair_each_family_with_dspark_per_source_and_copy_split():
    """Each other family's final draft over DSpark's on the same records, per source and for copy-heavy / rest (read
    from prompt lookup's own tau, not DSpark's), with the paired interval; the conditional acceptance table per
    position beside it."""
    records = [{"id": "eval_prompts:mtbench:81", "source": "mtbench"},
               {"id": "eval_prompts:gsm8k:3", "source": "gsm8k"}]
    ngram = {"replayed_tau": 2.0, "per_record_tokens": [10, 30], "per_record_rounds": [10, 10]}  # gsm8k copy-heavy
    dspark = {"step": 100, "minutes": 3.0, "replayed_tau": 1.5, "per_record_tokens": [15, 15],
              "per_record_rounds": [10, 10], "cond_accept_rate_at_k": [0.3, 0.2, 0.1], "accept_rate_at_k": [0.3, 0.06,
                                                                                                            0.006]}
    dflash2 = {"step": 60, "minutes": 3.0, "replayed_tau": 1.5, "per_record_tokens": [12, 18],
               "per_record_rounds": [10, 10], "cond_accept_rate_at_k": [0.25, 0.5, 0.0],
               "accept_rate_at_k": [0.25, 0.125, 0.0]}
    lines = quality.family_source_tables({"dspark": [dspark], "dflash2": [dflash2]}, ngram, records)
    assert lines[0] == "dflash2 over dspark, final drafts per source (replayed, T=0):"
    assert "| mtbench | 1 | 1.200 | 1.500 | 0.800 [0.800, 0.800] | 0 |" in lines
    assert "| gsm8k | 1 | 1.800 | 1.500 | 1.200 [1.200, 1.200] | 1 |" in lines
    assert "| copy-heavy (n-gram tau > 2.5) | 1 | 1.800 | 1.500 | 1.200 [1.200, 1.200] | 1 |" in lines
    assert "| rest | 1 | 1.200 | 1.500 | 0.800 [0.800, 0.800] | 0 |" in lines
    assert quality.family_source_tables({"dflash2": [dflash2]}, ngram, records) == []  # no DSpark: nothing to pair
    # --over: the tables over another draft (an --also-draft's), the ratios inverted
    over = quality.family_source_tables({"dspark": [dspark], "dflash2": [dflash2]}, ngram, records, over="dflash2")
    assert over[0] == "dspark over dflash2, final drafts per source (replayed, T=0):"
    assert "| mtbench | 1 | 1.500 | 1.200 | 1.250 [1.250, 1.250] | 1 |" in over
    table = quality.position_acceptance({"dspark": [dspark], "dflash2": [dflash2]})
    assert table[0].startswith("| final draft | steps | cond@1 | cond@2 | cond@3 | acc@1")
    assert "| dflash2 | 60 | 0.250 | 0.500 | 0.000 | 0.250 | 0.125 | 0.000 |" in table
    assert quality.position_acceptance({"dspark": [{"step": 1, "replayed_tau": 1.0}]}) == []  # saved before: none


def test_replay_model_drafts_over_the_whole_vocabulary_only_when_asked():
    """A block draft trained over loss.vocab_size keeps its token map (draft_vocab): replayed as trained it drafts
    only among those ids; with full_vocab, as the engines serve it, over all of them (the --full-vocab mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from modeling.dspark import DSparkModel, build_dspark_config

    config = LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    draft_config = build_dspark_config(target.config, num_layers=1, block_size=4, target_layer_ids=[0, 1],
                                       mask_token_id=5, markov_rank=0, enable_confidence_head=False,
                                       sample_from_anchor=False)
    token_map = torch.arange(0, 200, 20)  # 10 of the 200 ids
    hidden, prev = torch.randn(64, 4, 32), torch.randint(0, 200, (64, 4))
    drafts = {}
    for full_vocab in (False, True):
        model = DSparkModel.from_target(draft_config, target).to(torch.bfloat16)
        model.draft_vocab = token_map
        model = harness.replay_model(model, full_vocab)
        assert next(model.parameters()).dtype == torch.float32
        with torch.no_grad():
            drafts[full_vocab] = model.greedy_drafts(hidden, prev)
    assert torch.isin(drafts[False], token_map).all()
    assert not torch.isin(drafts[True], token_map).all()  # the whole vocabulary: ids outside the map win


def test_a_finished_run_is_trained_on_as_it_is_and_an_unfinished_one_refused(tmp_path, monkeypatch):
    # --train-run: every family reads the run's own regeneration and cache, with the sources its recipe names
    run = tmp_path / "default"
    sources = [{"name": "sharegpt", "path": None, "weight": 1.0, "split": "train"},
               {"name": "wordmath", "path": None, "weight": 0.5, "split": "train"}]
    (run / "regen").mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump({"data": {"sources": sources}}))
    (run / "regen" / "DONE.json").write_text(json.dumps({"seconds": 600.0}))
    monkeypatch.setattr(harness, "prepare_eval_data", lambda out, *args: ("eval-run", "eval-file", ["mtbench"]))
    with pytest.raises(SystemExit, match=r"no finished cache stage there .*--stages regenerate,cache"):
        harness.finished_data(run, tmp_path / "q", 12, None, 128, 2, tmp_path / "log")
    (run / "cache").mkdir()
    (run / "cache" / "DONE.json").write_text(json.dumps({"seconds": 300.0}))
    data_run, eval_run, _, _, named, data_s = harness.finished_data(run, tmp_path / "q", 12, None, 128, 2,
                                                                    tmp_path / "log")
    assert (data_run, eval_run, data_s) == (run, "eval-run", 900.0)
    assert "\n" not in named and yaml.safe_load(named) == sources  # one --set value, the run's sources back


@pytest.mark.parametrize("args, error", [
    (["--also-draft", "default=/nowhere"], "argument --also-draft: 'default=/nowhere': expected NAME=RUN with a "
                                           "finished run's RUN/train/final"),
    (["--also-draft", "dflash={run}"], "--also-draft names ['dflash'] are a family's or an arm's"),
    (["--families", "dspark,eagle3", "--arm", "x:train.lr=1e-3", "--also-draft", "eagle3-x={run}"],
     "--also-draft names ['eagle3-x'] are a family's or an arm's"),
    (["--families", "dspark", "--arm", "x:train.lr=1e-3", "--arm-families", "dflash2"],
     "--arm-families dflash2: not among --families dspark"),
])
def test_a_draft_to_table_beside_the_families_and_an_arm_for_some_families_are_checked_before_any_work(
        args, error, tmp_path):
    run = tmp_path / "default"
    (run / "train" / "final").mkdir(parents=True)
    out = tmp_path / "q"
    done = subprocess.run([sys.executable, "benchmarks/quality.py", "--out", str(out),
                           *(a.format(run=run) for a in args)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and error in done.stderr, done.stderr
    assert not out.exists()


def test_training_minutes_add_the_steps_own_seconds(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "step_s": 30.0, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    assert harness.training_minutes(tmp_path) == {1: 0.5, 2: 1.0, 3: 1.5}
