"""The target-architecture matrix, measured (issue 48): benchmarks/arch_matrix.py takes a tiny random target of each
architecture data/assets.py writes through regenerate, cache, online and cached training of every family, eval and
export, and has SGLang's and vLLM's own code read each export beside that target's config. Every cell passes, or is
refused up front where the engine's own code agrees it cannot serve it; the refusals are exactly those
export/serving.py UNSERVED_TARGETS lists, so the table is checked against the wheels. The suite runs the three
architectures whose attention differs most from Llama's (sliding windows with an engine refusing each way, linear
attention, MLA), ~4 min on 2 CPU cores; `python benchmarks/arch_matrix.py` measures all eighteen for the README's
table, and DRAFTSMITH_FULL_MATRIX=1 runs them all here. The quick half (lossless loop, rollback, regeneration, rope,
refusals, for every architecture) is tests/test_arch_targets.py; the pre-flight on round 2's is tests/test_preflight.py.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from benchmarks.arch_matrix import FAMILIES, columns, markdown, run_matrix
from data.assets import TINY_ARCHITECTURES
from export.serving import ENGINE_NAMES, UNSERVED_TARGETS


IN_SUITE = ("gemma3", "qwen3-next", "deepseek-v3")


def test_every_architecture_passes_every_stage_or_is_refused_where_its_engine_cannot_serve(tmp_path, vllm_python):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed: pip install --no-deps -r requirements-sglang-cpu-test.txt")
    architectures = list(TINY_ARCHITECTURES) if os.environ.get("DRAFTSMITH_FULL_MATRIX") else list(IN_SUITE)
    matrix = run_matrix(tmp_path, architectures, vllm_python)
    table = markdown(matrix)
    print(table)
    (tmp_path / "matrix.md").write_text(table + "\n")
    assert set(matrix) == set(architectures) and all(set(cells) == set(columns()) for cells in matrix.values())
    failed = {(arch, column): cell for arch, cells in matrix.items() for column, cell in cells.items()
              if cell.startswith("FAIL")}
    assert failed == {}, json.dumps({f"{a} / {c}": v for (a, c), v in failed.items()}, indent=1) + "\n" + table
    column = {"sglang": "SGLang", "vllm": "vLLM"}
    expected = {(arch, f"{column[engine]} {family}") for arch in architectures for engine in UNSERVED_TARGETS
                for family in FAMILIES
                if family in UNSERVED_TARGETS[engine].get(TINY_ARCHITECTURES[arch], ())}
    refused = {(arch, c) for arch, cells in matrix.items() for c, cell in cells.items() if cell.startswith("refused")}
    assert refused == expected, table
    assert all(ENGINE_NAMES["sglang" if c.startswith("SGLang") else "vllm"] in matrix[a][c] for a, c in refused)
