"""What an output folder is protected from: `export/main.py --overwrite` deletes only an earlier export (never a run
folder with its cache and checkpoints), and a second live run on the same --out (export or pipeline) is refused,
naming the pid that holds it, instead of interleaving its writes with the first (where the file system has no flock,
too). Files are shared as the user's umask allows; URLs lose their credentials wherever they are written; a server
that stops answering stops the stage instead of holding it for hours."""

import os
import subprocess
import sys

import pytest

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
                                 "regenerate", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
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


# --- the user's umask, secrets, locks without flock, a server that never answers ----------------------------------


def test_outputs_follow_the_users_umask(tmp_path):
    from core.io import atomic_write_text, publish_dir

    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        with publish_dir(tmp_path / "draft") as tmp:
            fd = os.open(tmp / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors writes it
            os.close(fd)
            (tmp / "sub").mkdir()
    finally:
        os.umask(old)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("a.json", "draft", "draft/model.safetensors",
                                                                         "draft/sub")}
    assert modes == {"a.json": 0o640, "draft": 0o750, "draft/model.safetensors": 0o640, "draft/sub": 0o750}


def test_urls_lose_their_credentials_in_files_errors_and_tracker_configs(tmp_path):
    from core.recipe import load_recipe, shareable_recipe_dict
    from core.redact import redact_url, redact_urls
    from data.regen_backends import OpenAIBackend

    assert redact_url("http://alice:s3cret@10.1.2.3:30000/v1?api_key=abc") == \
        "http://<redacted>@10.1.2.3:30000/v1?<redacted>"
    assert redact_urls("ConnectionError from https://tok@host:1/x: refused") == \
        "ConnectionError from https://<redacted>@host:1/x: refused"
    url = "http://bob:hunter2@127.0.0.1:9/?token=xyz"  # port 9 (discard): refused at once
    recipe = load_recipe("dspark_smollm2_135m", ["regen.backend=openai", f"regen.server_urls=['{url}']",
                                                 "regen.request_attempts=1"])
    shared = shareable_recipe_dict(recipe)
    assert shared["regen"]["server_urls"] == ["http://<redacted>@127.0.0.1:9/?<redacted>"]
    answer = OpenAIBackend(None, recipe.regen, "m")._post(url.rstrip("/"), "/v1/chat/completions", {}, None)
    assert answer.error and "127.0.0.1:9" in answer.error
    assert "hunter2" not in answer.error and "xyz" not in answer.error and "bob" not in answer.error


def test_a_server_that_never_answers_stops_the_stage_after_the_stall_timeout():
    import socket
    import threading
    import time

    from core.recipe import load_recipe
    from data.regen_backends import OpenAIBackend, RegenStallError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(4)], daemon=True).start()
    url = f"http://user:pw@127.0.0.1:{listener.getsockname()[1]}"
    recipe = load_recipe("dspark_smollm2_135m", ["regen.backend=openai", f"regen.server_urls=[{url}]",
                                                 "regen.stall_timeout_s=1.5", "regen.request_timeout_s=600"])
    backend = OpenAIBackend(None, recipe.regen, "m")
    start = time.perf_counter()
    try:
        with pytest.raises(RegenStallError) as stalled:
            backend.generate([[{"role": "user", "content": "hi"}]] * 2, seed=0)
        assert time.perf_counter() - start < 10  # not 600 s x 3 attempts
        message = str(stalled.value)
        assert f"127.0.0.1:{listener.getsockname()[1]}" in message and "regen.stall_timeout_s" in message
        assert "pw" not in message.replace("rerun", "")
        backend.pool.shutdown(wait=True)  # the requests' threads end within a stall period too
        assert time.perf_counter() - start < 10
    finally:
        listener.close()


def test_the_run_lock_works_without_flock(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    import core.io
    from core.io import LockedError

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(core.io, "_HELD", {})
    pid_file = tmp_path / "run" / ".draftsmith.lock.pid"
    pid_file.parent.mkdir()
    # a run on this host that died without cleaning up: stale, replaced
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid_file.write_text(f"pid {dead.stdout.strip()} on {__import__('socket').gethostname()}\n")
    lock_for_process(tmp_path / "run" / ".draftsmith.lock", "--out run")
    assert pid_file.read_text().startswith(f"pid {os.getpid()} on ") and "has no flock" in capsys.readouterr().out
    # a live holder (here: a pid file naming a live process) is refused, naming the file
    monkeypatch.setattr(core.io, "_HELD", {})
    other = tmp_path / "other" / ".draftsmith.lock.pid"
    other.parent.mkdir()
    other.write_text(f"pid 1 on {__import__('socket').gethostname()}\n")
    with pytest.raises(LockedError, match="delete .*other/.draftsmith.lock.pid if that run is gone"):
        lock_for_process(tmp_path / "other" / ".draftsmith.lock", "--out other")


def test_evals_write_a_folder_each_and_two_on_one_folder_refuse(tmp_path, capsys, drill):
    import importlib.util

    drill("two-runs", "two evals on one --out")
    spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.default_out("runs/demo/train/final", "mtbench") == cli.default_out("runs/demo/train/final", "mtbench")
    assert cli.default_out("runs/a/train/final", "mtbench") != cli.default_out("runs/b/train/final", "mtbench")
    assert cli.default_out("ngram", "/data/x/prompts.jsonl").as_posix() == "runs/eval/ngram_prompts.jsonl"
    out = tmp_path / "eval"
    holder = hold_lock_in_another_process(out / ".draftsmith.lock")
    try:
        code = cli.main(["--draft", "ngram", "--target", "smollm2-135m-instruct", "--dataset", "mtbench",
                         "--out", str(out)])
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert code == 2 and f"pid {holder.pid} on" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [".draftsmith.lock"]
