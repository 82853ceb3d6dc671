"""benchmarks/quality.py's training arms (--arm): parsed into recipe overrides, refused when malformed, and compared
with the family's recipe run checkpoint by checkpoint."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import quality  # noqa: E402


def test_arm_becomes_recipe_overrides():
    assert quality.parse_arm("decay1.5-layers3:loss.loss_decay_gamma=1.5,draft.num_layers=3") == (
        "decay1.5-layers3", ["--set", "loss.loss_decay_gamma=1.5", "--set", "draft.num_layers=3"])


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
    ratio, low, high = quality.paired_ratio(arm, recipe)
    assert ratio == pytest.approx(40 / 38)
    assert low < 1.0 < high
    line, = quality.arm_ratios({"d": [recipe], "d-x": [arm]}, [("d-x", "d")])
    assert line == f"d-x / d: {ratio:.3f} [{low:.3f}, {high:.3f}] at steps 8"
    # every prompt gains: the whole interval is above 1
    arm["per_record_rounds"] = [8, 8, 9, 9]
    arm["replayed_tau"] = 40 / 34
    ratio, low, high = quality.paired_ratio(arm, recipe)
    assert low > 1.0


def test_family_ratios_compare_final_drafts_of_unequal_steps():
    # the families train for the same budget, so their final checkpoints fall at different steps: last against last
    dspark = [{"step": 600, "minutes": 10.5, "replayed_tau": 1.2},
              {"step": 1200, "minutes": 21.0, "replayed_tau": 1.6, "per_record_tokens": [20, 20],
               "per_record_rounds": [10, 15]}]
    dflash = [{"step": 715, "minutes": 10.4, "replayed_tau": 1.1},
              {"step": 1430, "minutes": 20.9, "replayed_tau": 1.4, "per_record_tokens": [20, 20],
               "per_record_rounds": [12, 16]}]
    line, = quality.family_ratios({"dspark": dspark, "dflash": dflash})
    value, low, high = quality.paired_ratio(dspark[-1], dflash[-1])
    assert value == pytest.approx(1.6 / 1.4)
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
