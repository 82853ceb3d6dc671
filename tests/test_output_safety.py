"""What an output folder is protected from: `export/main.py --overwrite` deletes only an earlier export (never a run
folder with its cache and checkpoints), and a second live run on the same --out (export or pipeline) is refused,
naming the pid that holds it, instead of interleaving its writes with the first."""

import os
import subprocess
import sys

from conftest import ROOT
from core.io import lock_for_process
from export.main import main as export_main
from test_export import make_block_draft


def test_overwrite_replaces_an_export_but_never_a_run_folder(tmp_path, capsys, drill):
    drill("bad-input", "export --overwrite aimed at a run folder")
    draft = make_block_draft(tmp_path / "draft", markov_rank=0, sample_from_anchor=False)
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(draft), "--to", "sglang", "--out", str(out)]) == 0
    first = (out / "model.safetensors").stat().st_mtime_ns
    assert export_main(["--checkpoint", str(draft), "--to", "vllm", "--out", str(out), "--overwrite"]) == 0
    assert "speculators_config" in (out / "config.json").read_text() and (out / "model.safetensors").is_file()
    assert (out / "model.safetensors").stat().st_mtime_ns >= first
    # a run folder: --overwrite must not delete it
    run = tmp_path / "run"
    for name in ("cache/shard-00000.bin", "train/checkpoints/latest", "recipe.yaml"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("precious")
    capsys.readouterr()
    assert export_main(["--checkpoint", str(draft), "--to", "sglang", "--out", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "only an export folder" in err and "cache/" in err and str(run) in err
    assert (run / "cache" / "shard-00000.bin").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".run.")) == [".run.lock"]  # no temp left
    # a file is not an export folder either
    (tmp_path / "notes.txt").write_text("keep")
    assert export_main(["--checkpoint", str(draft), "--to", "sglang", "--out", str(tmp_path / "notes.txt"),
                        "--overwrite"]) == 2
    assert (tmp_path / "notes.txt").read_text() == "keep"


def hold_lock_in_another_process(lock_path):
    """A live process that holds `lock_path` (like a first run still going) until its stdin closes."""
    code = ("import sys; from core.io import lock_for_process; lock_for_process(sys.argv[1], 'x'); "
            "print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock_path)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_two_exports_to_one_out_refuse_naming_the_holder(tmp_path, capsys, drill):
    drill("two-runs", "two exports to one --out")
    draft = make_block_draft(tmp_path / "draft", markov_rank=0, sample_from_anchor=False)
    out = tmp_path / "export"
    holder = hold_lock_in_another_process(tmp_path / ".export.lock")
    try:
        assert export_main(["--checkpoint", str(draft), "--to", "sglang", "--out", str(out)]) == 2
        assert f"pid {holder.pid} on" in capsys.readouterr().err and not out.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # the holder is gone (however it ended): the lock is free again
    assert export_main(["--checkpoint", str(draft), "--to", "sglang", "--out", str(out)]) == 0


def test_two_pipeline_runs_on_one_out_refuse_naming_the_holder(tmp_path, drill):
    drill("two-runs", "two pipeline runs on one --out")
    out = tmp_path / "run"
    holder = hold_lock_in_another_process(out / ".draftsmith.lock")
    try:
        second = subprocess.run([sys.executable, "train/main.py", "--recipe", "dspark_smollm2_135m", "--stages",
                                 "train", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert second.returncode == 2
    assert f"in use by another run (pid {holder.pid} on" in second.stderr and str(out) in second.stderr
    assert sorted(p.name for p in out.iterdir()) == [".draftsmith.lock"]  # the second run wrote nothing


def test_a_lock_this_process_holds_is_taken_again_without_error(tmp_path):
    lock_for_process(tmp_path / "a.lock", "a")
    lock_for_process(tmp_path / "a.lock", "a")
