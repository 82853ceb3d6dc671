"""The serving contract: what an export promises the engines, and the commands that serve it.

* which serving algorithm a draft runs as (`detect_algorithm`: EAGLE3, DFLASH or DSPARK);
* the SGLang 0.5.23 and vLLM command lines that serve an export (`sglang_command`, `vllm_command`, `serve_command`);
* the two files a DSpark export ships for SGLang's confidence scheduler: the STS calibration
  (`--speculative-dspark-confidence-sts-path`, `save_sts` / `load_sts`) and the SPS cost table
  (`--speculative-dspark-sps-table-path`, `SpsTable`). eval/ computes their contents; this file owns their format.
"""

from __future__ import annotations

import bisect
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.io import atomic_write_json, read_json
from core.server import vllm_server_command
from modeling.registry import read_config

SGLANG_ALGORITHMS = {"eagle3": "EAGLE3", "dflash": "DFLASH", "dspark": "DSPARK"}
STS_FILENAME = "sts.json"
SPS_FILENAME = "sps_table.json"
# SGLang 0.5.23 builds a DSpark draft's confidence head, reads the STS file and runs the SPS-table verify scheduler
# only when this env var is not `static` (its default). `compact` is the mode whose planner sizes each request's
# verify length from confidence x SPS (`cap-accept` keeps a fixed verify width); see sglang/srt/speculative/
# ragged_verify.py and dspark_components/dspark_planner.py in the wheel.
RAGGED_VERIFY_ENV = "SGLANG_RAGGED_VERIFY_MODE"
RAGGED_VERIFY_MODE = "compact"
STS_KEYS = ("temperatures", "dataset", "num_samples", "ece_before", "ece_after")  # SGLang's DSparkStsCalibration
SPS_KEYS = ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens")  # SGLang's SpsCostTable


# ---------------------------------------------------------------------------------------------------------------------
# Which algorithm, and the commands that serve it


def detect_algorithm(cfg: dict) -> str:
    """eagle3 | dflash | dspark from config `architectures[0]` and the block-draft flags."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch == "LlamaForCausalLMEagle3":
        return "eagle3"
    if arch in ("Qwen3DSparkModel", "DFlashDraftModel"):
        rank = int(cfg.get("markov_rank", 0) or 0)
        one_plus_n = cfg.get("sample_from_anchor") is False
        if one_plus_n and rank == 0 and not cfg.get("enable_confidence_head"):
            return "dflash"
        return "dspark"
    raise ValueError(f"config architectures[0]={arch!r}: expected LlamaForCausalLMEagle3 or Qwen3DSparkModel")


def vllm_command(python: str, target: str, draft_dir: Path, method: str, num_tokens: int, port: int, *,
                 dtype: str = "float32", max_model_len: int = 2048, extra: tuple[str, ...] = ()) -> list[str]:
    spec = {"model": str(draft_dir), "method": method, "num_speculative_tokens": num_tokens}
    return vllm_server_command(python, target, port, dtype=dtype, max_model_len=max_model_len,
                               extra=("--speculative-config", json.dumps(spec), *extra))


def sglang_command(python: str, target: str, draft_dir: Path, algorithm: str, num_tokens: int, port: int, *,
                   dtype: str = "auto", sts_path: Path | None = None, sps_path: Path | None = None,
                   extra: tuple[str, ...] = ()) -> list[str]:
    """`python -m sglang.launch_server` for an exported draft. DFLASH/DSPARK read their block size from the draft's
    config; EAGLE3 is a chain of `num_tokens` steps (top-k 1). The DSpark STS/SPS files only take effect with
    `sglang_env`'s ragged-verify mode set in the server's environment."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", target, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--random-seed", "0", "--speculative-algorithm", SGLANG_ALGORITHMS[algorithm],
            "--speculative-draft-model-path", str(draft_dir)]
    if algorithm == "eagle3":
        argv += ["--speculative-num-steps", str(num_tokens), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(num_tokens + 1)]
    if algorithm == "dspark" and sts_path is not None:
        argv += ["--speculative-dspark-confidence-sts-path", str(sts_path)]
    if algorithm == "dspark" and sps_path is not None:
        argv += ["--speculative-dspark-sps-table-path", str(sps_path)]
    return argv + list(extra)


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


def serve_command(checkpoint_dir, to: str, out_dir, target: str | None = None, algorithm: str | None = None) -> str:
    """The shell command that serves the export at `out_dir` (made from the trained draft in `checkpoint_dir`, as
    `algorithm`: the one export_draft was given, None when it detected it), environment assignments first."""
    cfg = read_config(checkpoint_dir)
    algorithm = algorithm or detect_algorithm(cfg)
    gamma = int(cfg.get("ttt_length", 7) if algorithm == "eagle3" else cfg["block_size"])
    target = target or "<target model path or id>"
    env: dict[str, str] = {}
    if to == "vllm":
        argv = vllm_command("python", target, Path(out_dir), algorithm, gamma, 8000, dtype="auto")
    else:
        env = sglang_env(cfg, algorithm)
        sts, sps = sglang_serving_files(cfg, algorithm, Path(out_dir))
        argv = sglang_command("python", target, Path(out_dir), algorithm, gamma, 30000, sts_path=sts, sps_path=sps)
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv])


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
