"""What an output folder is protected from: `export/main.py --overwrite` deletes only an earlier export (never a run
folder with its cache and checkpoints), and a second live run on the same --out (export or pipeline) is refused,
naming the pid that holds it, instead of interleaving its writes with the first (where the file system has no flock,
too). Files are shared as the user's umask allows; URLs lose their credentials wherever they are written; a server
that stops answering stops the stage instead of holding it for hours."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, eval_cli
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
    from data.regen.backends import OpenAIBackend

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
    from data.regen.backends import OpenAIBackend, RegenStallError

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
    drill("two-runs", "two evals on one --out")
    cli = eval_cli()
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


# --- links: nothing is written through a symbolic link DraftSmith did not make ------------------------------------


def victim_file(tmp_path, name="victim"):
    """A file outside every folder a run writes, and what it must still hold afterwards."""
    path = tmp_path / "outside" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"the user's bytes\n")
    return path


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_keeps_its_bytes(tmp_path, monkeypatch):
    import errno
    import fcntl

    import core.io
    from core.io import LinkedPathError

    victim = victim_file(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".draftsmith.lock").symlink_to(victim)
    with pytest.raises(LinkedPathError, match="draftsmith.lock is a symbolic link"):
        lock_for_process(tmp_path / "run" / ".draftsmith.lock", "--out run")
    assert victim.read_bytes() == b"the user's bytes\n"  # it used to be truncated and overwritten with our pid
    # the pid-file lock (no flock): a planted link is refused, and what it points to is never printed
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no locks")))
    monkeypatch.setattr(core.io, "_HELD", {})
    secret = victim_file(tmp_path, "id_rsa")
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / ".draftsmith.lock.pid").symlink_to(secret)
    with pytest.raises(LinkedPathError) as refused:
        lock_for_process(tmp_path / "other" / ".draftsmith.lock", "--out other")
    assert "PRIVATE KEY" not in str(refused.value) and ".draftsmith.lock.pid is a symbolic link" in str(refused.value)
    # a live holder's pid file is read back at most a few hundred bytes
    (tmp_path / "third").mkdir()
    (tmp_path / "third" / ".draftsmith.lock.pid").write_text(f"pid 1 on {__import__('socket').gethostname()}"
                                                            + " padding" * 1000)
    with pytest.raises(core.io.LockedError) as held:
        lock_for_process(tmp_path / "third" / ".draftsmith.lock", "--out third")
    assert len(str(held.value)) < 700


def test_writers_replace_a_link_at_the_final_or_scratch_path_never_writing_through_it(tmp_path):
    from core.io import atomic_write_bytes, atomic_write_text, open_append, open_new, publish_dir, LinkedPathError
    from eval.report import plot_acceptance

    out = tmp_path / "out"
    out.mkdir()
    victims = {name: victim_file(tmp_path, name) for name in ("final", "scratch", "new", "plot", "folder", "log")}
    for name, path in {"report.json": "final", "index.bin.tmp": "scratch", "shard.bin.tmp": "new",
                       "accept_rate.png": "plot", "final": "folder", "metrics.jsonl": "log"}.items():
        (out / name).symlink_to(victims[path])
    atomic_write_text(out / "report.json", "{}\n")
    atomic_write_bytes(out / "index.bin", b"index", tmp_path=out / "index.bin.tmp")  # the cache's fixed scratch name
    with open_new(out / "shard.bin.tmp") as handle:
        handle.write(b"shard")
    plot_acceptance({"accept_rate_at_k": [0.5, 0.25], "cond_accept_rate_at_k": [0.5, 0.5], "dataset": "mtbench",
                     "accept_len": 1.5, "temperature": 0.0}, out / "accept_rate.png")
    with publish_dir(out / "final") as tmp:
        (tmp / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(LinkedPathError, match="metrics.jsonl is a symbolic link"):
        open_append(out / "metrics.jsonl")
    assert {name: path.read_bytes() for name, path in victims.items()} == \
        {name: b"the user's bytes\n" for name in victims}
    assert [name for name in ("report.json", "index.bin", "shard.bin.tmp", "accept_rate.png", "final")
            if (out / name).is_symlink()] == []
    assert (out / "final" / "model.safetensors").read_bytes() == b"weights"


def test_below_a_root_a_folder_that_is_a_link_is_refused(tmp_path):
    from core.io import LinkedPathError, atomic_write_text, fresh_dir, make_dir, own_root

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "user.txt").write_text("mine\n")
    run = own_root(tmp_path / "run")
    (run / "train" / "checkpoints").mkdir(parents=True)
    (run / "train" / "checkpoints" / "step-0000001").symlink_to(elsewhere)
    with pytest.raises(LinkedPathError, match="step-0000001 is a symbolic link"):
        atomic_write_text(run / "train" / "checkpoints" / "step-0000001" / "draft" / "config.json", "{}")
    with pytest.raises(LinkedPathError):
        make_dir(run / "train" / "checkpoints" / "step-0000001" / "draft")
    # a checkpoint folder is made fresh: a link standing there is removed, never written into
    fresh_dir(run / "train" / "checkpoints" / "step-0000001")
    assert not (run / "train" / "checkpoints" / "step-0000001").is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["user.txt"]
    # the root itself may be a link (runs -> /scratch/runs: the user's own choice)
    (tmp_path / "scratch").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "scratch")
    linked_root = own_root(tmp_path / "runs" / "demo")
    atomic_write_text(linked_root / "regen" / "DONE.json", "{}")
    assert (tmp_path / "scratch" / "demo" / "regen" / "DONE.json").read_text() == "{}"
    (tmp_path / "loose").symlink_to(victim_file(tmp_path))  # outside every root: named clearly all the same
    with pytest.raises(NotADirectoryError, match="loose is a link to a file where DraftSmith makes a folder"):
        make_dir(tmp_path / "loose")


def test_a_stage_folder_is_ours_only_by_its_marker(tmp_path):
    from core import stage
    from core.io import LinkedPathError

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "settings.json").write_text('{"theme": "dark"}\n')  # another application's
    assert not stage.is_ours(folder)
    with pytest.raises(stage.StageMismatchError):  # and never taken for a stage's pinned settings
        stage.begin(folder, {"draft_sha256": "x"})
    made = tmp_path / "run" / "eval"
    stage.begin(made, {"draft_sha256": "x"})
    assert stage.is_ours(made) and stage.pinned(made) == {"draft_sha256": "x"}
    (tmp_path / "linked").symlink_to(made)
    assert not stage.is_ours(tmp_path / "linked")
    (made / "DONE.json").symlink_to(victim_file(tmp_path))
    with pytest.raises(LinkedPathError, match="DONE.json is a symbolic link"):
        stage.start(made, {"draft_sha256": "x"}, "eval")


# Where a write call is allowed outside core/io.py: into the fresh folder or file one of its writers yields.
FRESH_WRITERS = {"publish_dir", "atomic_open"}
SOURCES = ("core", "data", "eval", "export", "modeling", "train", "pipeline.py", "eval.py")


def write_calls(path) -> list[str]:
    """The calls in `path` that write a file or folder (open for writing, os.open with a write flag, Path.write_text,
    mkdir, torch.save, safetensors' save_file, savefig, save_pretrained, shutil's copies, renames, temp files) and are
    not aimed at the folder or file a `with publish_dir(...) as tmp` / `with atomic_open(...) as handle` made."""
    import ast

    def name(call):
        func = call.func
        return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)

    def on(call, module):
        return isinstance(call.func, ast.Attribute) and getattr(call.func.value, "id", None) in module

    def writes(call) -> bool:
        what = name(call)
        if what in ("open", "fdopen") and not on(call, ("os",)) or what == "fdopen":
            mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"),
                                                                None)
            if mode is None:
                return what == "fdopen"
            return not (isinstance(mode, ast.Constant) and not set(str(mode.value)) & set("wax+"))
        if what == "open":  # os.open
            return any(isinstance(n, ast.Attribute) and n.attr in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND",
                                                                    "O_TRUNC") for n in ast.walk(call))
        if what in ("copy", "copy2", "copyfile", "copytree", "move"):
            return on(call, ("shutil",))
        if what in ("replace", "makedirs", "symlink", "link", "mkfifo"):
            return on(call, ("os",))
        if what == "save":
            return on(call, ("torch", "np", "numpy"))
        return what in ("write_text", "write_bytes", "touch", "mkdir", "symlink_to", "hardlink_to", "rename",
                        "savefig", "save_pretrained", "save_file", "mkstemp", "mkdtemp", "NamedTemporaryFile")

    found, fresh = [], []

    class Finder(ast.NodeVisitor):
        def visit_With(self, node):
            names = [item.optional_vars.id for item in node.items if isinstance(item.context_expr, ast.Call)
                     and name(item.context_expr) in FRESH_WRITERS and isinstance(item.optional_vars, ast.Name)]
            fresh.extend(names)
            self.generic_visit(node)
            del fresh[len(fresh) - len(names):]

        def visit_Call(self, node):
            aimed = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & set(fresh)
            if writes(node) and not aimed:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}")
            self.generic_visit(node)

    Finder().visit(ast.parse(path.read_text()))
    return found


def test_only_core_io_opens_files_for_writing():
    """Every file DraftSmith creates goes through core/io's writers (which never follow a link), or into the fresh
    temporary folder or file one of them yields: a new `open(path, "w")` anywhere else fails here."""
    files = [p for src in SOURCES for p in (sorted((ROOT / src).rglob("*.py")) if (ROOT / src).is_dir()
                                           else [ROOT / src])]
    assert len(files) > 50
    found = [call for path in files if path.relative_to(ROOT).as_posix() != "core/io.py" for call in write_calls(path)]
    assert found == []


def test_the_writers_check_finds_a_planted_write(tmp_path, monkeypatch):
    import test_output_safety

    planted = tmp_path / "planted.py"
    planted.write_text("from core.io import publish_dir\n"
                       "def a(p):\n    with open(p / 'x', 'w') as f:\n        f.write('1')\n"
                       "def b(p, t):\n    torch.save(t, p / 'y')\n    (p / 'z').write_text('2')\n    p.mkdir()\n"
                       "def c(p):\n    with publish_dir(p) as tmp:\n        (tmp / 'ok').write_text('fine')\n"
                       "    with open(p, 'rb') as f:\n        f.read()\n")
    monkeypatch.setattr(test_output_safety, "ROOT", tmp_path)
    assert [line.split(": ", 1)[0] for line in write_calls(planted)] == ["planted.py:3", "planted.py:6",
                                                                        "planted.py:7", "planted.py:8"]


def test_eval_py_refuses_a_runs_own_stage_folder_as_its_out(tmp_path, capsys, drill):
    """`eval.py --out RUN/eval` used to overwrite the run's report and sts.json; the run's next call then printed the
    other eval's tau as its own and exported its calibration."""
    from core import stage

    cli = eval_cli()
    run = tmp_path / "run"
    stage.begin(run / "eval", {"draft_sha256": "x"})  # the eval stage's folder, as the pipeline makes it
    (run / "recipe.yaml").write_text("name: demo\n")
    for out in (run / "eval", run / "train"):  # marked, or named like a stage beside the run's recipe
        drill("bad-input", f"eval.py --out RUN/{out.name}")
        with pytest.raises(SystemExit) as refused:
            cli.main(["--draft", "ngram", "--target", "smollm2-135m-instruct", "--dataset", "mtbench", "--out",
                      str(out)])
        assert refused.value.code == 2 and f"--out {out} is, or lies in, the run {run}" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "eval").iterdir()) == [".draftsmith-stage", "settings.json"]
    assert not (run / "train").exists()


def _snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_eval_py_out_reaching_a_run_or_an_export_by_dots_or_a_link_is_refused(tmp_path, capsys, drill):
    """`eval.py --out RUN/eval/x/..` and `--out ALIAS` (a link to RUN/eval) replaced the run's report.json, report.md
    and accept_rate.png: only the path as given was checked. `--out EXP` (an export) left 3 temperatures in the
    shipped sts.json of a draft of block size 7, and a report in the serving folder. Each is refused with exit code
    2 and both folders keep their bytes."""
    from core import stage

    cli = eval_cli()
    run = tmp_path / "run"
    stage.begin(run / "eval", {"draft_sha256": "x"})  # the eval stage's folder, as the pipeline makes it
    for name in ("report.json", "report.md", "accept_rate.png", "sts.json"):
        (run / "eval" / name).write_text(f"the run's own {name}")
    (run / "recipe.yaml").write_text("name: demo\n")
    (run / ".draftsmith.lock").write_text("")
    (tmp_path / "alias").symlink_to(run / "eval")
    export = tmp_path / "exp"
    export.mkdir()
    for name, text in (("config.json", "{}"), ("model.safetensors", "weights"), ("sts.json", "7 temperatures")):
        (export / name).write_text(text)
    before = {run: _snapshot(run), export: _snapshot(export)}
    in_run = f"is, or lies in, the run {run}"
    for out, why in ((run / "eval" / "nosuch" / "..", in_run), (tmp_path / "alias", in_run),
                     (export, "holds a draft or a serving export")):
        drill("bad-input", f"eval.py --out {out.relative_to(tmp_path)}")
        with pytest.raises(SystemExit) as refused:
            cli.main(["--draft", "ngram", "--target", "smollm2-135m-instruct", "--dataset", "mtbench", "--out",
                      str(out)])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and f"--out {out}" in err and why in err, err
    assert before == {run: _snapshot(run), export: _snapshot(export)}
    assert not (run / "eval" / "nosuch").exists()


def test_eval_py_out_takes_an_earlier_eval_py_report_but_no_other_folder(tmp_path):
    """A rerun into an earlier eval.py report replaces it; a folder holding anything else is not eval.py's to write
    into (a user's notes beside report.md would be kept, but its own report.json replaced)."""
    cli = eval_cli()
    earlier = tmp_path / "earlier"
    (earlier / "ngram").mkdir(parents=True)
    for name in ("report.json", "report.md", "accept_rate.png", "ngram/report.json", ".draftsmith.lock"):
        (earlier / name).write_text("an earlier report")
    assert cli.out_problem(earlier) is None and cli.out_problem(tmp_path / "new") is None
    (earlier / "notes.txt").write_text("mine")
    assert "holds files eval.py did not write (notes.txt)" in cli.out_problem(earlier)
    # a user's own recipe.yaml does not make a run of their folder; the run's lock or a stage folder beside it does
    (tmp_path / "recipe.yaml").write_text("name: mine\n")
    assert cli.out_problem(tmp_path / "new") is None
    (tmp_path / ".draftsmith.lock").write_text("")
    assert f"is, or lies in, the run {tmp_path}" in cli.out_problem(tmp_path / "new")


def test_a_small_file_that_meets_a_file_size_limit_names_itself_and_leaves_the_old_one(tmp_path):
    # the run's recipe.yaml, written before any stage, met the drills' file-size limit with a bare EFBIG traceback
    target = tmp_path / "recipe.yaml"
    target.write_text("old\n")
    script = ("import resource, sys; from core.io import atomic_write_text; "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); "
              f"atomic_write_text({str(target)!r}, 'x' * 1000)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0
    assert f"could not write {target}: [Errno 27] File too large" in done.stderr, done.stderr[-2000:]
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_a_write_failure_seen_again_by_its_folders_writer_keeps_one_message(tmp_path):
    # a checkpoint's writer names its folder when a file inside fails; the file's own failure already says it all
    from core.io import write_failure

    inner = write_failure(tmp_path / "step-4" / "config.json", OSError(28, "No space left on device"))
    outer = write_failure(tmp_path / "step-4", inner)
    assert str(outer) == str(inner) and str(outer).count("could not write") == 1 and isinstance(outer, OSError)
