"""benchmarks/gpu_check.py, the day-one GPU check, on CPU: its plan, one line per check whatever a check does, and the
checks' verdicts, which must be able to fail. Its CUDA checks (nccl, the SGLang ones) and its timings on a GPU have
not run here: no GPU has been lent to these tests; `python benchmarks/gpu_check.py --allow-cpu` in a fresh venv is the
rehearsal (GPU_NOTES / benchmarks/README.md)."""

from __future__ import annotations

import json
import os
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
    each within it, together naming every check once in the plan's order; and a lent box's session (one GPU, no
    SGLang, 15 minutes with its start): a first call of at most ~5 minutes, the other calls of a one-GPU box without
    SGLang, and a rerun of the first call, all within 15 minutes, each part printed with its time."""
    listed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines[:len(gpu_check.CHECKS)]] == list(gpu_check.CHECKS)
    assert all(line.split()[1].startswith("~") and line.split()[2] == "s" for line in lines[:len(gpu_check.CHECKS)])
    # the recipes' default paths each have a check (G23)
    assert {"train-dspark-online", "train-dflash2", "dspark-4096", "world-size-2", "regen-sglang"} <= {
        line.split()[0] for line in lines[:len(gpu_check.CHECKS)]}
    total = sum(c.expected_s for c in gpu_check.CHECKS.values())
    assert f"total ~{total} s" in listed.stdout and total > gpu_check.DEFAULT_BUDGET_S
    calls = [gpu_check.chosen_checks(call) for call in gpu_check.SUGGESTED_CALLS]
    assert [name for call in calls for name in call] == list(gpu_check.CHECKS)
    assert all(sum(gpu_check.CHECKS[n].expected_s for n in call) <= gpu_check.DEFAULT_BUDGET_S for call in calls)
    assert all(f"--only {call}" in listed.stdout for call in gpu_check.SUGGESTED_CALLS)
    # a lent box: the first call holds the checks most likely to fail, within ~5 minutes
    first = gpu_check.chosen_checks(gpu_check.LENT_BOX_CALLS[0])
    assert first == ["nccl", "train-dspark", "train-dspark-online", "kill-resume", "export"]
    assert gpu_check.call_s(gpu_check.LENT_BOX_CALLS[0]) <= gpu_check.FIRST_CALL_S == 300
    lent = [gpu_check.CHECKS[n] for call in gpu_check.LENT_BOX_CALLS for n in gpu_check.chosen_checks(call)]
    assert all(not c.sglang and c.gpus == 1 for c in lent)
    session = gpu_check.lent_box_session()
    assert [seconds for part, seconds in session][:2] == [gpu_check.LENT_BOX_START_S, gpu_check.WHEEL_INSTALL_S]
    assert session[-1] == ("call 1 again (room for one rerun)", gpu_check.call_s(gpu_check.LENT_BOX_CALLS[0]))
    assert gpu_check.LENT_BOX_START_S >= 120 and sum(s for _, s in session) <= gpu_check.LENT_BOX_S == 900
    assert all(f"{part}" in listed.stdout and f"~{seconds} s" in listed.stdout for part, seconds in session)
    assert f"total ~{sum(s for _, s in session)} s of 900" in listed.stdout
    assert gpu_check.chosen_checks("kill-resume, train-*") == ["train-dspark", "train-dspark-online", "kill-resume",
                                                               "train-dflash", "train-eagle3", "train-dflash2"]
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
    code = gpu_check.main(["--allow-cpu", "--only", "nccl,train-dspark,train-dflash,world-size-2,sglang-live",
                           "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert code == 1 and len(lines) == 6, lines
    named = lambda name, rest: f"{name:{gpu_check.NAME_WIDTH}s} {rest}"  # noqa: E731
    assert lines[0].startswith(named("nccl", "FAIL ZeroDivisionError"))
    assert lines[1].startswith(named("train-dspark", "SKIP needs no-such-wheel"))
    assert "make gpu-check-wheels" in lines[1] and "copy gpu-check-wheels/ to the GPU box with the checkout" in lines[1]
    assert lines[2].startswith(named("train-dflash", "SKIP not started")) and "--only train-dflash" in lines[2]
    assert lines[3].startswith(named("world-size-2", "SKIP no CUDA device"))
    assert lines[4].startswith(named("sglang-live", "SKIP no CUDA device"))
    assert lines[5] == "gpu-check: 0 passed, 1 failed, 4 skipped"
    assert not (tmp_path / "tiny-qwen3-bf16").exists()  # nothing was made for checks that did not run


def test_two_rank_check_skips_on_one_gpu():
    """world-size-2 runs where two GPUs are (torchrun --nproc_per_node 2); on one it says so instead of failing."""
    check = gpu_check.CHECKS["world-size-2"]
    assert check.cuda and check.gpus == 2
    assert gpu_check.missing_requirement(check, cuda=True, gpus=1) == "needs 2 GPUs, this machine has 1: run it " \
                                                                       "where 2 are"
    if gpu_check.missing_requirement(gpu_check.CHECKS["train-dspark"], cuda=True, gpus=2) is None:  # deepspeed here
        assert gpu_check.missing_requirement(check, cuda=True, gpus=2) is None


# typing_extensions as an older release is: without what pydantic 2.14.4 imports from it (added in 4.15/4.16)
_OLD_TYPING_EXTENSIONS = """
import importlib.util as _util
_spec = _util.spec_from_file_location("_real_typing_extensions", {path!r})
_real = _util.module_from_spec(_spec)
_spec.loader.exec_module(_real)
globals().update({{k: v for k, v in vars(_real).items()
                   if not k.startswith("__") and k not in ("Sentinel", "TypeForm")}})
"""


def test_a_pydantic_that_does_not_import_is_a_skip_naming_the_wheels(tmp_path):
    """The carried pydantic 2.14.4 (installed without its dependencies) over a box's older typing-extensions is found
    but does not import, and deepspeed imports it: the training checks skip naming the import error, what pydantic
    needs and the wheels (before: looked up by name only, so they ran and failed at import)."""
    import typing_extensions

    if gpu_check.missing_requirement(gpu_check.CHECKS["train-dspark"], cuda=True) is not None:
        pytest.skip("needs the training packages here (make venv)")
    old = tmp_path / "old-typing-extensions"
    old.mkdir()
    (old / "typing_extensions.py").write_text(_OLD_TYPING_EXTENSIONS.format(path=typing_extensions.__file__))
    code = ("from benchmarks import gpu_check; "
            "print('REASON', gpu_check.missing_requirement(gpu_check.CHECKS['train-dspark'], cuda=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{old}:{ROOT}"})
    reason = next(line for line in done.stdout.splitlines() if line.startswith("REASON "))[len("REASON "):]
    assert reason.startswith("pydantic does not import (ImportError: cannot import name 'Sentinel'"), reason
    assert "it needs typing-extensions>=4.16.0" in reason and "make gpu-check-wheels" in reason


def test_the_online_check_fails_a_states_sized_host_copy():
    """train-dspark-online's verdict from probe_pipeline's report: PASS when every micro-batch's states stayed on the
    target's device with no states-sized copy to the host; FAIL on a copy at least as large as the smallest states
    tensor, on states on another device than the target's, and when the online path never ran."""
    rows = [{"hidden_s": 9.0, "step_s": 20.0}, {"hidden_s": 0.02, "step_s": 0.5}, {"hidden_s": 0.03, "step_s": 0.6}]
    probe = {"micro_batches": 12, "devices": ["cuda"], "smallest_states": 2048, "longest_row": 60,
             "host_copies": [1, 1, 8], "expected_device": "cuda", "peak_gib": 1.0}
    status, detail = gpu_check.online_result(probe, rows)
    assert status == "PASS", detail
    assert detail.startswith("12 micro-batches' states on cuda, 0 device-to-host copies of a states-sized tensor")
    assert "hidden_s 0.030 s of step_s 0.600 s" in detail  # the median of the steps after the first
    assert gpu_check.online_result(probe | {"host_copies": [1, 2048]}, rows)[0] == "FAIL"
    on_host = gpu_check.online_result(probe | {"devices": ["cpu"]}, rows)
    assert on_host[0] == "FAIL" and "NOT on the target's cuda" in on_host[1]
    assert gpu_check.online_result(probe | {"micro_batches": 0}, rows)[0] == "FAIL"


def test_host_copies_are_counted_whatever_makes_them():
    """The probe's counter sees every copy from another device into the CPU (.to, .cpu, copy_, .tolist), not host
    to host ones. No GPU here: the `meta` device stands in for it (its copies to the host fail after being seen)."""
    with gpu_check.host_copy_counter() as copies:
        for copy in (lambda: torch.zeros(4, 8, device="meta").to("cpu"), lambda: torch.zeros(5, device="meta").cpu(),
                     lambda: torch.zeros(3).copy_(torch.zeros(3, device="meta")),
                     lambda: torch.zeros(2, 3, device="meta").tolist()):
            with pytest.raises((NotImplementedError, RuntimeError)):
                copy()
        torch.zeros(6).to(torch.float64), torch.zeros(7).clone(), torch.zeros(2).copy_(torch.ones(2))
        torch.zeros(4, device="meta").to(torch.bfloat16)  # on the device: not a host copy
        with torch.inference_mode(), pytest.raises(NotImplementedError):  # seen as aten.to.device, not _to_copy
            torch.zeros(4, 8, device="meta")[1, :3].to("cpu", torch.bfloat16)
    assert copies.numels == [32, 5, 3, 6, 3]


def test_regen_sglang_samples_as_the_recipe_does(monkeypatch, tmp_path):
    """regen-sglang regenerates through SGLang sampled with the Qwen3 recipe's settings, not greedy (SMALL's): the
    path where SGLang's default sampling backend would build flashinfer's kernel with nvcc. The server's own log line
    (SGLang's resolved settings, as its engine logs them) says which backend ran; a flashinfer one is a FAIL."""
    from core.recipe import load_recipe

    launched = {}

    def pipeline(self, family, out, stages, env_extra=None, sets_extra=None, **how):
        launched.update(family=family, stages=stages, sets=sets_extra)
        return subprocess.CompletedProcess([], 1, "", "stopped here")

    monkeypatch.setattr(gpu_check.Run, "pipeline", pipeline)
    assert gpu_check.check_regen_sglang(gpu_check.Run(tmp_path, 0)) == ("FAIL", "rc 1: stopped here")
    regen = load_recipe("dspark_qwen3_8b").regen
    assert regen.temperature > 0 and launched["stages"] == "regenerate"
    assert launched["sets"] == {"regen.backend": "sglang", "regen.temperature": regen.temperature,
                                "regen.top_p": regen.top_p, "regen.top_k": regen.top_k}


_LOGGED = """
import sys
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(sys.argv[1:])
print(f"[2026-01-01 00:00:00] server_args={args.resolved_dict()}")
"""


def test_the_sampling_backend_is_read_from_sglangs_log_line(tmp_path):
    """regen-sglang reads the backend from the line SGLang 0.5.23 logs at startup (`server_args=` and its resolved
    settings), made here by SGLang's own ServerArgs for both backends."""
    pytest.importorskip("sglang")
    for backend in ("pytorch", "flashinfer"):
        done = subprocess.run([sys.executable, "-c", _LOGGED, "--model-path", str(tmp_path), "--sampling-backend",
                               backend], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert gpu_check.logged_sampling_backend(done.stdout) == backend
    assert gpu_check.logged_sampling_backend("server up") is None


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
