"""The day-one GPU path in one command, one line per check: what a Qwen3 user's first GPU run exercises, offline, on
one GPU, in under 10 minutes.

    make gpu-check                                   # on a CUDA machine (python benchmarks/gpu_check.py)
    python benchmarks/gpu_check.py --dry-run         # list the checks, run nothing
    python benchmarks/gpu_check.py --allow-cpu       # rehearse on CPU (nccl and the SGLang checks are skipped)
    python benchmarks/gpu_check.py --only export,sglang-live

Every run uses a tiny random Qwen3 (hidden 64, 40 layers; the Qwen3 recipes' layer ids exist) with the real Qwen3
tokenizer and the Qwen3-8B recipes' code path (`train/main.py --recipe {family}_qwen3_8b`) with small overrides. A
check prints PASS, FAIL or SKIP with what it measured; the exit code is 1 when any check failed. Paste the output into
benchmarks/README.md ("GPU check") with the machine and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
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
    "draft.num_layers": 1, "draft.num_anchors": 16, "draft.block_size": 4, "draft.draft_vocab_size": 2048,
    "draft.ttt_length": 3, "train.global_batch_size": 4, "train.max_steps": 6, "train.save_every": 2,
    "train.log_every": 1, "train.zero_stage": 2, "eval.num_samples": 4, "eval.max_new_tokens": 32,
}
CHECKS = {
    "nccl": "torch.distributed with NCCL: init, all_reduce of a CUDA tensor",
    "train-dspark": "regenerate, cache and 6 bf16 ZeRO-2 steps of DSpark (flex_attention forward and backward)",
    "train-dflash": "the same for DFlash",
    "train-eagle3": "the same for Eagle3",
    "kill-resume": "DSpark killed (kill -9) at step 3 under ZeRO-2, rerun: resumes from step 2 under the weights-only "
                   "allow-list and ends where the uninterrupted run ended",
    "export": "the DSpark export for SGLang: config dtype = the target's, weights in it, the printed serve command",
    "sglang-live": "SGLang launch_server with the DSpark export, live accept length against our loop's (where SGLang "
                   "imports with CUDA)",
    "regen-sglang": "the regenerate stage through the SGLang server it starts (the Qwen3 recipes' backend), greedy; "
                    "its answers beside train-dspark's in-process ones",
}


class Run:
    """The shared work folder, tiny target and prompts, and a runner of train/main.py."""

    def __init__(self, work: Path):
        from data.assets import make_tiny_qwen3

        self.work = work
        self.target = make_tiny_qwen3(str(work / "tiny-qwen3"), num_layers=40)
        self.prompts = work / "prompts.jsonl"
        self.prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
        self.env = {**os.environ, **OFFLINE}

    def pipeline(self, family: str, out: Path, stages: str, env_extra=None, sets_extra=None
                 ) -> subprocess.CompletedProcess:
        sets = dict(SMALL, **{"target.name_or_path": self.target, "data.sources": f"[{{name: '{self.prompts}'}}]"},
                    **(sets_extra or {}))
        if family == "dspark":
            sets["draft.markov_rank"] = 16
        cmd = [sys.executable, "train/main.py", "--recipe", f"{family}_qwen3_8b", "--out", str(out),
               "--stages", stages] + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
        return subprocess.run(cmd, cwd=ROOT, env={**self.env, **(env_extra or {})}, capture_output=True, text=True,
                              timeout=600)


def failed(done: subprocess.CompletedProcess) -> str:
    return f"rc {done.returncode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else '(no stderr)'}"


def check_nccl(run: Run) -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return "SKIP", "no CUDA device"
    code = ("import torch, torch.distributed as d; d.init_process_group('nccl', init_method='tcp://127.0.0.1:29517', "
            "rank=0, world_size=1); x = torch.ones(4, device='cuda'); d.all_reduce(x); torch.cuda.synchronize(); "
            "print(float(x.sum())); d.destroy_process_group()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    ok = done.returncode == 0 and done.stdout.strip() == "4.0"
    return ("PASS", f"all_reduce gave {done.stdout.strip()}") if ok else ("FAIL", failed(done))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]


def check_train(run: Run, family: str) -> tuple[str, str]:
    out = run.work / family
    done = run.pipeline(family, out, "regenerate,cache,train")
    if done.returncode != 0:
        return "FAIL", failed(done)
    rows = metrics(out)
    finite = all(abs(r["loss"]) < float("inf") for r in rows)
    detail = f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, {len(rows)} steps"
    return ("PASS" if finite else "FAIL"), detail + ("" if finite else ", NON-FINITE loss")


def check_kill_resume(run: Run) -> tuple[str, str]:
    clean = run.work / "dspark"
    if not (clean / "train" / "DONE.json").is_file():
        return "SKIP", "needs train-dspark's run"
    crashed = run.work / "dspark-killed"
    import shutil

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


def check_export(run: Run) -> tuple[str, str]:
    out = run.work / "dspark"
    if not (out / "train" / "DONE.json").is_file():
        return "SKIP", "needs train-dspark's run"
    done = run.pipeline("dspark", out, "export")
    if done.returncode != 0:
        return "FAIL", failed(done)
    config = json.loads((out / "export" / "sglang" / "config.json").read_text())
    target = json.loads((Path(run.target) / "config.json").read_text())
    want = target.get("torch_dtype") or target.get("dtype")
    have = config.get("torch_dtype") or config.get("dtype")
    ok = have == want and "--dtype" in done.stdout
    return ("PASS" if ok else "FAIL"), f"config dtype {have} (target {want}); serve command printed"


def check_sglang_live(run: Run) -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return "SKIP", "no CUDA device (SGLang serves DSpark on GPUs only)"
    try:
        import sglang  # noqa: F401
    except ImportError as err:
        return "SKIP", f"sglang does not import ({err}); pip install -e .[sglang]"
    draft = run.work / "dspark" / "train" / "final"
    if not draft.is_dir():
        return "SKIP", "needs train-dspark's run"
    out = run.work / "live-dspark"
    done = subprocess.run([sys.executable, "eval.py", "--live", "--engine", "sglang", "--draft", str(draft),
                           "--target", run.target, "--dataset", str(run.prompts), "--num-samples", "4",
                           "--max-new-tokens", "32", "--out", str(out)], cwd=ROOT, env=run.env,
                          capture_output=True, text=True, timeout=600)
    report = out / "report.json"
    if not report.is_file():
        return "FAIL", failed(done)
    live = json.loads(report.read_text())
    detail = f"tau live {live.get('tau_live')} vs ours {live.get('tau_offline')}"
    return ("PASS" if done.returncode == 0 else "FAIL"), detail


def check_regen_sglang(run: Run) -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return "SKIP", "no CUDA device (SGLang serves on GPUs only)"
    out = run.work / "regen-sglang"
    done = run.pipeline("dspark", out, "regenerate", sets_extra={"regen.backend": "sglang"})
    if done.returncode != 0:
        return "FAIL", failed(done)

    def answers(folder: Path) -> dict:
        rows = [json.loads(line) for line in (folder / "regen" / "records.jsonl").read_text().splitlines()]
        return {r["id"]: r["response_ids"] for r in rows}

    served = answers(out)
    startup = json.loads((out / "regen" / "DONE.json").read_text()).get("server_startup_s")
    detail = f"{len(served)} conversations, server up in {startup} s"
    if (run.work / "dspark" / "regen" / "records.jsonl").is_file():  # greedy both: bf16 kernels may still differ
        hf = answers(run.work / "dspark")
        same = sum(served.get(k) == v for k, v in hf.items())
        detail += f"; {same}/{len(hf)} the same token ids as the in-process backend's"
    return ("PASS" if served else "FAIL"), detail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n")[0],
                                     epilog="checks: " + "; ".join(f"{k}: {v}" for k, v in CHECKS.items()))
    parser.add_argument("--dry-run", action="store_true", help="list the checks and exit")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when there is no GPU (a rehearsal)")
    parser.add_argument("--only", help=f"comma-separated checks to run, from {','.join(CHECKS)} (default: all)")
    parser.add_argument("--out", help="work folder (default: a temporary one)")
    args = parser.parse_args(argv)
    chosen = [c.strip() for c in (args.only or ",".join(CHECKS)).split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CHECKS]
    if unknown:
        parser.error(f"unknown check(s) {unknown}; checks are {', '.join(CHECKS)}")
    if args.dry_run:
        for name in chosen:
            print(f"{name:13s} {CHECKS[name]}")
        return 0
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device: run on a GPU machine, or pass --allow-cpu to rehearse on CPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, device {device}", flush=True)
    run = Run(Path(args.out or tempfile.mkdtemp(prefix="draftsmith-gpu-check-")))
    steps = {"nccl": check_nccl, "train-dspark": lambda r: check_train(r, "dspark"),
             "train-dflash": lambda r: check_train(r, "dflash"), "train-eagle3": lambda r: check_train(r, "eagle3"),
             "kill-resume": check_kill_resume, "export": check_export, "sglang-live": check_sglang_live,
             "regen-sglang": check_regen_sglang}
    results = {}
    for name in chosen:
        start = time.perf_counter()
        try:
            status, detail = steps[name](run)
        except Exception as err:  # a check that crashes is a failed check; the others still run
            status, detail = "FAIL", f"{type(err).__name__}: {err}"
        results[name] = status
        print(f"{name:13s} {status:4s} {detail} ({time.perf_counter() - start:.0f} s)", flush=True)
    bad = [name for name, status in results.items() if status == "FAIL"]
    print(f"gpu-check: {sum(s == 'PASS' for s in results.values())} passed, {len(bad)} failed, "
          f"{sum(s == 'SKIP' for s in results.values())} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
