"""benchmarks/gpu_check.py, the day-one GPU check, on CPU: its plan, one line per check whatever a check does, and the
checks' verdicts, which must be able to fail. Its CUDA checks (nccl, the SGLang ones) and its timings on a GPU have
not run here: no GPU has been lent to these tests; `python benchmarks/gpu_check.py --allow-cpu` in a fresh venv is the
rehearsal (GPU_NOTES / benchmarks/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks import gpu_check
from conftest import ROOT
from test_export import _target_config, make_block_draft

from export.convert import ExportJob, export_draft
from export.serving import serve_command


def test_dry_run_prints_each_checks_expected_time_and_calls_within_the_budget():
    """--dry-run: every check with its expected seconds and the total; over the budget, the calls to make instead,
    each within it, together naming every check once in the plan's order."""
    listed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines[:len(gpu_check.CHECKS)]] == list(gpu_check.CHECKS)
    assert all(line.split()[1].startswith("~") and line.split()[2] == "s" for line in lines[:len(gpu_check.CHECKS)])
    total = sum(c.expected_s for c in gpu_check.CHECKS.values())
    assert f"total ~{total} s" in listed.stdout and total > gpu_check.DEFAULT_BUDGET_S
    calls = [gpu_check.chosen_checks(call) for call in gpu_check.SUGGESTED_CALLS]
    assert [name for call in calls for name in call] == list(gpu_check.CHECKS)
    assert all(sum(gpu_check.CHECKS[n].expected_s for n in call) <= gpu_check.DEFAULT_BUDGET_S for call in calls)
    assert "--only nccl,train-*" in listed.stdout
    assert gpu_check.chosen_checks("kill-resume, train-*") == ["train-dspark", "train-dflash", "train-eagle3",
                                                               "kill-resume"]
    with pytest.raises(ValueError, match="--only train names no check"):
        gpu_check.chosen_checks("train")


def test_refuses_a_machine_without_cuda_unless_rehearsing():
    refused = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--only", "nccl"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env={"CUDA_VISIBLE_DEVICES": "",
                                                                              "PATH": "/usr/bin:/bin"})
    assert refused.returncode == 2 and "no CUDA device" in refused.stderr


def test_each_check_prints_one_line_whatever_it_does(monkeypatch, tmp_path, capsys):
    """A missing package is a SKIP naming what to install, a check that raises is a FAIL line and the run goes on,
    a check that would outrun the call's budget is not started; the summary counts them and the exit code is 1."""
    monkeypatch.setitem(gpu_check.TRAIN_NEEDS, "draftsmith_no_such_module", "no-such-wheel")
    monkeypatch.setitem(gpu_check.STEPS, "nccl", lambda run: 1 / 0)
    monkeypatch.setitem(gpu_check.CHECKS, "nccl", gpu_check.Check("raises", 1))
    monkeypatch.setitem(gpu_check.CHECKS, "train-dflash", gpu_check.Check("too long", 10**6))
    code = gpu_check.main(["--allow-cpu", "--only", "nccl,train-dspark,train-dflash,sglang-live", "--out",
                           str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert code == 1 and len(lines) == 5, lines
    assert lines[0].startswith("nccl          FAIL ZeroDivisionError")
    assert lines[1].startswith("train-dspark  SKIP needs no-such-wheel") and "make gpu-check-wheels" in lines[1]
    assert lines[2].startswith("train-dflash  SKIP not started") and "--only train-dflash" in lines[2]
    assert lines[3].startswith("sglang-live   SKIP no CUDA device")
    assert lines[4] == "gpu-check: 0 passed, 1 failed, 3 skipped"
    assert not (tmp_path / "tiny-qwen3-bf16").exists()  # nothing was made for checks that did not run


def test_the_sglang_checks_skip_naming_the_gpu_install(monkeypatch):
    """Where CUDA is but SGLang's GPU install is not (a lent box; here, the tests' sglang), the SGLang checks skip
    with the preflight's reason, naming `make venv-sglang` (before: sglang-live failed, regen-sglang ran ungated)."""
    pytest.importorskip("sglang")
    if importlib_find("uvicorn"):
        pytest.skip("needs the tests' sglang without its dependencies (make venv)")
    for name in ("sglang-live", "regen-sglang"):
        why = gpu_check.missing_requirement(gpu_check.CHECKS[name], cuda=True)
        assert why is not None and "make venv-sglang" in why and "uvicorn" in why, why


def importlib_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.fixture
def bf16_export(tmp_path):
    """A DSpark SGLang export for a bfloat16 target and what the export stage printed for it."""
    target = tmp_path / "target"
    config = _target_config()
    config.dtype = torch.bfloat16
    config.save_pretrained(target)
    draft = make_block_draft(tmp_path / "draft", markov_rank=8, confidence=True)
    out = export_draft(ExportJob(draft, "sglang", tmp_path / "export", verifier=str(target)))
    return out, f"[export] serve it (GPU) with: {serve_command(draft, 'sglang', out, str(target))}\n"


def test_export_check_passes_a_good_export_and_fails_a_bad_one(bf16_export):
    """The export check reads the files and the printed command, so it can fail (before, it compared the export's
    dtype with the target's, which the export copies): float32 weights under a bfloat16 config, a command serving in
    float32 (SGLang's GPU kernels have none), another backend than this machine's, another draft folder."""
    out, printed = bf16_export
    assert gpu_check.export_problems(out, printed) == []
    assert any("--dtype float32" in p for p in gpu_check.export_problems(out, printed.replace("bfloat16", "float32")))
    assert any("--attention-backend flashinfer" in p
               for p in gpu_check.export_problems(out, printed.replace("backend fa3", "backend flashinfer")))
    assert any("not the export" in p for p in gpu_check.export_problems(out, printed.replace(str(out), "/elsewhere")))
    weights = load_file(str(out / "model.safetensors"))
    save_file({k: v.float() if v.is_floating_point() else v for k, v in weights.items()}, str(out / "model.safetensors"))
    assert gpu_check.export_problems(out, printed) == ["weights stored as ['F32'], the config declares bfloat16"]


def test_live_check_reads_the_keys_eval_live_writes():
    """The sglang-live line from a report in eval/live.py's shape (its own markdown and summary read the same dict):
    both taus and the difference (before: `tau live None vs ours None`), PASS within the tolerance only."""
    from eval.live import live_markdown, print_live_summary

    report = {"engine": "sglang", "algorithm": "dspark", "draft": "d", "served_draft": "s", "target": "t",
              "dataset": "p", "num_samples": 4, "max_new_tokens": 32, "num_speculative_tokens": 4,
              "live": {"accept_len": 1.25, "accept_rate_at_k": [0.2], "num_drafts": 40, "num_accepted": 10,
                       "server_startup_s": 95.0},
              "offline": {"accept_len": 1.3, "accept_rate_at_k": [0.25], "num_rounds": 40},
              "accept_len_diff": 0.05, "tolerance": 0.1, "within_tolerance": True, "tolerance_note": "",
              "output_match": 1.0, "rounds_match": 0.75}
    live_markdown(report), print_live_summary(report)  # eval/live.py reads these keys itself
    status, detail = gpu_check.live_result(report, 0)
    assert status == "PASS" and detail.startswith("tau live 1.250 vs ours 1.300, |diff| 0.050 (tolerance 0.1)")
    out_of_tolerance = json.loads(json.dumps(report)) | {"accept_len_diff": 0.5, "within_tolerance": False}
    assert gpu_check.live_result(out_of_tolerance, 1)[0] == "FAIL"
