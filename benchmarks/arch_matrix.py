"""The target-architecture matrix (issue 48): a tiny random target of each architecture data/assets.py
`make_tiny_target` writes (transformers' own config classes, the Qwen3 tokenizer, no hub) through every stage, and
each export read by both engines' own code beside that target's config. Prints the table: architecture x stage x
engine, each cell `pass`, `refused` (with the reason, numbered below the table) or `FAIL`.

    python benchmarks/arch_matrix.py --out runs/arch-matrix                        # ~25 min on 2 CPU cores
    python benchmarks/arch_matrix.py --out runs/arch-matrix --arch gemma3,qwen3-next

Per architecture (hidden 64, 4 decoder layers; the drafters read layers 0-2, the engines cannot capture the last):
regenerate and cache once (the dspark_qwen3_8b recipe's keys, in-process hf regeneration, 8 prompts); train each
family (dspark, dflash, eagle3) from the cache and dspark online (train.hidden_states: online); eval each (its
exact_match, the loop's output against the target's own greedy output, must be 1.0); the export stage (SGLang's
checkpoint) and export/main.py's vLLM export. A combination an engine cannot serve is refused up front (the pipeline's
export check, export_draft) naming why; the engine's own code then decides whether it could:

* SGLang 0.5.23 (this venv; tests/sglang_cpu_stub.py stands in for its CUDA kernels): the target's class from its
  model registry has the hidden-state capture the algorithm needs; the printed serve command through its argument
  parser; the target's ModelConfig; the draft's class built from the export's config, its weights loaded, and
  target-width hidden states projected through its fc; the draft's width and vocabulary are the target's, and its
  rope rotates its whole head (as DraftSmith's drafter layers do).
* vLLM 0.32 ($DRAFTSMITH_VLLM_PYTHON, else `make venv-vllm`'s): the target's ModelConfig and class (SupportsEagle3);
  the export through SpeculativeConfig; the draft's class built, loaded (process_weights_after_loading) and its fc
  fed target-width states; width, vocabulary and rope as for SGLang.

A refusal is `refused` only where the engine's code agrees; a refusal it would not make, an export it cannot read,
or a stage that fails is a FAIL. Writes OUT/matrix.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("dspark", "dflash", "eagle3")
# Families the matrix leaves out, and why (tests/test_family_seam.py holds FAMILIES + these to core/recipe.py's):
# DFlash2 is the DFlash backbone, which the matrix runs on every architecture, plus a selector that reads no target
# state.
MATRIX_LEAVES_OUT = {"dflash2": "the DFlash backbone (run here) plus a selector that reads no target state"}
ENGINE_COLUMNS = {"sglang": "SGLang", "vllm": "vLLM"}
LAYER_IDS = [0, 1, 2]
# the tiny runs' recipe keys (as tests/conftest.py tiny_overrides and tests/test_trainer.py TRAIN)
SETS = {"target.layer_ids": "[0, 1, 2]", "data.num_prompts": 8, "data.min_loss_tokens": 1, "data.max_length": 128,
        "regen.backend": "hf", "regen.max_new_tokens": 6, "regen.batch_size": 3, "cache.records_per_shard": 3,
        "cache.batch_size": 2, "draft.num_layers": 1, "draft.num_anchors": 6, "draft.block_size": 3,
        "draft.draft_vocab_size": 512, "draft.ttt_length": 3, "train.global_batch_size": 2,
        "train.micro_batch_size": 1, "train.max_steps": 2, "train.save_every": 2, "train.log_every": 1,
        "train.zero_stage": 0, "eval.allow_training_prompts": "true", "eval.num_samples": 1,
        "eval.max_new_tokens": 12, "eval.ngram_baseline": "false"}
PROMPTS = [{"turns": [f"Question {i}: what is {i} + {i}? Answer in one sentence, then explain."]} for i in range(8)]


def columns() -> list[str]:
    return (["regenerate", "cache", "online"] + [f"train {f}" for f in FAMILIES] + [f"eval {f}" for f in FAMILIES]
            + [f"{name} {f}" for name in ENGINE_COLUMNS.values() for f in FAMILIES])


def recipe_args(family: str, target: Path, prompts: Path, out: Path, stages: str, **extra) -> list[str]:
    values = {**SETS, "target.name_or_path": str(target), "data.sources": f"[{{name: '{prompts}'}}]",
              "eval.dataset": str(prompts), **extra}
    if family == "dspark":
        values["draft.markov_rank"] = 8
    return ["--recipe", f"{family}_qwen3_8b", "--stages", stages, "--out", str(out)] + [
        arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def run_stage(args: list[str]) -> tuple[str, str]:
    """(cell, what the run printed on stderr): pipeline.main in this process."""
    from pipeline import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = main(args)
    except Exception as exc:  # a stage's failure is the cell's finding
        return f"FAIL: {type(exc).__name__}: {str(exc)[:300]}", err.getvalue()
    if code != 0:
        refusal = next((line.strip() for line in err.getvalue().splitlines() if "--stages export:" in line), None)
        return (f"refused: {refusal.removeprefix('--stages export: ')}" if refusal
                else f"FAIL: exit {code}: {err.getvalue()[-300:]}"), err.getvalue()
    return "pass", err.getvalue()


def architecture_cells(arch: str, out: Path, prompts: Path) -> tuple[dict, list[dict]]:
    """One architecture's DraftSmith cells, and the engine jobs its exports (or refusals) leave."""
    from benchmarks.harness import link_data
    from core.io import read_json
    from data.assets import make_tiny_target
    from export.convert import ExportJob, export_draft
    from export.serving import serve_command

    cells: dict[str, str] = {}
    target = Path(make_tiny_target(out / "targets" / arch, arch))
    runs = out / "runs" / arch
    base = runs / "dspark"
    cells["regenerate"], _ = run_stage(recipe_args("dspark", target, prompts, base, "regenerate"))
    cells["cache"], _ = run_stage(recipe_args("dspark", target, prompts, base, "cache"))
    link_data(base, runs / "online", ("regen",))
    cells["online"], _ = run_stage(recipe_args("dspark", target, prompts, runs / "online", "train",
                                               **{"train.hidden_states": "online"}))
    jobs = []
    for family in FAMILIES:
        run = runs / family
        if family != "dspark":
            link_data(base, run)
        cells[f"train {family}"], _ = run_stage(recipe_args(family, target, prompts, run, "train"))
        cells[f"eval {family}"], _ = run_stage(recipe_args(family, target, prompts, run, "eval"))
        if cells[f"eval {family}"] == "pass" and read_json(run / "eval" / "report.json")["exact_match"] != 1.0:
            cells[f"eval {family}"] = "FAIL: the loop's output differs from the target's own greedy output"
        final = run / "train" / "final"
        sglang, _ = run_stage(recipe_args(family, target, prompts, run, "export"))
        export = run / "export" / "sglang"
        jobs.append({"cell": [arch, f"SGLang {family}"], "engine": "sglang", "refusal": sglang, "target": str(target),
                     "algorithm": family, "layer_ids": LAYER_IDS,
                     "export": str(export) if sglang == "pass" else None,
                     "command": serve_command(final, "sglang", export, str(target)) if sglang == "pass" else None})
        try:
            vllm = export_draft(ExportJob(final, "vllm", run / "export-vllm", verifier=str(target), overwrite=True))
            refusal = "pass"
        except Exception as exc:
            vllm, refusal = None, (f"refused: {str(exc).removeprefix('cannot export: ')}"
                                   if str(exc).startswith("cannot export:") else f"FAIL: {type(exc).__name__}: {exc}")
        jobs.append({"cell": [arch, f"vLLM {family}"], "engine": "vllm", "refusal": refusal, "target": str(target),
                     "algorithm": family, "layer_ids": LAYER_IDS, "export": str(vllm) if vllm else None})
    return cells, jobs


def engine_verdicts(jobs: list[dict], out: Path, vllm_python: str) -> dict[tuple[str, str], str]:
    """Each job's cell once the engine's own code has read it (or judged the target it was refused beside)."""
    from core.io import atomic_write_text

    pythons = {"sglang": sys.executable, "vllm": vllm_python}
    verdicts = {}
    for engine, python in pythons.items():
        mine = [job for job in jobs if job["engine"] == engine]
        request = out / f"{engine}-jobs.json"
        atomic_write_text(request, json.dumps(mine))
        if not Path(python).is_file():
            found = {}
            missing = f"FAIL: no {engine} python at {python}"
        else:
            done = subprocess.run([python, str(Path(__file__).resolve()), f"--{engine}-side", str(request)],
                                  capture_output=True, text=True, timeout=1800, cwd="/tmp",
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            found = json.loads(lines[-1][len("RESULT "):]) if lines else {}
            missing = f"FAIL: the {engine} reader failed: {done.stderr[-500:]}"
        for i, job in enumerate(mine):
            verdicts[tuple(job["cell"])] = judge(job, found.get(str(i)), missing)
    return verdicts


def judge(job: dict, read: dict | None, missing: str) -> str:
    """A cell from DraftSmith's export (or refusal) and the engine's reading of it."""
    if read is None:
        return missing
    if job["refusal"].startswith("FAIL"):
        return job["refusal"]
    if read.get("error"):
        return f"FAIL: {read['error'][:300]}"
    if job["refusal"].startswith("refused"):
        return job["refusal"] if not read["captures"] else \
            f"FAIL: refused, but {read['class']} has the capture the engine needs"
    return "pass" if read["captures"] else f"FAIL: exported, but {read['class']} cannot capture the hidden states"


def run_matrix(out: Path, archs: list[str], vllm_python: str) -> dict[str, dict[str, str]]:
    """{architecture: {column: cell}} (columns()), also written to OUT/matrix.json."""
    from core.io import atomic_write_text

    prompts = out / "prompts.jsonl"
    atomic_write_text(prompts, "".join(json.dumps(row) + "\n" for row in PROMPTS))
    matrix, jobs = {}, []
    for arch in archs:
        start = time.perf_counter()
        matrix[arch], more = architecture_cells(arch, out, prompts)
        jobs += more
        print(f"[arch-matrix] {arch}: {time.perf_counter() - start:.0f} s", flush=True)
    for (arch, column), cell in engine_verdicts(jobs, out, vllm_python).items():
        matrix[arch][column] = cell
    atomic_write_text(out / "matrix.json", json.dumps(matrix, indent=2) + "\n")
    return matrix


def markdown(matrix: dict[str, dict[str, str]]) -> str:
    """The table, each refusal's and failure's reason numbered below it."""
    notes: list[str] = []

    def short(cell: str) -> str:
        if cell == "pass":
            return "pass"
        kind, _, why = cell.partition(": ")
        engine, _, rest = why.partition(" cannot serve ")
        hook = re.search(r"its (\S+) class has ([^,]+),", rest)
        if kind == "refused" and hook:  # the engine's missing capture: the same for each family it refuses
            why = f"{engine}: {hook[1]} has {hook[2]}, through which the engine hands a drafter the target's states"
        if why not in notes:
            notes.append(why)
        return f"{kind} ({notes.index(why) + 1})"

    head = ["architecture"] + columns()
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([arch] + [short(cells.get(c, "FAIL: not run")) for c in columns()]) + " |"
              for arch, cells in matrix.items()]
    return "\n".join(lines + [""] + [f"{i}. {why}" for i, why in enumerate(notes, 1)])


# --- the engines' side (run with that engine's python) ------------------------------------------------------------


def _hidden_states(width: int, dtype):
    import torch

    return torch.randn(5, width, dtype=dtype, generator=torch.Generator().manual_seed(0))


def sglang_read(job: dict) -> dict:
    """SGLang's own registry, argument parser, configs and draft classes on one job (captures: whether the target's
    class has the hidden-state capture the algorithm needs, as SGLang's configure_aux_hidden_state_capture asks)."""
    from safetensors.torch import load_file
    from sglang.srt.configs.model_config import ModelConfig, _get_and_verify_dtype
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.hf_transformers.config import get_config

    target = get_config(job["target"], trust_remote_code=False)
    cls = ModelRegistry.resolve_model_cls(target.architectures)[0]
    hooks = ("set_eagle3_layers_to_capture",) if job["algorithm"] == "eagle3" else (
        "set_dflash_layers_to_capture", "set_dspark_layers_to_capture")
    result = {"class": cls.__name__, "captures": any(hasattr(cls, hook) for hook in hooks), "error": None}
    if job["export"] is None:
        return result
    words = shlex.split(job["command"])
    start = words.index("python")
    os.environ.update(dict(word.split("=", 1) for word in words[:start]))
    args = prepare_server_args(words[start + 3:])
    target_config = ModelConfig.from_server_args(args)
    draft = get_config(args.speculative_draft_model_path, trust_remote_code=False)
    dtype = _get_and_verify_dtype(draft, args.dtype)
    with set_default_torch_dtype(dtype):
        model = ModelRegistry.resolve_model_cls(draft.architectures)[0](draft)
    model.load_weights(list(load_file(str(Path(job["export"]) / "model.safetensors")).items()))
    width = len(job["layer_ids"]) * target_config.hidden_size
    hidden = _hidden_states(width, _get_and_verify_dtype(target_config.hf_config, args.dtype))
    out = model.model.fc(hidden) if job["algorithm"] == "eagle3" else model.project_target_hidden(hidden)
    out = out[0] if isinstance(out, tuple) else out
    if (draft.hidden_size, draft.vocab_size) != (target_config.hidden_size, target_config.vocab_size) \
            or tuple(out.shape) != (5, target_config.hidden_size):
        result["error"] = (f"draft width/vocabulary {draft.hidden_size}/{draft.vocab_size}, target's "
                           f"{target_config.hidden_size}/{target_config.vocab_size}, fc gave {tuple(out.shape)}")
    result["error"] = result["error"] or partial_rotation(model)
    return result


def partial_rotation(model) -> str | None:
    """What a drafter built by an engine rotates short of its whole head (DraftSmith's drafter layers rotate all of
    it): the engines' get_rope rotates rope_parameters' partial_rotary_factor of it."""
    short = {(m.rotary_dim, m.head_size) for m in model.modules()
             if hasattr(m, "rotary_dim") and hasattr(m, "head_size") and m.rotary_dim != m.head_size}
    return f"the drafter's rope rotates {short} (rotary_dim, head_size): part of its heads" if short else None


def vllm_read(job: dict) -> dict:
    """vLLM's own configs, registry and draft classes on one job (captures: the target's class implements
    SupportsEagle3, through which vLLM hands every drafter the target's hidden states)."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import (DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.utils.torch_utils import set_default_torch_dtype

    target = ModelConfig(model=job["target"], tokenizer=job["target"], max_model_len=256)
    if not any(ModelRegistry._try_load_model_cls(a) for a in target.architectures):  # no class: it captures nothing
        return {"class": None, "captures": False, "error": None}
    cls, _ = ModelRegistry.resolve_model_cls(target.architectures, model_config=target)
    result = {"class": cls.__name__, "captures": supports_eagle3(cls), "error": None}
    if job["export"] is None:
        return result
    parallel = ParallelConfig()
    spec = SpeculativeConfig(model=job["export"], method=job["algorithm"], num_speculative_tokens=3,
                             target_model_config=target, target_parallel_config=parallel)
    config = VllmConfig(model_config=target, parallel_config=parallel, device_config=DeviceConfig("cpu"))
    # set after validation: vLLM's CPU model runner (V1) refuses DSpark, which its GPU runner (V2) serves
    object.__setattr__(config, "speculative_config", spec)
    draft = spec.draft_model_config
    draft_cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, model_config=draft)
    with set_current_vllm_config(config), set_default_torch_dtype(draft.dtype):
        model = draft_cls(vllm_config=config, prefix="")
    model.load_weights(iter(load_file(str(Path(job["export"]) / "model.safetensors")).items()))
    process_weights_after_loading(model, draft, torch.device("cpu"))
    out = model.combine_hidden_states(_hidden_states(len(job["layer_ids"]) * target.get_hidden_size(), draft.dtype))
    if (draft.get_hidden_size(), draft.get_vocab_size()) != (target.get_hidden_size(), target.get_vocab_size()) \
            or tuple(out.shape) != (5, target.get_hidden_size()):
        result["error"] = (f"draft width/vocabulary {draft.get_hidden_size()}/{draft.get_vocab_size()}, target's "
                           f"{target.get_hidden_size()}/{target.get_vocab_size()}, fc gave {tuple(out.shape)}")
    result["error"] = result["error"] or partial_rotation(model)
    return result


def engine_side(engine: str, request: Path) -> dict:
    import traceback

    sys.path.insert(0, str(ROOT))  # core.server's free_port on either side
    if engine == "sglang":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        sys.path.insert(0, str(ROOT / "tests"))
        import sglang_cpu_stub

        sglang_cpu_stub.install()
        sglang_cpu_stub.init_single_process_dist()
        read = sglang_read
    else:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        from core.server import free_port

        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            initialize_model_parallel(1, 1)
        read = vllm_read
    found = {}
    for i, job in enumerate(json.loads(request.read_text())):
        try:
            found[str(i)] = read(job)
        except BaseException as exc:  # one job's failure is its cell's, not the others'
            found[str(i)] = {"class": None, "captures": None,
                             "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"}
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="work folder (tiny targets, runs, matrix.json)")
    parser.add_argument("--arch", default=None, help="comma-separated architectures (default: all)")
    parser.add_argument("--sglang-side", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-side", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for engine in ENGINE_COLUMNS:
        request = getattr(args, f"{engine}_side")
        if request is not None:
            print("RESULT " + json.dumps(engine_side(engine, request)), flush=True)
            return 0
    if args.out is None:
        parser.error("--out is required")
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    from data.assets import TINY_ARCHITECTURES

    archs = args.arch.split(",") if args.arch else list(TINY_ARCHITECTURES)
    unknown = [a for a in archs if a not in TINY_ARCHITECTURES]
    if unknown:
        parser.error(f"unknown --arch {unknown}; known: {', '.join(TINY_ARCHITECTURES)}")
    from core.server import default_engine_python

    vllm_python = os.environ.get("DRAFTSMITH_VLLM_PYTHON") or default_engine_python("vllm")
    print(markdown(run_matrix(args.out.resolve(), archs, vllm_python)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
