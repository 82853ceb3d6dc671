"""The family seam: every per-family table covers every family of core/recipe.py (FAMILIES), so a new family that
misses one fails here, naming the table, rather than at a user's first run of it.

The tables, one place per fact:
  core/recipe.py        FAMILIES / BLOCK_FAMILIES; recipes/base/<family>.yaml and <family>_{smollm2_135m,qwen3_*}.yaml
  modeling/registry.py  ARCHITECTURES (family -> model class, config class, the target's frozen copies)
  train/algorithms.py   TRAINING_ALGORITHMS (architecture -> how it trains); its loss terms are recipe keys
  eval/spec_decode.py   DRAFTERS (model class -> the eval loop's proposer)
  export/serving.py     detect_algorithm (draft config -> serving algorithm), SGLANG_ALGORITHMS, VLLM_METHODS,
                        _HIDDEN_STATES_HOOK (per engine x serving algorithm)
  export/convert.py     SERVING_NAMES (engine x architecture -> tensor names)
  benchmarks/           quality.py reads FAMILIES; arch_matrix.py FAMILIES + MATRIX_LEAVES_OUT
"""

from __future__ import annotations

import pytest

from core.recipe import BLOCK_FAMILIES, FAMILIES, load_recipe
from core.server import ENGINES, SERVING_ALGORITHMS
from conftest import ROOT
from eval.spec_decode import DRAFTERS
from export.convert import SERVING_NAMES
from export.serving import _HIDDEN_STATES_HOOK, SGLANG_ALGORITHMS, VLLM_METHODS, detect_algorithm
from modeling.registry import ARCHITECTURES, architecture_for_family
from train.algorithms import TRAINING_ALGORITHMS

# The serving algorithm each family's own recipe layout exports as (core/server.py SERVING_ALGORITHMS).
SERVED_AS = {"dspark": "dspark", "dflash": "dflash", "dflash2": "dflash2", "eagle3": "eagle3"}
RECIPE_TARGETS = ("smollm2_135m", "qwen3_4b", "qwen3_8b", "qwen3_14b")


def test_the_tables_here_name_every_family():
    assert set(SERVED_AS) == set(FAMILIES) and set(BLOCK_FAMILIES) < set(FAMILIES)
    assert set(SERVED_AS.values()) == set(SERVING_ALGORITHMS)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_a_model_a_trainer_a_proposer_and_serving_names(family):
    arch = architecture_for_family(family)
    assert arch.name in TRAINING_ALGORITHMS, f"train/algorithms.py TRAINING_ALGORITHMS has no {arch.name}"
    assert arch.model_class in DRAFTERS, f"eval/spec_decode.py DRAFTERS has no {arch.model_class.__name__}"
    for engine in ENGINES:
        assert (engine, arch.name) in SERVING_NAMES, f"export/convert.py SERVING_NAMES has no ({engine}, {arch.name})"
    assert set(ARCHITECTURES) == set(TRAINING_ALGORITHMS)


@pytest.mark.parametrize("algorithm", SERVING_ALGORITHMS)
def test_every_serving_algorithm_has_each_engines_spelling(algorithm):
    assert algorithm in SGLANG_ALGORITHMS and algorithm in VLLM_METHODS
    assert all((engine, algorithm) in _HIDDEN_STATES_HOOK for engine in ENGINES)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_its_recipes_and_exports_as_itself(family):
    assert (ROOT / "recipes" / "base" / f"{family}.yaml").is_file()
    for target in RECIPE_TARGETS:
        recipe = load_recipe(f"{family}_{target}")
        assert recipe.family == family, f"{family}_{target}"
    d = load_recipe(f"{family}_smollm2_135m").draft
    layout = {"architectures": [architecture_for_family(family).name], "sample_from_anchor": d.sample_from_anchor,
              "markov_rank": d.markov_rank, "enable_confidence_head": d.enable_confidence_head,
              "selector_rank": d.selector_rank}
    assert detect_algorithm(layout) == SERVED_AS[family]


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_every_block_head_a_family_builds_has_a_loss_term(family):
    """A head the family's recipe builds is trained by a term its recipe weighs (else it ships at its init)."""
    recipe = load_recipe(f"{family}_smollm2_135m")
    d, loss = recipe.draft, recipe.loss
    assert loss.ce_alpha + loss.l1_alpha + loss.soft_ce_alpha > 0
    if d.enable_confidence_head:
        assert loss.conf_alpha > 0
    if d.selector_rank:
        assert loss.selector_alpha > 0
    if loss.selector_alpha:
        assert d.selector_rank > 0


def test_benchmarks_cover_every_family():
    import benchmarks.arch_matrix as matrix
    import benchmarks.quality as quality

    assert set(matrix.FAMILIES) | set(matrix.MATRIX_LEAVES_OUT) == set(FAMILIES)
    assert not set(matrix.FAMILIES) & set(matrix.MATRIX_LEAVES_OUT)
    assert quality.FAMILIES == FAMILIES
