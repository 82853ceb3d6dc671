"""The serving contract: what an export promises the engines, and the commands that serve it.

* which serving algorithm a draft runs as (`detect_algorithm`: EAGLE3, DFLASH or DSPARK);
* the SGLang 0.5.23 and vLLM command lines that serve an export (`sglang_command`, `vllm_command`, `serve_command`):
  the dtype the export declares (`declared_dtype`) named explicitly (bfloat16 on SGLang's GPU kernels for a float32
  export: `sglang_dtype`), absolute paths, with the ragged-verify mode an attention backend that implements it on the
  GPU at hand (`ragged_verify_backend`), and the chat-template mode the draft was trained in as the server's default
  (`trained_chat_template_kwargs`); `serve_notes` says what the command cannot;
* the two files a DSpark export ships for SGLang's confidence scheduler: the STS calibration
  (`--speculative-dspark-confidence-sts-path`, `save_sts` / `load_sts`, one temperature per draft position:
  `check_sts_length`) and the SPS cost table (`--speculative-dspark-sps-table-path`, `SpsTable`). eval/ computes
  their contents; this file owns their format. An SPS table ships only when it covers SGLang's verify batches
  (`check_sps_range`); otherwise `sps_profile_note` prints SGLang's own profiler, run on the serving GPU.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.io import atomic_write_json, read_json
from core.recipe import RecipeError, load_recipe
from core.server import SERVER_HOST, SERVING_ALGORITHMS, sglang_server_command, vllm_server_command
from modeling.registry import read_config
from modeling.target import load_tokenizer

# --speculative-algorithm's spelling, and vLLM's speculative-config method: both engines run DFlash2DraftModel in their
# DFLASH worker (SGLang's DFlash2DraftModel, "Reuses the DFLASH speculative worker"; vLLM's speculators reader maps
# dflash2 to method dflash), which picks the selector by the draft's architecture.
SGLANG_ALGORITHMS = {**{name: name.upper() for name in SERVING_ALGORITHMS}, "dflash2": "DFLASH"}
VLLM_METHODS = {**{name: name for name in SERVING_ALGORITHMS}, "dflash2": "dflash"}
STS_FILENAME = "sts.json"
SPS_FILENAME = "sps_table.json"
# SGLang 0.5.23 builds a DSpark draft's confidence head, reads the STS file and runs the SPS-table verify scheduler
# only when this env var is not `static` (its default). `compact` is the mode whose planner sizes each request's
# verify length from confidence x SPS (`cap-accept` keeps a fixed verify width); see sglang/srt/speculative/
# ragged_verify.py and dspark_components/dspark_planner.py in the wheel.
RAGGED_VERIFY_ENV = "SGLANG_RAGGED_VERIFY_MODE"
RAGGED_VERIFY_MODE = "compact"
# Attention backends that implement ragged verify in SGLang 0.5.23 (any mode but `static`), by the serving GPU's
# compute capability major: FlashAttentionBackend (`fa3`; its registry entry asserts SM80-SM90: A100, L40S, H100, H200)
# and TRTLLMHAAttnBackend (`trtllm_mha`, SGLang's own default on SM100: B200, GB200) set `supports_ragged_verify_graph`
# and read the ragged layout. FlashInfer, the default on A100-class GPUs, raises NotImplementedError("FlashInfer does
# not support ragged verify in cuda graph ..."); triton never reads the layout. See attention_registry.py and
# srt/layers/attention/*_backend.py in the wheel. Where no GPU is visible (an export on a CPU machine) the printed
# command says fa3, and `serve_notes` names trtllm_mha for SM100.
RAGGED_VERIFY_BACKENDS = {8: "fa3", 9: "fa3", 10: "trtllm_mha"}
NO_GPU_RAGGED_VERIFY_BACKEND = "fa3"
# FlashAttention 3 (SGLang's Hopper default and the backend above) and SGLang's other GPU attention kernels run
# fp16/bf16/fp8 only: an export declaring float32 (its target's, e.g. SmolLM2's) is served in bfloat16 (SGLang casts the
# draft's float32 weights as it loads them, and the target's).
SGLANG_FLOAT32_SERVING_DTYPE = "bfloat16"
# SGLang 0.5.23 caps a DSpark server at 48 running requests unless --max-running-requests says otherwise
# (srt/arg_groups/speculative_hook.py); each verifies up to gamma+1 tokens, so the SPS planner looks up batches of up
# to 48 x (gamma+1) tokens and clamps anything past the table's last probe to that probe's value.
SGLANG_DSPARK_MAX_RUNNING_REQUESTS = 48
SPS_PROFILER = "sglang.benchmark.dspark_sps_profiler"  # SGLang's own profiler of the serving engine's verify steps
# The server SGLang's profiler measures: static mode, recording its steps, and every draft rejected (its
# `fetch_server_context` refuses a server whose simulate_acc_len is not exactly 1.0; the value defaults to -1, off).
SPS_RECORD_ENV = {RAGGED_VERIFY_ENV: "static", "SGLANG_DSPARK_ENABLE_SPS_RECORD": "1", "SGLANG_SIMULATE_ACC_LEN": "1.0"}
# Both engines' flag for the chat-template arguments a request gets unless it sends its own.
CHAT_TEMPLATE_DEFAULTS_FLAG = "--default-chat-template-kwargs"
SERVING_DTYPES = ("bfloat16", "float16", "float32")
STS_KEYS = ("temperatures", "dataset", "num_samples", "ece_before", "ece_after")  # SGLang's DSparkStsCalibration
SPS_KEYS = ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens")  # SGLang's SpsCostTable


# Target architectures an engine cannot run a drafter beside, per algorithm: its model class for that target cannot hand
# the drafter the target's hidden states. SGLang 0.5.23 asks the target's class for `set_eagle3_layers_to_capture`
# (EAGLE3) or `set_dflash_layers_to_capture` (DFLASH, DSPARK) and refuses to start without it
# (srt/model_executor/model_runner_components/attention_backend_setup.py); vLLM 0.32 reads them, for every drafter,
# through the target class's SupportsEagle3 interface (v1/worker/gpu_model_runner.py). Read from the wheels for the
# target-architecture matrix (tests/test_arch_matrix.py checks this table against them); an architecture not listed
# is served, or not known here.
UNSERVED_TARGETS = {
    "sglang": {"MixtralForCausalLM": SERVING_ALGORITHMS, "Qwen2ForCausalLM": ("dflash", "dspark", "dflash2"),
               "Gemma3ForCausalLM": ("dflash", "dspark", "dflash2"),
               **{arch: SERVING_ALGORITHMS for arch in ("Starcoder2ForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM",
                                                         "GPT2LMHeadModel", "MiniMaxForCausalLM", "Olmo2ForCausalLM",
                                                         "CohereForCausalLM")},
               "Lfm2ForCausalLM": ("eagle3",)},
    "vllm": {"MixtralForCausalLM": SERVING_ALGORITHMS, "Gemma3ForCausalLM": SERVING_ALGORITHMS,
             **{arch: SERVING_ALGORITHMS for arch in ("GPT2LMHeadModel", "MiniMaxForCausalLM", "Lfm2ForCausalLM",
                                                       "CohereForCausalLM")}},
}
# Targets an engine has no model class for at all (not a missing capture): vLLM 0.32 has MiniMax-Text-01's under
# another architecture name only.
ABSENT_TARGETS = {"sglang": (), "vllm": ("MiniMaxForCausalLM",)}
_HIDDEN_STATES_HOOK = {("sglang", "eagle3"): "no set_eagle3_layers_to_capture",
                       ("sglang", "dflash"): "no set_dflash_layers_to_capture",
                       ("sglang", "dflash2"): "no set_dflash_layers_to_capture",
                       ("sglang", "dspark"): "no set_dflash_layers_to_capture",
                       **{("vllm", a): "no SupportsEagle3 interface" for a in SERVING_ALGORITHMS}}
ENGINE_NAMES = {"sglang": "SGLang 0.5.23", "vllm": "vLLM 0.32"}


def unserved_target(engine: str, algorithm: str, architecture: str | None) -> str | None:
    """Why `engine` cannot serve an `algorithm` draft beside a target whose config names `architecture` (its
    `architectures[0]`), and where such a draft is served instead; None when it can, or the architecture is not known
    here."""
    def served(engine_: str, algorithm_: str) -> bool:
        return algorithm_ not in UNSERVED_TARGETS[engine_].get(architecture, ())

    if served(engine, algorithm):
        return None
    engines = [e for e in UNSERVED_TARGETS if served(e, algorithm)]
    families = [a for a in SERVING_ALGORITHMS if any(served(e, a) for e in UNSERVED_TARGETS)]
    instead = (f"serve it with {ENGINE_NAMES[engines[0]]} (--to {engines[0]})" if engines else
               f"no engine here serves it; {' and '.join(a.upper() for a in families)} drafts are served beside it"
               if families else "no engine here serves any drafter beside it")
    if architecture in ABSENT_TARGETS[engine]:
        return (f"{ENGINE_NAMES[engine]} cannot serve the {algorithm.upper()} draft beside a {architecture} target: "
                f"its model registry has no class for {architecture} (the server would not load the target); {instead}")
    return (f"{ENGINE_NAMES[engine]} cannot serve the {algorithm.upper()} draft beside a {architecture} target: its "
            f"{architecture} class has {_HIDDEN_STATES_HOOK[engine, algorithm]}, through which the engine hands a "
            f"drafter the target's hidden states (the server would refuse to start); {instead}")


# ---------------------------------------------------------------------------------------------------------------------
# Which algorithm, and the commands that serve it


def serves_as_dflash(cfg: dict) -> bool:
    """Whether a block draft's config is what SGLang DFLASH runs: the 1+N layout (sample_from_anchor=False),
    markov_rank 0 and no confidence head. Every other block draft serves as DSPARK."""
    return (cfg.get("sample_from_anchor") is False and int(cfg.get("markov_rank", 0) or 0) == 0
            and not cfg.get("enable_confidence_head"))


def detect_algorithm(cfg: dict) -> str:
    """eagle3 | dflash | dspark | dflash2 from config `architectures[0]` and the block-draft flags
    (`serves_as_dflash`; a candidate selector, selector_rank > 0, is DFlash2)."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch == "LlamaForCausalLMEagle3":
        return "eagle3"
    if arch == "DFlash2DraftModel" or (arch == "Qwen3DSparkModel" and int(cfg.get("selector_rank", 0) or 0) > 0):
        return "dflash2"
    if arch in ("Qwen3DSparkModel", "DFlashDraftModel"):
        return "dflash" if serves_as_dflash(cfg) else "dspark"
    raise ValueError(f"config architectures[0]={arch!r}: expected LlamaForCausalLMEagle3 or Qwen3DSparkModel")


@dataclass(frozen=True)
class ServedDraft:
    """A draft as an engine serves it: its exported folder, the serving algorithm, the tokens it drafts a round, and
    (SGLang DSpark) the STS calibration and SPS table files served beside it."""

    path: Path
    algorithm: str
    num_tokens: int
    sts_path: Path | None = None
    sps_path: Path | None = None


def vllm_command(python: str, target: str, draft: ServedDraft, port: int, *, dtype: str = "float32",
                 max_model_len: int = 2048, extra: tuple[str, ...] = ()) -> list[str]:
    spec = {"model": str(draft.path), "method": VLLM_METHODS.get(draft.algorithm, draft.algorithm),
            "num_speculative_tokens": draft.num_tokens}
    return vllm_server_command(python, target, port, dtype=dtype, max_model_len=max_model_len,
                               extra=("--speculative-config", json.dumps(spec), *extra))


def sglang_command(python: str, target: str, draft: ServedDraft, port: int, *, dtype: str,
                   attention_backend: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """`python -m sglang.launch_server` for an exported draft. DFLASH/DSPARK read their block size from the draft's
    config; EAGLE3 is a chain of `num_tokens` steps (top-k 1). `dtype` is the one to serve in (`sglang_dtype` of the
    export's `declared_dtype`): SGLang builds the draft with the server's --dtype, and under `auto` it would run a draft
    whose config names none in float16 beside a bfloat16 target, whose hidden states its fc does not cast. The DSpark
    STS/SPS files only take effect with `sglang_env`'s ragged-verify mode set in the server's environment, which needs
    an `attention_backend` that implements it (`ragged_verify_backend`)."""
    draft_dir, algorithm, num_tokens, sts_path, sps_path = (draft.path, draft.algorithm, draft.num_tokens,
                                                            draft.sts_path, draft.sps_path)
    argv = sglang_server_command(python, target, port, dtype=dtype,
                                 extra=("--speculative-algorithm", SGLANG_ALGORITHMS[algorithm],
                                        "--speculative-draft-model-path", str(draft_dir)))
    if attention_backend is not None:
        argv += ["--attention-backend", attention_backend]
    if algorithm == "eagle3":
        argv += ["--speculative-num-steps", str(num_tokens), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(num_tokens + 1)]
    if algorithm == "dspark" and sts_path is not None:
        argv += ["--speculative-dspark-confidence-sts-path", str(sts_path)]
    if algorithm == "dspark" and sps_path is not None:
        argv += ["--speculative-dspark-sps-table-path", str(sps_path)]
    return argv + list(extra)


def sglang_dtype(declared: str | None) -> str:
    """The --dtype SGLang serves an export in on a GPU: its declared one, bfloat16 for float32 (no GPU attention kernel
    of SGLang's runs float32: `SGLANG_FLOAT32_SERVING_DTYPE`), `auto` for an old export that declares none."""
    if declared == "float32":
        return SGLANG_FLOAT32_SERVING_DTYPE
    return declared or "auto"


def local_gpu_capability() -> tuple[int, int] | None:
    """This machine's first GPU's compute capability, None without one: the serve command is printed for it."""
    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def ragged_verify_backend(capability: tuple[int, int] | None) -> str | None:
    """The attention backend that runs ragged verify on a GPU of `capability` (`RAGGED_VERIFY_BACKENDS`), fa3 where no
    GPU is visible, None on a GPU none of SGLang 0.5.23's is known to run it on (`serve_notes` says so)."""
    if capability is None:
        return NO_GPU_RAGGED_VERIFY_BACKEND
    return RAGGED_VERIFY_BACKENDS.get(capability[0])


def sglang_env(cfg: dict, algorithm: str) -> dict[str, str]:
    """Environment SGLang needs to serve everything a draft exports: the ragged-verify mode for a DSpark draft with a
    confidence head (under the default `static` SGLang builds no confidence head, ignores the STS and SPS files and
    verifies every draft). Empty otherwise: `compact` refuses a DSpark draft without a confidence head."""
    if algorithm == "dspark" and cfg.get("enable_confidence_head"):
        return {RAGGED_VERIFY_ENV: RAGGED_VERIFY_MODE}
    return {}


def sglang_serving_files(cfg: dict, algorithm: str, export_dir: Path) -> tuple[Path | None, Path | None]:
    """(sts, sps) files of an export that SGLang should be given: those present, for a DSpark draft whose confidence
    head SGLang builds (see `sglang_env`)."""
    if not sglang_env(cfg, algorithm):
        return None, None
    sts, sps = Path(export_dir) / STS_FILENAME, Path(export_dir) / SPS_FILENAME
    return (sts if sts.is_file() else None), (sps if sps.is_file() else None)


def declared_dtype(cfg: dict) -> str | None:
    """The dtype an export's config.json declares, as SGLang's `_get_and_verify_dtype` and transformers read it
    (`dtype`, else the older `torch_dtype`; a speculators config for vLLM on its transformer_layer_config, the part
    vLLM builds the draft's config from); None when it names none."""
    cfg = cfg.get("transformer_layer_config") or cfg
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return None if value is None else str(value).removeprefix("torch.")


def gamma_of(cfg: dict, algorithm: str) -> int:
    """Tokens a trained draft proposes per round: Eagle3's chain length, a block draft's block_size."""
    return int(cfg.get("ttt_length", 7) if algorithm == "eagle3" else cfg["block_size"])


def run_folder(checkpoint_dir) -> Path | None:
    """The pipeline run a draft folder belongs to: runs/R for runs/R/train/final or runs/R/opd/final (a folder
    holding the run's recipe.yaml); None for any other folder."""
    checkpoint_dir = Path(checkpoint_dir).resolve()
    run = checkpoint_dir.parent.parent
    if checkpoint_dir.name == "final" and checkpoint_dir.parent.name in ("train", "opd") \
            and (run / "recipe.yaml").is_file():
        return run
    return None


def run_recipe(checkpoint_dir):
    """The recipe of the run a draft folder belongs to (its recipe.yaml), None outside a run."""
    run = run_folder(checkpoint_dir)
    if run is None:
        return None
    try:
        return load_recipe(str(run / "recipe.yaml"))
    except RecipeError:
        return None


@functools.lru_cache(maxsize=None)
def switches_thinking(target: str) -> bool:
    """Whether the target's chat template reads `enable_thinking` (Qwen3's thinks unless a request says otherwise);
    False when its tokenizer cannot be read here."""
    try:
        template = load_tokenizer(target).chat_template
    except Exception:  # noqa: BLE001 -- a hub id not cached offline, a folder without a tokenizer: no note, no flag
        return False
    return template_switches_thinking(template)


def template_switches_thinking(template: str | None) -> bool:
    return "enable_thinking" in str(template or "")


def trained_chat_template_kwargs(checkpoint_dir, target: str | None) -> dict | None:
    """{"enable_thinking": x}, the mode the draft's training conversations were rendered in (its run's
    regen.enable_thinking), when the target's chat template has that switch: the serve command makes it every request's
    default, since a request in the other mode gets answers the draft never learned (a lower accept length). None when
    the template has no switch or the draft belongs to no run."""
    recipe = run_recipe(checkpoint_dir)
    if recipe is None:
        return None
    template = recipe.target.chat_template
    if not (template_switches_thinking(Path(template).expanduser().read_text()) if template else
            switches_thinking(target or recipe.target.name_or_path)):
        return None
    return {"enable_thinking": recipe.regen.enable_thinking}


def trained_chat_template(checkpoint_dir) -> str | None:
    """The chat template file the draft's run rendered its conversations with instead of the tokenizer's own (its
    recipe's target.chat_template), absolute: the engine must render requests with it too (`--chat-template`)."""
    recipe = run_recipe(checkpoint_dir)
    template = recipe.target.chat_template if recipe is not None else None
    return str(Path(template).expanduser().resolve()) if template else None


def _serve_argv(checkpoint_dir, to: str, out_dir, target: str | None, algorithm: str | None
                ) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) that serve the export at `out_dir` on this machine's GPU: absolute paths (the server may
    start elsewhere), the export's own dtype named explicitly, the trained chat-template mode as the default."""
    cfg = read_config(checkpoint_dir)
    algorithm = algorithm or detect_algorithm(cfg)
    gamma = gamma_of(cfg, algorithm)
    out_dir = Path(out_dir).resolve()
    declared = declared_dtype(read_config(out_dir))
    chat = trained_chat_template_kwargs(checkpoint_dir, target)
    extra = (CHAT_TEMPLATE_DEFAULTS_FLAG, json.dumps(chat)) if chat else ()
    template = trained_chat_template(checkpoint_dir)
    extra += ("--chat-template", template) if template else ()  # both engines take a template file
    target = str(Path(target).resolve()) if target and Path(target).exists() else target or "<target model path or id>"
    if to == "vllm":
        return {}, vllm_command("python", target, ServedDraft(out_dir, algorithm, gamma), 8000,
                                dtype=declared or "auto", extra=extra)
    env = sglang_env(cfg, algorithm)
    sts, sps = sglang_serving_files(cfg, algorithm, out_dir)
    backend = ragged_verify_backend(local_gpu_capability()) if env else None
    return env, sglang_command("python", target, ServedDraft(out_dir, algorithm, gamma, sts, sps), 30000,
                               dtype=sglang_dtype(declared), attention_backend=backend, extra=extra)


def _shell(env: dict[str, str], argv: list[str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv])


def serve_command(checkpoint_dir, to: str, out_dir, target: str | None = None, algorithm: str | None = None) -> str:
    """The shell command that serves the export at `out_dir` (made from the trained draft in `checkpoint_dir`, as
    `algorithm`: the one export_draft was given, None when it detected it), environment assignments first."""
    return _shell(*_serve_argv(checkpoint_dir, to, out_dir, target, algorithm))


def sps_profile_note(checkpoint_dir, to: str, out_dir, target: str | None = None, algorithm: str | None = None
                     ) -> str | None:
    """For an SGLang export whose confidence scheduler runs without an SPS table: why none ships, and SGLang's own
    profiler that makes one on the serving GPU (a server in `static` mode recording its steps with every draft
    rejected, `SPS_RECORD_ENV`, the profiler up to SGLang's default running-request cap, then the serve command with
    the table). None when nothing is missing."""
    env, argv = _serve_argv(checkpoint_dir, to, out_dir, target, algorithm)
    if to != "sglang" or not env or "--speculative-dspark-sps-table-path" in argv:
        return None
    cfg = read_config(checkpoint_dir)
    gamma = gamma_of(cfg, algorithm or detect_algorithm(cfg))
    out_dir = Path(out_dir).resolve()
    table = out_dir.parent / f"{out_dir.name}-sps" / SPS_FILENAME  # the profiler writes records beside it
    port = argv[argv.index("--port") + 1]
    profile = ["python", "-m", SPS_PROFILER, "all", "--base-url", f"http://127.0.0.1:{port}", "--max-batch-size",
               str(SGLANG_DSPARK_MAX_RUNNING_REQUESTS), "--out", str(table)]
    return (f"No SPS table ships with this export: DraftSmith's eval times its own batch-1 loop, while SGLang's "
            f"planner looks up verify steps of up to {SGLANG_DSPARK_MAX_RUNNING_REQUESTS} running requests x "
            f"(gamma+1) = {sglang_max_verify_tokens(gamma)} tokens on the serving GPU. Without one SGLang verifies "
            f"every draft (no scheduling gain). To profile one on that GPU, start the server in static mode, recording "
            f"its steps, every draft rejected:\n  {_shell(SPS_RECORD_ENV, argv)}\nrun SGLang's profiler against it:\n"
            f"  {_shell({}, profile)}\nthen serve with the table:\n"
            f"  {_shell(env, argv + ['--speculative-dspark-sps-table-path', str(table)])}")


def serve_notes(checkpoint_dir, to: str, out_dir, target: str | None = None, algorithm: str | None = None
                ) -> list[str]:
    """What the printed serve command chose and cannot say itself: that it listens on this machine only, a float32
    export served in bfloat16 by SGLang, the attention backend for another GPU than this machine's, the chat-template
    mode the draft was trained in, and the SPS profiling recipe (`sps_profile_note`)."""
    env, _ = _serve_argv(checkpoint_dir, to, out_dir, target, algorithm)
    notes = [f"The command binds --host {SERVER_HOST}: only clients on the serving machine reach it. For clients on "
             f"other machines serve with --host 0.0.0.0 (every interface: anyone who reaches the port can use the "
             f"server, so add --api-key or keep the port behind a firewall)"]
    if to == "sglang" and declared_dtype(read_config(out_dir)) == "float32":
        notes.append("The export declares float32, its target's dtype; SGLang's GPU attention kernels (FlashAttention 3, "
                     "its Hopper default, among them) run fp16/bf16 only, so the command serves target and draft in "
                     "bfloat16 (SGLang casts the float32 weights as it loads them): expect bf16 rounding against a "
                     "float32 eval")
    if to == "sglang" and env:
        capability = local_gpu_capability()
        if capability is None:
            notes.append(f"No GPU is visible here, so the command names --attention-backend "
                         f"{NO_GPU_RAGGED_VERIFY_BACKEND} for ragged verify: it runs on SM80-SM90 (A100, L40S, H100, "
                         f"H200); on SM100 (B200, GB200) serve with --attention-backend {RAGGED_VERIFY_BACKENDS[10]} "
                         f"instead (fa3 asserts there)")
        elif ragged_verify_backend(capability) is None:
            notes.append(f"No attention backend of SGLang 0.5.23 is known to run ragged verify on this SM"
                         f"{capability[0]}{capability[1]} GPU (fa3: SM80-SM90, trtllm_mha: SM100): the command leaves "
                         f"the backend to SGLang's default, which may refuse {RAGGED_VERIFY_ENV}={RAGGED_VERIFY_MODE}")
    notes += _thinking_notes(checkpoint_dir, target)
    sps = sps_profile_note(checkpoint_dir, to, out_dir, target, algorithm)
    return notes + ([sps] if sps else [])


def _thinking_notes(checkpoint_dir, target: str | None) -> list[str]:
    chat = trained_chat_template_kwargs(checkpoint_dir, target)
    if chat is not None:
        mode = "with thinking" if chat["enable_thinking"] else "without thinking"
        return [f"This draft was trained on answers generated {mode} (enable_thinking: "
                f"{str(chat['enable_thinking']).lower()}), and the target's chat template switches on it: the command "
                f"makes that every request's default ({CHAT_TEMPLATE_DEFAULTS_FLAG}). A client that sends "
                f"chat_template_kwargs {{\"enable_thinking\": {str(not chat['enable_thinking']).lower()}}} gets answers "
                f"the draft did not learn, and a lower accept length than the eval reported"]
    if target and switches_thinking(target):
        return ["The target's chat template switches thinking (enable_thinking) and this draft is not in a run folder, "
                "so the mode it was trained in is unknown here: add "
                f"{CHAT_TEMPLATE_DEFAULTS_FLAG} '{{\"enable_thinking\": false}}' to the command if its answers were "
                "generated without thinking (the Qwen3 recipes'), so that clients get that mode by default"]
    return []


# ---------------------------------------------------------------------------------------------------------------------
# The STS calibration file


def _floats(values, name: str) -> list[float]:
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().double().numpy()
    try:
        return [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be numeric (array, tensor or list): {err}") from err


@dataclass(frozen=True)
class StsCalibration:
    """The contents of an SGLang ``--speculative-dspark-confidence-sts-path`` file; None = key absent."""

    temperatures: list[float]
    dataset: str | None = None
    num_samples: int | None = None
    ece_before: list[float] | None = None
    ece_after: list[float] | None = None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _validate_sts(obj) -> StsCalibration:
    if not isinstance(obj, dict):
        raise ValueError(f"an STS file must hold a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(STS_KEYS))
    if unknown:
        raise ValueError(f"unknown STS keys {unknown} (SGLang would silently ignore them); allowed: {list(STS_KEYS)}")
    temps = obj.get("temperatures")
    if not isinstance(temps, list) or not temps:
        raise ValueError("'temperatures' must be a non-empty list with one float per draft position")
    for i, t in enumerate(temps):
        if not _is_number(t) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperatures[{i}] must be a finite number > 0, got {t!r}")
    dataset = obj.get("dataset")
    if dataset is not None and not isinstance(dataset, str):
        raise ValueError(f"'dataset' must be a string, got {dataset!r}")
    num_samples = obj.get("num_samples")
    if num_samples is not None and (not isinstance(num_samples, int) or isinstance(num_samples, bool)
                                    or num_samples < 0):
        raise ValueError(f"'num_samples' must be an int >= 0, got {num_samples!r}")
    for key in ("ece_before", "ece_after"):
        values = obj.get(key)
        if values is None:
            continue
        if not isinstance(values, list) or len(values) != len(temps):
            n = len(values) if isinstance(values, list) else type(values).__name__
            raise ValueError(f"'{key}' must be a list with one entry per temperature ({len(temps)}), got {n}")
        for i, v in enumerate(values):
            if not _is_number(v) or not math.isfinite(v):
                raise ValueError(f"{key}[{i}] must be a finite number (JSON has no NaN; a position without held-out "
                                 f"rounds has no ECE), got {v!r}")
    return StsCalibration([float(t) for t in temps], dataset, num_samples,
                          None if obj.get("ece_before") is None else [float(v) for v in obj["ece_before"]],
                          None if obj.get("ece_after") is None else [float(v) for v in obj["ece_after"]])


def save_sts(path, temperatures, *, dataset: str | None = None, num_samples: int | None = None,
             ece_before=None, ece_after=None) -> None:
    """Write the SGLang STS JSON (only the keys SGLang reads; None-valued optional keys are left out), atomically:
    a temporary file in the same folder, then ``os.replace``."""
    obj = {"temperatures": _floats(temperatures, "temperatures")}
    if dataset is not None:
        obj["dataset"] = dataset
    if num_samples is not None:
        obj["num_samples"] = num_samples if isinstance(num_samples, bool) else int(num_samples)
    for key, values in (("ece_before", ece_before), ("ece_after", ece_after)):
        if values is not None:
            obj[key] = _floats(values, key)
    _validate_sts(obj)
    atomic_write_json(path, obj)  # validated above: no NaN reaches the file


def load_sts(path) -> StsCalibration:
    """Read and validate an STS file: positive finite temperatures, ECE lists as long as ``temperatures``, correct
    types, no unknown keys. Raises ValueError naming the problem (and the file)."""
    return read_json(path, _validate_sts)


# ---------------------------------------------------------------------------------------------------------------------
# The SPS cost table


@dataclass(frozen=True)
class SpsTable:
    """Target verify steps/second sampled at ascending batch-token counts; see the module docstring for ``sps``."""

    batch_tokens: tuple[int, ...]
    steps_per_sec: tuple[float, ...]
    max_batch_tokens: int

    def __post_init__(self):
        bt = tuple(self.batch_tokens)
        sp = tuple(self.steps_per_sec)
        if not bt or len(bt) != len(sp):
            raise ValueError(f"need one steps/sec value per batch size and at least one sample, got {len(bt)} batch "
                             f"sizes and {len(sp)} values")
        for b in bt:
            if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
                raise ValueError(f"sample_batch_tokens must be ints >= 1, got {b!r}")
        if any(b1 >= b2 for b1, b2 in zip(bt, bt[1:])):
            raise ValueError(f"sample_batch_tokens must be strictly ascending, got {list(bt)}")
        for s in sp:
            if not isinstance(s, (int, float, np.integer, np.floating)) or isinstance(s, bool) \
                    or not math.isfinite(s) or s <= 0:
                raise ValueError(f"sample_steps_per_sec must be finite numbers > 0, got {s!r}")
        m = self.max_batch_tokens
        if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < bt[-1]:
            raise ValueError(f"max_batch_tokens must be an int >= the largest sample ({bt[-1]}), got {m!r}")
        object.__setattr__(self, "batch_tokens", tuple(int(b) for b in bt))
        object.__setattr__(self, "steps_per_sec", tuple(float(s) for s in sp))
        object.__setattr__(self, "max_batch_tokens", int(m))

    def sps(self, batch_tokens: int) -> float:
        """Steps/second at B tokens, exactly as SGLang's ``SpsCostTable.lookup`` reads the same file: the value of the
        largest probe <= B (no interpolation), the first probe's value below it and the last probe's value past it
        (also past ``max_batch_tokens``: SGLang's planner clamps, it never refuses a batch size)."""
        if batch_tokens < 1:
            raise ValueError(f"a verify batch has at least 1 token, got {batch_tokens}")
        index = bisect.bisect_right(self.batch_tokens, batch_tokens) - 1
        return self.steps_per_sec[min(max(index, 0), len(self.batch_tokens) - 1)]

    def to_json(self) -> dict:
        return {"sample_batch_tokens": list(self.batch_tokens), "sample_steps_per_sec": list(self.steps_per_sec),
                "max_batch_tokens": self.max_batch_tokens}

    @classmethod
    def from_json(cls, obj) -> "SpsTable":
        if not isinstance(obj, dict):
            raise ValueError(f"an SPS table must be a JSON object, got {type(obj).__name__}")
        if "bias_seconds" in obj:
            raise ValueError("this is SGLang's additive cost table (it has 'bias_seconds'); only the sampled "
                             f"SpsCostTable {list(SPS_KEYS)} is supported")
        keys = set(obj)
        if keys != set(SPS_KEYS):
            raise ValueError(f"SPS table keys must be exactly {list(SPS_KEYS)}; missing {sorted(set(SPS_KEYS) - keys)}"
                             f", unknown {sorted(keys - set(SPS_KEYS))}")
        if not isinstance(obj["sample_batch_tokens"], list) or not isinstance(obj["sample_steps_per_sec"], list):
            raise ValueError("sample_batch_tokens and sample_steps_per_sec must be lists")
        return cls(tuple(obj["sample_batch_tokens"]), tuple(obj["sample_steps_per_sec"]), obj["max_batch_tokens"])

    def save(self, path) -> None:
        """Write the SGLang SpsCostTable JSON atomically (temporary file + os.replace)."""
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path) -> "SpsTable":
        return read_json(path, cls.from_json)


def sglang_max_verify_tokens(gamma: int) -> int:
    """The largest verify batch SGLang's DSpark planner looks up by default: every running request verifies up to
    gamma+1 tokens (`batch_tokens = num_running_reqs x (gamma+1)`, its SpsCostTable's index)."""
    return SGLANG_DSPARK_MAX_RUNNING_REQUESTS * (gamma + 1)


def covers_sglang_batches(table: SpsTable, gamma: int) -> bool:
    """Whether the table's probes reach SGLang's largest verify batch: past its last probe SGLang's lookup clamps,
    so every larger batch (the compute-bound range where the scheduler pays off) would get that probe's value."""
    return table.batch_tokens[-1] >= sglang_max_verify_tokens(gamma)


def check_sps_range(table: SpsTable, gamma: int, path) -> None:
    """Refuse a table that stops short of SGLang's verify batches (`covers_sglang_batches`)."""
    need = sglang_max_verify_tokens(gamma)
    if not covers_sglang_batches(table, gamma):
        raise ValueError(f"{path}: its largest probe is {table.batch_tokens[-1]} batch tokens, and SGLang's DSpark "
                         f"planner looks up verify batches of up to {need} ({SGLANG_DSPARK_MAX_RUNNING_REQUESTS} "
                         f"running requests x gamma+1 = {gamma + 1}) and clamps past the last probe: a silently wrong "
                         f"cost curve. Profile the table on the serving GPU with SGLang's own {SPS_PROFILER} (the "
                         f"export without --sps prints the commands), or pass the table to SGLang yourself")


def check_sts_length(sts: StsCalibration, gamma: int, path) -> None:
    """Refuse a calibration made for another gamma: SGLang's planner refuses it at start-up ('STS calibration was
    fit for gamma=...'), after the target has loaded."""
    if len(sts.temperatures) != gamma:
        raise ValueError(f"{path} holds {len(sts.temperatures)} temperatures, one per draft position of the draft it "
                         f"calibrates, but this draft proposes gamma = block_size = {gamma} tokens per round: SGLang "
                         f"would refuse it at start-up. Use the sts.json of this draft's own eval, or leave it out")
