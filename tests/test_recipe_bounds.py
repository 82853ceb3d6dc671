"""Each bound declared beside a recipe key (core/recipe.py `setting(..., bound=...)`) is the one enforced: a value
just past either end is refused naming the key and the valid range, the end itself where it is inclusive passes."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from core.recipe import Recipe, RecipeError, load_recipe, recipe_keys
from core.schema import Bound

BOUNDED = [row for row in recipe_keys() if row["bound"]]


def _bound_of(key: str) -> Bound:
    """The Bound declared beside `key` in the schema (an item's key of a list of sections: `data.sources[].weight`)."""
    node = Recipe
    for part in key.replace("[]", "").split("."):
        spec = {f.name: f for f in dataclasses.fields(node)}[part]
        hint = typing.get_type_hints(node)[part]
        node = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
    return spec.metadata["bound"]


def _override(key: str, value) -> str:
    if key == "data.sources[].weight":
        return f"data.sources=[{{name: sharegpt, weight: {value}}}]"
    if key == "target.layer_ids":
        return f"target.layer_ids=[1, {value}]"
    return f"{key}={value}"


def _cases():
    for row in BOUNDED:
        bound = _bound_of(row["key"])
        step = 1 if "int" in row["type"] else 1e-3
        if bound.low is not None:
            yield row["key"], bound.low if bound.low_open else bound.low - step, False
            if not bound.low_open:
                yield row["key"], bound.low, True
        if bound.high is not None:
            yield row["key"], bound.high if bound.high_open else bound.high + step, False
            if not bound.high_open:
                yield row["key"], bound.high, True


@pytest.mark.parametrize("key, value, valid", list(_cases()))
def test_each_declared_bound_is_enforced(key, value, valid):
    if isinstance(value, float) and value.is_integer() and "int" in next(r["type"] for r in BOUNDED if r["key"] == key):
        value = int(value)
    sets = [_override(key, value)]
    if key == "train.weight_decay":  # the default recipe's frozen copy start refuses any weight decay
        sets.append("draft.init_copy=trained")
    # a selector rank above 0 is DFlash2's alone (core/recipe.py _selector_problems)
    recipe = "dflash2_smollm2_135m" if key == "draft.selector_rank" and value > 0 else "dspark_smollm2_135m"
    if valid:
        load_recipe(recipe, sets)
        return
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, sets)
    assert f"{key} must be {_bound_of(key).text()}, got " in str(err.value)


def test_every_bounded_key_is_tried():
    assert {key for key, _, _ in _cases()} == {row["key"] for row in BOUNDED} and len(BOUNDED) > 50


@pytest.mark.parametrize("sets,fragment", [
    ({"draft.selector_rank": 10**9}, "draft.selector_rank must be in [0, 4096], got 1000000000"),
    # a power of two (SGLang's kernel takes one) above the vocabulary (49,152) and far above any useful K
    ({"draft.selector_top_k": 131072}, "draft.selector_top_k must be in [2, 1024], got 131072"),
], ids=["rank-1e9", "top-k-131072"])
def test_dflash2_selector_sizes_are_refused_before_any_work(sets, fragment, tiny_qwen3, prompt_file, tmp_path, capsys,
                                                            drill):
    """Round 5 (K7, K8): a selector rank of 1e9 (tables of 2 x vocabulary x 1e9) and a top-K above the vocabulary
    used to be found by the train stage, after regenerate and cache; both are refused at load, exit code 2, nothing
    written."""
    from conftest import tiny_overrides
    from pipeline import main

    drill("bad-input", f"--set {sets} (DFlash2 selector sizes)")
    out = tmp_path / "run"
    code = main(["--recipe", "dflash2_qwen3_8b", "--stages", "regenerate,cache,train", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file, **sets))
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err, err
    assert not out.exists()
