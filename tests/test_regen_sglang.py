"""regen.backend: sglang (the Qwen3 recipes' default): the regenerate stage starts an SGLang server per rank itself.

No GPU runs SGLang here, so the live path is checked in parts: the command line the stage launches goes through SGLang
0.5.23's own argument parser (`prepare_server_args`, as launch_server does); the server itself is tests/fake_sglang.py,
answering /v1/completions in SGLang's response shape, which the stage starts through the real LiveServer path (a
`regen.engine_python` wrapper that runs it for `-m sglang.launch_server`); and each rank's server gets its own GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.dist import Dist
from core.recipe import load_recipe
from core.server import engine_python_problem
from core.server_procs import tagged_processes
from data.chat import render_prompt_ids
from data.regen.backends import SGLangBackend
from data.regen.regenerate import RegenJob, read_records, run_regenerate
from modeling.target import load_tokenizer
from pipeline import main

from conftest import ROOT, tiny_overrides

LOG_VAR = "FAKE_SGLANG_LOG"


def engine_python(folder: Path) -> Path:
    """A `python` that runs tests/fake_sglang.py for `-m sglang.launch_server` and is this interpreter otherwise."""
    path = folder / "python"
    path.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ]; then\n  shift 2\n'
                    f'  exec "{sys.executable}" "{ROOT / "tests" / "fake_sglang.py"}" "$@"\nfi\n'
                    f'exec "{sys.executable}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def recipe_for(tiny_qwen3, prompt_file, python: Path):
    # top_k 0 (the recipe's "no cut") is refused by SGLang: the backend must send -1
    return load_recipe("dspark_qwen3_8b", [
        f"target.name_or_path={tiny_qwen3}", f"data.sources=[{{name: '{prompt_file}'}}]", "data.num_prompts=8",
        "data.max_length=128", "regen.max_new_tokens=3", "regen.batch_size=3", "regen.top_k=0",
        f"regen.engine_python={python}", 'regen.server_args=["--mem-fraction-static", "0.8"]'])


def servers_logging_to(path: Path) -> list[int]:
    """Pids of the fake servers (and their children) started with $FAKE_SGLANG_LOG = `path`: this test's own, whatever
    else runs on the machine."""
    want = f"{LOG_VAR}={path}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and want in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            continue
    return found


def fake_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(the fake's starts, its answered requests)."""
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in entries if "argv" in e], [e for e in entries if "request" in e]


@pytest.fixture(scope="module")
def sglang_run(tiny_qwen3, prompt_file, tmp_path_factory):
    base = tmp_path_factory.mktemp("sglang")
    recipe = recipe_for(tiny_qwen3, prompt_file, engine_python(base))
    tokenizer = load_tokenizer(str(tiny_qwen3))

    def no_target():
        raise AssertionError("the sglang backend must not load the target in-process")

    os.environ[LOG_VAR] = str(base / "fake.jsonl")  # the server inherits it
    try:
        done = run_regenerate(RegenJob(recipe, base / "regen", Dist(), no_target, tokenizer))
    finally:
        del os.environ[LOG_VAR]
    starts, answered = fake_log(base / "fake.jsonl")
    return {"recipe": recipe, "tokenizer": tokenizer, "done": done, "records": read_records(base / "regen"),
            "starts": starts, "answered": answered, "left": servers_logging_to(base / "fake.jsonl"),
            "out": base / "regen"}


def test_the_qwen3_recipes_regenerate_through_sglang(sglang_run):
    assert load_recipe("dspark_qwen3_8b").regen.backend == "sglang"
    assert load_recipe("eagle3_qwen3_14b").regen.backend == "sglang"
    assert load_recipe("dspark_smollm2_135m").regen.backend == "auto"
    assert sglang_run["recipe"].regen.backend == "sglang"


def test_records_hold_the_token_ids_the_server_returned(sglang_run):
    """Every answer of every record is the `token_ids` the server returned for exactly the prompt ids the HF backend
    would feed the target (the conversation so far, the target's own earlier answers included); an answer the server
    cut (finish_reason length) is marked truncated and ends its conversation. One server, started and stopped."""
    tokenizer, recipe = sglang_run["tokenizer"], sglang_run["recipe"]
    by_prompt = {tuple(e["request"]["prompt"]): e for e in sglang_run["answered"]}
    records = sglang_run["records"]
    assert len(records) == 8 and len(sglang_run["starts"]) == 1
    turns = 0
    for record in records:
        conversation = record["conversations"]
        answers = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
        assert len(answers) == len(record["response_ids"])
        for t, at in enumerate(answers):
            prompt = render_prompt_ids(tokenizer, conversation[:at], enable_thinking=recipe.regen.enable_thinking)
            served = by_prompt[tuple(prompt)]
            assert record["response_ids"][t] == served["choice"]["token_ids"]
            assert served["request"]["max_tokens"] == min(3, 128 - len(prompt))
            turns += 1
        assert record["truncated"] == (by_prompt[tuple(prompt)]["choice"]["finish_reason"] == "length")
    assert turns == len(sglang_run["answered"])  # no answer asked for and dropped
    assert {r["truncated"] for r in records} == {True, False}  # both endings were exercised
    assert any(len(r["response_ids"]) == 2 for r in records)  # a second turn replayed the first answer
    assert all(e["request"]["return_token_ids"] and e["request"]["top_k"] == -1 for e in sglang_run["answered"])
    assert sglang_run["done"]["server_startup_s"] > 0
    assert (sglang_run["out"] / "sglang-rank0.log").stat().st_size > 0
    assert not sglang_run["left"]  # nothing of the server is left


_PARSE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
names = ("model_path", "host", "port", "dtype", "context_length", "random_seed", "sampling_defaults",
         "sampling_backend", "mem_fraction_static", "skip_tokenizer_init")
results = []
for argv in json.loads(sys.argv[1]):
    try:
        args = prepare_server_args(argv)
        results.append({n: getattr(args, n) for n in names})
    except BaseException as exc:  # argparse exits on an unknown flag
        results.append({"error": f"{type(exc).__name__}: {exc}"})
print("RESULT " + json.dumps(results))
"""


def test_the_launched_command_parses_with_sglangs_own_parser(sglang_run, tiny_qwen3):
    """The argv the stage launched (after `python -m sglang.launch_server`) goes through SGLang 0.5.23's own parser:
    every flag exists and means what we meant; the same argv with a flag SGLang lacks is refused (the check bites).
    Sampling runs on SGLang's pytorch backend: its default, flashinfer, builds its sampling kernel with nvcc on the
    first sampled batch (the recipes sample), which a GPU box without a CUDA toolkit cannot."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed: pip install --no-deps -r requirements-sglang-cpu-test.txt")
    argv = sglang_run["starts"][0]["argv"]
    proc = subprocess.run([sys.executable, "-c", _PARSE, json.dumps([argv, argv + ["--no-such-flag"]])],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    parsed, refused = json.loads(lines[-1][len("RESULT "):])
    assert parsed == {"model_path": str(tiny_qwen3), "host": "127.0.0.1", "port": parsed["port"], "dtype": "float32",
                      "context_length": 128, "random_seed": 0, "sampling_defaults": "openai",
                      "sampling_backend": "pytorch", "mem_fraction_static": 0.8, "skip_tokenizer_init": False}
    assert argv[argv.index("--port") + 1] == str(parsed["port"])
    assert "SystemExit" in refused["error"] and "--no-such-flag" in proc.stderr


def test_each_ranks_server_is_started_on_its_own_gpu(tiny_qwen3, prompt_file, tmp_path, monkeypatch):
    """Rank 1 of 2 on a node where this job was given GPUs 4 and 5: its server is started with CUDA_VISIBLE_DEVICES=5
    (torch's cuda:1) and the target's GPU dtype, logs to sglang-rank1.log, and is gone after close()."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv(LOG_VAR, str(tmp_path / "fake.jsonl"))
    recipe = recipe_for(tiny_qwen3, prompt_file, engine_python(tmp_path))
    rank = Dist(rank=1, world_size=2, local_rank=1, device=torch.device("cuda", 1))
    backend = SGLangBackend(load_tokenizer(str(tiny_qwen3)), recipe.regen, 128, str(tiny_qwen3), "auto", rank,
                            tmp_path / "regen")
    try:
        (start,), _ = fake_log(tmp_path / "fake.jsonl")
    finally:
        backend.close()
    assert start["CUDA_VISIBLE_DEVICES"] == "5"
    assert start["argv"][start["argv"].index("--dtype") + 1] == "bfloat16"
    assert (tmp_path / "regen" / "sglang-rank1.log").is_file()
    assert tagged_processes(backend.server.tag) == [] and servers_logging_to(tmp_path / "fake.jsonl") == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_sglang_without_a_gpu_is_refused_before_any_work(tiny_qwen3, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--recipe", "dspark_qwen3_8b", "--stages", "regenerate", "--out", str(out)]
                + tiny_overrides(tiny_qwen3, prompt_file, **{"regen.backend": "sglang"})) == 2
    err = capsys.readouterr().err
    assert "regen.backend sglang: no CUDA device here" in err and "--set regen.backend=vllm" in err, err
    assert not out.exists()


def test_a_python_without_the_engine_is_named_before_any_work(tmp_path):
    """The engine's python must find its package, not just exist: this interpreter without site-packages (-S) has no
    sglang, and the message names it, the GPU install and the setting (test_gpu_path.py: a python whose sglang cannot
    import its server is refused too)."""
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(bare.stat().st_mode | stat.S_IXUSR)
    problem = engine_python_problem("sglang", str(bare), "regen.engine_python")
    assert problem == f"{str(bare)!r} has no sglang package: install SGLang's GPU stack there (`make venv-sglang`, or " \
                      f"`pip install -e .[sglang]` in a venv with a CUDA build of torch), or set regen.engine_python"


def test_the_qwen3_recipes_keep_their_max_concurrency_in_flight_per_server(tiny_qwen3, tmp_path, monkeypatch):
    """The Qwen3 recipes regenerate with 256 requests in flight per SGLang server (recipes/base/qwen3.yaml; 64, the
    default, leaves most of an H100's batch unused on an 8B model), and the stage really keeps that many at once: the
    fake server holds every request until no new one came for 2 s, so it sees all the client has in flight together,
    and of 300 first turns exactly 256 (not 64, nor all 300) arrive before the first answer. The states servers keep
    their own window, cache.max_concurrency (64)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Question {i}: what is {i} + {i}?"]}) + "\n"
                               for i in range(400)))
    recipe = load_recipe("dspark_qwen3_8b", [
        f"target.name_or_path={tiny_qwen3}", f"data.sources=[{{name: '{prompts}'}}]", "data.num_prompts=300",
        "data.max_length=128", "regen.max_new_tokens=3", f"regen.engine_python={engine_python(tmp_path)}"])
    assert (recipe.regen.max_concurrency, recipe.cache.max_concurrency) == (256, 64)
    assert load_recipe("dspark_smollm2_135m").regen.max_concurrency == 64
    monkeypatch.setenv(LOG_VAR, str(tmp_path / "fake.jsonl"))
    monkeypatch.setenv("FAKE_SGLANG_HOLD_S", "2")

    def no_target():
        raise AssertionError("the sglang backend must not load the target in-process")

    run_regenerate(RegenJob(recipe, tmp_path / "regen", Dist(), no_target, load_tokenizer(str(tiny_qwen3))))
    entries = [json.loads(line) for line in (tmp_path / "fake.jsonl").read_text().splitlines()]
    arrivals = [e["in_flight"] for e in entries if "in_flight" in e]
    assert len(arrivals) == 300 and len(read_records(tmp_path / "regen")) == 300
    assert max(arrivals) == recipe.regen.max_concurrency
    assert servers_logging_to(tmp_path / "fake.jsonl") == []
