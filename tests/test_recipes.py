"""Recipes: every shipped recipe loads, typos and wrong types are refused with the right names, --set overrides."""

import subprocess
import sys
from pathlib import Path

import pytest

from core.recipe import RecipeError, list_recipes, load_recipe

ROOT = Path(__file__).resolve().parent.parent

QWEN3 = {
    "qwen3_4b": ("Qwen/Qwen3-4B", [1, 9, 17, 25, 33], [2, 18, 33]),
    "qwen3_8b": ("Qwen/Qwen3-8B", [1, 9, 17, 25, 33], [2, 18, 33]),
    "qwen3_14b": ("Qwen/Qwen3-14B", [1, 10, 19, 28, 37], [2, 20, 37]),
}


def test_required_recipes_exist():
    names = set(list_recipes())
    for family in ("dspark", "dflash", "eagle3"):
        for target in ("qwen3_4b", "qwen3_8b", "qwen3_14b", "smollm2_135m"):
            assert f"{family}_{target}" in names


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_loads_with_the_small_run_keys(name):
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe.family == name.split("_")[0]
    for key in ("data.num_prompts", "regen.max_new_tokens", "train.max_steps", "eval.num_samples"):
        section, field = key.split(".")
        assert getattr(getattr(recipe, section), field) > 0
        small = load_recipe(name, [f"{key}=3"])
        assert getattr(getattr(small, section), field) == 3


@pytest.mark.parametrize("family", ["dspark", "dflash", "eagle3"])
@pytest.mark.parametrize("size", list(QWEN3))
def test_qwen3_recipes_name_the_real_targets_and_layers(family, size):
    recipe = load_recipe(f"{family}_{size}")
    hub_id, dspark_layers, eagle_layers = QWEN3[size]
    assert recipe.target.name_or_path == hub_id
    assert recipe.target.layer_ids == (eagle_layers if family == "eagle3" else dspark_layers)
    assert recipe.draft.mask_token_id == 151669


@pytest.mark.parametrize("target", ["qwen3_8b", "smollm2_135m"])
def test_family_switches(target):
    # a target's shared settings must never switch a family's heads back on
    dspark, dflash, eagle3 = (load_recipe(f"{f}_{target}") for f in ("dspark", "dflash", "eagle3"))
    # DeepSpec's mix on the GPU targets; the CPU-sized SmolLM2 recipes train DSpark and DFlash on CE, half of it soft
    # (measured: benchmarks/README.md, "What each lever gave", "Where the gap is", "The three families on the
    # 60-minute data")
    dspark_mix = (0.5, 0.5, 0.0, 1.0) if target == "smollm2_135m" else (0.1, 0.0, 0.9, 1.0)
    assert (dspark.loss.ce_alpha, dspark.loss.soft_ce_alpha, dspark.loss.l1_alpha, dspark.loss.conf_alpha) == dspark_mix
    assert dspark.draft.markov_rank > 0 and dspark.draft.enable_confidence_head
    dflash_mix = (0.5, 0.5, 0.0, 0.0) if target == "smollm2_135m" else (1.0, 0.0, 0.0, 0.0)
    assert (dflash.loss.ce_alpha, dflash.loss.soft_ce_alpha, dflash.loss.l1_alpha, dflash.loss.conf_alpha) == dflash_mix
    assert dflash.draft.markov_rank == 0 and not dflash.draft.enable_confidence_head
    assert eagle3.draft.num_layers == 1 and eagle3.draft.ttt_length == 7 and len(eagle3.target.layer_ids) == 3


def test_typo_names_the_closest_key():
    with pytest.raises(RecipeError) as err:
        load_recipe("dspark_smollm2_135m", ["data.num_promts=3"])
    assert "data.num_promts" in str(err.value) and "did you mean 'data.num_prompts'" in str(err.value)


def test_typo_in_a_recipe_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("family: dspark\nregen:\n  temprature: 0.5\ntrian:\n  max_steps: 3\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(str(path))
    message = str(err.value)
    # both errors are reported at once
    assert "'regen.temprature'" in message and "'regen.temperature'" in message
    assert "'trian'" in message and "'train'" in message


def test_wrong_type_names_the_expected_type():
    with pytest.raises(RecipeError) as err:
        load_recipe("dspark_smollm2_135m", ["train.max_steps=many", "target.layer_ids=3", "regen.enable_thinking=1"])
    message = str(err.value)
    assert "train.max_steps: expected int, got str 'many'" in message
    assert "target.layer_ids: expected a list of int" in message
    assert "regen.enable_thinking: expected bool" in message


def test_bad_choice_and_range():
    with pytest.raises(RecipeError, match=r"draft.markov_head_type: 'lstm' is not one of"):
        load_recipe("dspark_smollm2_135m", ["draft.markov_head_type=lstm"])
    with pytest.raises(RecipeError, match=r"data.num_prompts must be > 0"):
        load_recipe("dspark_smollm2_135m", ["data.num_prompts=0"])
    with pytest.raises(RecipeError, match=r"train.keep_checkpoints must be >= 0, got -1"):
        load_recipe("dspark_smollm2_135m", ["train.keep_checkpoints=-1"])
    with pytest.raises(RecipeError, match=r"train.zero_stage must be 0 \(DDP\), 1 or 2 .*got 3"):
        load_recipe("dspark_smollm2_135m", ["train.zero_stage=3"])
    with pytest.raises(RecipeError, match=r"loss.eagle3_loss_norm: 'global' is not one of"):
        load_recipe("eagle3_smollm2_135m", ["loss.eagle3_loss_norm=global"])


def test_eagle3_layer_count_and_loss_norm_are_recipe_keys():
    """DeepSpec's Eagle3 reads the block drafters' 5 target layers and normalises each TTT step by the batch's tokens;
    both are recipe choices, the classic 3 layers and the token mean stay the default."""
    default = load_recipe("eagle3_qwen3_8b")
    assert len(default.target.layer_ids) == 3 and default.loss.eagle3_loss_norm == "valid_tokens"
    deepspec = load_recipe("eagle3_qwen3_8b", ["target.layer_ids=[1, 9, 17, 25, 33]", "loss.eagle3_loss_norm=positions"])
    assert deepspec.target.layer_ids == [1, 9, 17, 25, 33] and deepspec.loss.eagle3_loss_norm == "positions"


def test_qwen3_recipes_ask_for_deepspec_scale_data():
    """A DeepSpec-like mix at about DeepSpec's 10 epochs, refused (not shrunk) when the sources fall short."""
    for family in ("dspark", "dflash", "eagle3"):
        recipe = load_recipe(f"{family}_qwen3_8b")
        assert [s.name for s in recipe.data.sources] == ["mlabonne/open-perfectblend"]
        assert recipe.data.allow_fewer is False and recipe.data.num_prompts >= 1_000_000
        epochs = recipe.train.max_steps * recipe.train.global_batch_size / recipe.data.num_prompts
        assert 9.5 <= epochs <= 10.5, epochs


def test_set_overrides_nested_and_lists():
    recipe = load_recipe("dspark_smollm2_135m", [
        "target.layer_ids=[0, 3]", "data.sources=[{name: humaneval, weight: 2}]", "draft.mask_token_id=null"])
    assert recipe.target.layer_ids == [0, 3]
    assert recipe.data.sources[0].name == "humaneval" and recipe.data.sources[0].weight == 2.0
    assert recipe.draft.mask_token_id is None


def test_exponent_floats_without_a_dot():
    recipe = load_recipe("dspark_smollm2_135m", ["train.lr=1e-4", "loss.loss_decay_gamma=7"])
    assert recipe.train.lr == 1e-4 and recipe.loss.loss_decay_gamma == 7.0
    with pytest.raises(RecipeError, match="train.lr: expected float, got str 'fast'"):
        load_recipe("dspark_smollm2_135m", ["train.lr=fast"])


def test_unknown_recipe_suggests_a_name():
    with pytest.raises(RecipeError, match="dspark_qwen3_8b"):
        load_recipe("dspark_qwen3_8")


@pytest.mark.parametrize("argv", [["train/main.py", "--help"], ["train/main.py", "--list-recipes"],
                                  ["train/main.py", "--recipe", "dspark_smollm2_135n"], ["eval.py", "--help"],
                                  ["export/main.py", "--help"],
                                  ["eval.py", "--draft", "runs/no-such-draft", "--target", "smollm2-135m-instruct",
                                   "--dataset", "mtbench"]])
def test_the_command_lines_answer_without_importing_torch(argv):
    """--help, the recipe list, a recipe typo and a wrong --draft folder answer at once: torch and transformers (~12 s
    to import here) are imported only by the work itself."""
    code = (f"import runpy, sys\nsys.argv = {argv!r}\ntry:\n    runpy.run_path({argv[0]!r}, run_name='__main__')\n"
            f"except SystemExit:\n    pass\nprint('loaded:', sorted({{'torch', 'transformers'}} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "loaded: []", done.stdout[-500:] + done.stderr[-2000:]


def test_cli_lists_recipes_and_rejects_typos():
    listed = subprocess.run([sys.executable, "train/main.py", "--list-recipes"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    assert listed == list_recipes()
    bad = subprocess.run([sys.executable, "train/main.py", "--recipe", "dspark_smollm2_135m", "--set",
                          "regen.max_new_token=4"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "did you mean 'regen.max_new_tokens'" in bad.stderr
