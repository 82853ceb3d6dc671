"""The fault drills on a whole run (regenerate, cache, train, export on the tiny Qwen3): kill -9 at every stage's
fault point and a disk that fills during the cache and the checkpoint writes, in turn in one run folder; kill -9
at random times; corrupted files. Each faulted run must end, once rerun, with exactly the bytes of the uninterrupted
run, or be refused naming the damaged file, with nothing else lost. `make drills` runs these with every other drill
and prints the summary (conftest.drill_summary)."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, eval_cli, run_cli, tiny_overrides, tree_digest
from core.io import is_temporary
from core.recipe import load_recipe
from data.states.capture import open_cache
from modeling.target import load_tokenizer
from pipeline import main
from test_trainer import TRAIN, strip_timing

STAGES = "regenerate,cache,train,export"
SETS = {**TRAIN, "train.max_steps": 4}


def args_for(tiny_qwen3, prompt_file, out) -> list[str]:
    return ["--recipe", "dspark_qwen3_8b", "--stages", STAGES, "--out", str(out)] + tiny_overrides(
        tiny_qwen3, prompt_file, **SETS)


def artefacts(out) -> dict:
    """What a run leaves that must not depend on how often it was killed: every file of the regenerated records,
    the cache, the final draft and the export (not DONE.json's timings), and the metrics without their timings."""
    files = {}
    for stage_dir in ("regen", "cache", "train/final", "export"):
        for name, digest in tree_digest(out / stage_dir).items():
            if not name.endswith("DONE.json"):
                files[f"{stage_dir}/{name}"] = digest
    rows = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    files["train/metrics.jsonl"] = strip_timing(rows)
    return files


def leftovers(out) -> list[str]:
    """Temporary files and folders under `out` (a killed write leaves them; the next run removes them)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob(".*") if is_temporary(p.name))


@pytest.fixture(scope="module")
def clean(tiny_qwen3, prompt_file, tmp_path_factory):
    """The uninterrupted run (a subprocess, as the faulted ones) and its wall time."""
    out = tmp_path_factory.mktemp("clean") / "run"
    start = time.perf_counter()
    done = run_cli(args_for(tiny_qwen3, prompt_file, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return {"out": out, "seconds": time.perf_counter() - start, "artefacts": artefacts(out)}


def test_every_fault_point_and_a_full_disk_then_the_rerun_gives_the_same_bytes(clean, tiny_qwen3, prompt_file,
                                                                               tmp_path, drill):
    """One run folder, faulted in pipeline order (each rerun gets past the last fault and meets the next): kill -9 at
    every stage's fault point, and a disk that fills (RLIMIT_FSIZE) during the cache's shards and the first
    checkpoint. A full disk fails the write naming the file and the room left, marks nothing done and publishes
    nothing half-written. After the kill in training, `latest` naming a missing checkpoint is refused and a cut-off
    metrics line is dropped on resume. The last rerun ends with exactly the uninterrupted run's files."""
    largest = {stage_dir: max(p.stat().st_size for p in (clean["out"] / stage_dir).rglob("*") if p.is_file())
               for stage_dir in ("regen", "cache", "train/checkpoints")}
    assert largest["regen"] < largest["cache"] < largest["train/checkpoints"], largest
    out = tmp_path / "run"
    args = args_for(tiny_qwen3, prompt_file, out)
    checkpoints = out / "train" / "checkpoints"
    faults = [("kill", "regenerate:1"), ("disk-full", "regen"), ("kill", "cache:1"), ("disk-full", "cache"),
              ("kill", "train:3"), ("kill", "train-save:4"), ("kill", "export:0")]
    for kind, where in faults:
        if kind == "kill":
            done = run_cli(args, {"DRAFTSMITH_KILL_AT": where})
            assert done.returncode == -signal.SIGKILL, f"{where}: {done.stderr[-3000:]}"
            drill("kill", f"kill -9 at {where}")
        else:  # every file of the stages before fits, and the run's recipe.yaml; the next stage's largest does not
            fits = max(largest[where], (out / "recipe.yaml").stat().st_size)
            assert fits < largest[{"regen": "cache", "cache": "train/checkpoints"}[where]]
            done = run_cli(args, file_size_limit=fits + 1)
            assert done.returncode != 0 and "could not write" in done.stderr, done.stderr[-3000:]
        if where == "regenerate:1":
            assert not (out / "regen" / "DONE.json").exists()
        if where == "regen":
            assert "shard-00000.bin" in done.stderr and "GiB free" in done.stderr, done.stderr[-3000:]
            assert (out / "regen" / "DONE.json").is_file() and not (out / "cache" / "manifest.json").exists()
            drill("disk-full", "disk full while writing cache shards")
        if where == "cache:1":  # a half-written cache is refused by its reader, not read
            assert not (out / "cache" / "manifest.json").exists()
            recipe = load_recipe("dspark_qwen3_8b", ["target.name_or_path=" + str(tiny_qwen3)])
            with pytest.raises(Exception, match="re-run the cache stage"):
                open_cache(recipe, out / "cache", 64, load_tokenizer(str(tiny_qwen3)))
        if where == "cache":
            assert "step-0000002" in done.stderr, done.stderr[-3000:]
            assert (out / "cache" / "DONE.json").is_file() and not (checkpoints / "latest").exists()
            drill("disk-full", "disk full while writing a checkpoint")
        if where == "train:3":  # two damages a kill can meet on its way: `latest` naming a missing checkpoint...
            assert (checkpoints / "latest").read_text().strip() == "step-0000002"
            log = out / "train" / "metrics.jsonl"
            with open(log, "a") as handle:
                handle.write('{"step": 4, "lo')  # ...and the last metrics line cut short (by the kill, or a full disk)
            before = log.read_bytes()
            (checkpoints / "step-0000002").rename(checkpoints / "moved-away")
            refused = run_cli(args)
            assert refused.returncode != 0 and f"{checkpoints / 'step-0000002'}, which is missing" in refused.stderr
            assert log.read_bytes() == before and not (out / "train" / "DONE.json").exists()  # nothing restarted at 0
            (checkpoints / "moved-away").rename(checkpoints / "step-0000002")
            drill("corruption", "`latest` naming a removed checkpoint")
        if where == "train-save:4":  # killed mid-save: `latest` still names the last complete checkpoint
            assert "dropping its cut-off last line" in done.stdout  # this run resumed from the train:3 kill
            drill("corruption", "metrics.jsonl cut mid-line, then resumed")
            assert (checkpoints / "latest").read_text().strip() == "step-0000002"
            assert not (checkpoints / "step-0000004" / "trainer_state.pt").exists()
    assert not (out / "export" / "DONE.json").exists()
    resumed = run_cli(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "temporary file(s) an interrupted run left" in resumed.stdout  # the export's, killed mid-write
    assert artefacts(out) == clean["artefacts"] and leftovers(out) == []


def test_kill_at_random_times_then_rerun_gives_the_same_bytes(clean, tiny_qwen3, prompt_file, tmp_path, drill):
    out = tmp_path / "run"
    args = args_for(tiny_qwen3, prompt_file, out)
    rng = random.Random(20261201)
    for cycle in range(3):
        delay = rng.uniform(0.15, 0.9) * clean["seconds"]
        proc = subprocess.Popen([sys.executable, "train/main.py"] + args, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        drill("random-kill", f"kill -9 after {delay:.1f} s (cycle {cycle})")
    resumed = run_cli(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert artefacts(out) == clean["artefacts"] and leftovers(out) == []


def _flip_byte(path, at=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# (what is damaged, how, the stages rerun, a fragment the refusal must hold, the file it must name)
CORRUPTIONS = [
    ("cache/manifest.json", lambda p: p.write_text(p.read_text()[:-40]), "train", "manifest", "manifest.json"),
    ("cache/index.bin", _truncate, "train", "index", "index.bin"),
    ("cache/shard-00001.bin", _flip_byte, "train", "crc", "shard-00001.bin"),
    ("train/checkpoints/latest", lambda p: p.write_text("../../etc\n"), "train", "refusing", "latest"),
    ("train/checkpoints/step-0000004/trainer_state.pt", _truncate, "train", "damaged", "trainer_state.pt"),
    ("train/checkpoints/step-0000004/optimizer.pt", _flip_byte, "train", "damaged", "optimizer.pt"),
    ("train/checkpoints/step-0000004/draft/model.safetensors", _flip_byte, "train", "damaged", "model.safetensors"),
]


@pytest.mark.parametrize("damaged,damage,stages,cause,named", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_a_corrupted_file_is_refused_naming_it_and_nothing_else_changes(clean, tiny_qwen3, prompt_file, tmp_path,
                                                                       drill, capsys, damaged, damage, stages,
                                                                       cause, named):
    out = tmp_path / "run"
    shutil.copytree(clean["out"], out)
    if stages == "train" and damaged.startswith("cache/"):
        shutil.rmtree(out / "train")  # a new training run on the damaged cache
    else:
        (out / "train" / "DONE.json").unlink()  # a resume from the damaged checkpoint
    damage(out / damaged)
    before = tree_digest(out)
    before.pop(".draftsmith.lock")  # the lock file holds the running process's pid
    args = args_for(tiny_qwen3, prompt_file, out)
    args[args.index("--stages") + 1] = stages
    try:
        code = main(args)
    except Exception as refused:  # noqa: BLE001 - a refusal the pipeline does not print as an `error:` line
        code, message = 2, str(refused)
    else:
        message = capsys.readouterr().err
    assert code == 2 and cause in message.lower() and named in message, message
    after = tree_digest(out)
    assert {name: after.get(name) for name in before} == before  # every file as it was: none changed, none removed
    drill("corruption", f"damaged {damaged}")


# --- the user's files and damage found after a stage finished -----------------------------------------------------

# Names a user may keep in --out that look like temporaries (a whole folder among them): a run never removes them.
USER_FILES = [".bashrc.old-2023", ".latex.old-backup/notes.tex", ".notes.tmp", ".x.tmp-1", "mine/.draft.abcdefgh.tmp",
              "regen/.records.old-copy", "train/.plan.tmp-v2", ".thesis.tex.old-12345678/ch1.tex"]


def test_a_run_removes_only_the_temporaries_it_wrote(clean, tiny_qwen3, prompt_file, tmp_path, drill):
    out = tmp_path / "run"
    shutil.copytree(clean["out"], out)
    for name in USER_FILES:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("the user's\n")
    # what a killed run of ours leaves: a half-written recipe.yaml and records.jsonl, a half-published final draft
    ours = [".recipe.yaml.k3j_9x2a.tmp", "regen/.records.jsonl.ab12cd34.tmp", "train/.final.tmp-q1w2e3r4/x"]
    for name in ours:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("half written\n")
    assert main(args_for(tiny_qwen3, prompt_file, out)) == 0
    assert [name for name in USER_FILES if (out / name).read_text() != "the user's\n"] == []
    assert [name for name in ours if (out / name.split("/x")[0]).exists()] == []
    drill("corruption", "user files with temporary-looking names in --out")


def _cut_lines(path, keep=5):
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:keep]))


# (what is damaged after its stage finished, how, the stages rerun, the fragment the refusal must hold)
DAMAGED_OUTPUTS = [
    ("regen/records.jsonl", _cut_lines, "cache,train", "bytes"),
    ("regen/records.jsonl", _flip_byte, "cache,train", "damaged"),
    ("regen/records.jsonl", lambda p: p.unlink(), "cache,train", "missing"),
    ("train/final/model.safetensors", _flip_byte, "export", "damaged"),
    ("train/final/model.safetensors", _truncate, "export", "damaged"),
    ("train/final/model.safetensors", lambda p: p.unlink(), "export", "missing"),
]


@pytest.mark.parametrize("damaged,damage,stages,cause", DAMAGED_OUTPUTS,
                         ids=[f"{d[0]}-{d[1].__name__.strip('_<>')}-{d[3]}" for d in DAMAGED_OUTPUTS])
def test_damage_after_a_stage_finished_is_refused_naming_the_file(clean, tiny_qwen3, prompt_file, tmp_path, capsys,
                                                                  drill, damaged, damage, stages, cause):
    out = tmp_path / "run"
    shutil.copytree(clean["out"], out)
    for later in ("cache", "train", "export") if damaged.startswith("regen/") else ("export",):
        shutil.rmtree(out / later)  # the stages that read the damaged file run again
    damage(out / damaged)
    before = tree_digest(out)
    args = args_for(tiny_qwen3, prompt_file, out)
    args[args.index("--stages") + 1] = stages
    try:
        code = main(args)
    except (ValueError, FileNotFoundError) as refused:  # export's own refusal
        code, message = 2, str(refused)
    else:
        message = capsys.readouterr().err
    assert code == 2 and cause in message and str(out / damaged) in message, message
    after = tree_digest(out)
    before.pop(".draftsmith.lock", None)
    assert {name: after.get(name) for name in before} == before  # nothing lost or changed
    assert set(after) - set(before) <= {".draftsmith.lock", "export/settings.json"}  # nothing built from it
    drill("corruption", f"{damaged} damaged after its stage finished ({cause})")


def test_a_checkpoint_stores_the_frozen_weights_once(clean):
    step = clean["out"] / "train" / "checkpoints" / "step-0000004"
    from safetensors.torch import load_file
    from train.checkpoint import load_tensors

    draft = load_file(str(step / "draft" / "model.safetensors"))
    trained = load_tensors(step / "trainer_state.pt")["model"]
    frozen = {"embed_tokens.weight", "lm_head.weight"}  # the target's copies in a DSpark draft
    assert frozen <= set(draft)
    assert not {name for name in trained if name.removeprefix("draft.") in frozen}
    assert {name.removeprefix("draft.") for name in trained if name.startswith("draft.")} == set(draft) - frozen


@pytest.mark.parametrize("stages,removed,what", [("cache,train", "cache", "the hidden-state cache"),
                                                 ("train", "train", "checkpoint step-0000002")])
def test_a_full_disk_is_refused_before_the_cache_or_a_checkpoint_is_written(clean, tiny_qwen3, prompt_file, tmp_path,
                                                                            monkeypatch, drill, stages, removed, what):
    import shutil as shutil_module
    from collections import namedtuple

    out = tmp_path / "run"
    shutil.copytree(clean["out"], out)
    for later in ("cache", "train", "export") if removed == "cache" else ("train", "export"):
        shutil.rmtree(out / later)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(10**6, 10**6 - 4096, 4096))
    args = args_for(tiny_qwen3, prompt_file, out)
    args[args.index("--stages") + 1] = stages
    with pytest.raises(OSError) as refused:
        main(args)
    message = str(refused.value)
    assert f"not enough free space for {what}" in message and "4,096 bytes" in message, message
    assert ("train.hidden_states=online" in message) == (removed == "cache")
    assert not (out / removed / "DONE.json").exists()
    drill("disk-full", f"free space checked before {what}")


def test_a_refused_run_leaves_the_folders_recipe_as_it_was(clean, tiny_qwen3, prompt_file, tmp_path, capsys, drill):
    out = tmp_path / "run"
    shutil.copytree(clean["out"], out)
    before = (out / "recipe.yaml").read_bytes()
    args = args_for(tiny_qwen3, prompt_file, out) + ["--set", "regen.max_new_tokens=5"]
    assert main(args) == 2
    assert "regen.max_new_tokens: 6 in the folder, 5 now" in capsys.readouterr().err
    assert (out / "recipe.yaml").read_bytes() == before  # the recipe its stages were made with
    drill("bad-input", "a rerun with other settings than the folder's")


def test_a_real_full_disk_then_room_made_the_rerun_gives_the_same_bytes(clean, tiny_qwen3, prompt_file, tmp_path,
                                                                        drill):
    """A tmpfs smaller than the run (not a simulated limit): the run stops naming the folder and the bytes free;
    once the disk is made larger, the rerun ends with the uninterrupted run's bytes."""
    size = sum(p.stat().st_size for p in clean["out"].rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    small = (size * 6 // 10) // 4096 * 4096
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={small}", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN); the RLIMIT_FSIZE drill above still runs")
    try:
        out = disk / "run"
        full = run_cli(args_for(tiny_qwen3, prompt_file, out))
        assert full.returncode != 0
        assert "free" in full.stderr and str(out) in full.stderr, full.stderr[-3000:]
        assert "not enough free space" in full.stderr or "could not write" in full.stderr, full.stderr[-3000:]
        subprocess.run(["mount", "-o", f"remount,size={size * 3}", str(disk)], check=True)
        resumed = run_cli(args_for(tiny_qwen3, prompt_file, out))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert artefacts(out) == clean["artefacts"] and leftovers(out) == []
        drill("disk-full", f"a real {small // 1024} KiB tmpfs, then made larger")
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# --- planted links: at every path a run writes, a link to a file outside --out ------------------------------------

# (the stage, its folder under --out); the eval stage runs here too, so its folder is drilled as well
LINKED_STAGES = [("regenerate", "regen"), ("cache", "cache"), ("train", "train"), ("eval", "eval"),
                 ("export", "export")]
# names a run writes that a finished run no longer holds: the cache writer's fixed scratch names, a half-written
# recipe.yaml's temporary
SCRATCH = ["cache/shard-00000.bin.tmp", "cache/shard-00000.idx.json.tmp", "cache/writer-plan.json",
           "cache/index.bin.tmp", "cache/manifest.json.tmp", ".recipe.yaml.abcd1234.tmp"]
EVAL_SETS = ["--set", "eval.num_samples=1", "--set", "eval.max_new_tokens=4", "--set", "eval.ngram_baseline=false"]


class Planted:
    """Links planted in a folder, each to a file of its own outside it, and the check that none was written
    through: every outside file keeps its bytes, and each link was refused by name or replaced by the run's own."""

    def __init__(self, outside):
        self.outside, self.links = outside, {}

    def plant(self, at) -> None:
        victim = self.outside / f"victim-{len(self.links)}"
        victim.parent.mkdir(parents=True, exist_ok=True)
        victim.write_bytes(f"outside file {len(self.links)}, linked from {at}\n".encode())
        at.parent.mkdir(parents=True, exist_ok=True)
        if at.is_dir() and not at.is_symlink():
            shutil.rmtree(at)
        at.unlink(missing_ok=True)
        at.symlink_to(victim)
        self.links[at] = victim

    def check(self, code: int, message: str, drill) -> None:
        for link, victim in self.links.items():
            assert victim.read_bytes() == f"outside file {victim.name.split('-')[1]}, linked from {link}\n".encode()
            if link.is_symlink():  # left in place: the run must have refused, naming it
                assert code != 0 and f"{link} is a symbolic link" in message, (link, code, message[-2000:])
            drill("link", f"{link.name} ({'refused' if link.is_symlink() else 'replaced'})")


def exit_code(main_function, args) -> int:
    try:
        return main_function(args)
    except SystemExit as refused:  # argparse's refusal
        return refused.code


def _written(folder) -> tuple[list[str], list[str]]:
    """(files, folders) under `folder`, relative, links not followed."""
    files, folders = [], []
    for path in sorted(folder.rglob("*")):
        (folders if path.is_dir() else files).append(str(path.relative_to(folder)))
    return files, folders


def with_stages(args: list[str], stages: str) -> list[str]:
    return [stages if i and args[i - 1] == "--stages" else a for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def evaluated(clean, tiny_qwen3, prompt_file, tmp_path_factory):
    """The clean run with its eval stage run too (sts.json, report.json beside the export's inputs)."""
    out = tmp_path_factory.mktemp("evaluated") / "run"
    shutil.copytree(clean["out"], out)
    assert main(with_stages(args_for(tiny_qwen3, prompt_file, out), "eval") + EVAL_SETS) == 0
    return out


def test_a_link_planted_where_a_run_writes_is_refused_or_replaced(evaluated, tiny_qwen3, prompt_file, tmp_path,
                                                                  capsys, drill):
    """At the path of every file and folder a full run writes (each stage, the run's recipe and lock; then eval.py and
    export/main.py), a link to a file outside --out: the run refuses it, naming it, or replaces it with its own file,
    and the outside file keeps its bytes. A stage folder's files are planted together (the refusal names them all),
    each folder alone (a link there hides what is below it)."""
    ref = evaluated
    files, folders = _written(ref)
    files += SCRATCH
    runs = 0
    for name, folder in LINKED_STAGES + [("export", ".")]:  # the run's own recipe and lock: planted one at a time
        own = lambda path: path.split("/")[0] == folder if folder != "." else "/" not in path  # noqa: E731
        plantings = [[f] for f in files if own(f)] if folder == "." else \
            [[f for f in files if own(f)]] + [[d] for d in folders if own(d)]
        for paths in plantings:
            out = tmp_path / f"run-{runs}"
            shutil.copytree(ref, out, ignore=lambda d, names: [".draftsmith.lock"] if d == str(ref) else [])
            if folder != ".":
                shutil.rmtree(out / folder)  # the stage runs again
            planted = Planted(tmp_path / f"outside-{runs}")
            for path in paths:
                planted.plant(out / path)
            code = main(with_stages(args_for(tiny_qwen3, prompt_file, out), name) + EVAL_SETS)
            planted.check(code, capsys.readouterr().err, drill)
            runs += 1
    # eval.py: its report files (links replaced), its lock and its --out (refused)
    cli = eval_cli()
    eval_args = ["--draft", str(ref / "train" / "final"), "--target", str(tiny_qwen3), "--dataset", str(prompt_file),
                 "--num-samples", "1", "--max-new-tokens", "4", "--no-scheduler"]
    assert cli.main(eval_args + ["--out", str(tmp_path / "eval-ref")]) == 0
    report_files, _ = _written(tmp_path / "eval-ref")
    for paths in [[f for f in report_files if f != ".draftsmith.lock"], [".draftsmith.lock"], ["."]]:
        out = tmp_path / f"eval-{runs}"
        planted = Planted(tmp_path / f"outside-{runs}")
        for path in paths:
            planted.plant(out / path if path != "." else out)
        planted.check(exit_code(cli.main, eval_args + ["--out", str(out)]), capsys.readouterr().err, drill)
        runs += 1
    # export/main.py: its --out and the lock beside it
    from export.main import main as export_main

    for path in ("exp", ".exp.lock"):
        planted = Planted(tmp_path / f"outside-{runs}")
        planted.plant(tmp_path / f"export-{runs}" / path)
        code = export_main(["--checkpoint", str(ref / "train" / "final"), "--to", "sglang", "--out",
                            str(tmp_path / f"export-{runs}" / "exp")])
        planted.check(code, capsys.readouterr().err, drill)
        runs += 1


def test_the_sweep_never_touches_a_folder_without_the_stage_marker(tiny_qwen3, prompt_file, tmp_path, drill):
    """A user's project as --out, whose `export/` holds another application's settings.json and files with
    temporary-looking names: the run's sweep leaves them all (it used to delete them), and sweeps its own."""
    out = tmp_path / "userproj"
    theirs = ["export/settings.json", "export/dist/.bundle.js.a1b2c3d4.tmp", "export/dist/.assets.tmp-zz99yy88/logo.png",
              ".notes.md.k3j_9x2a.tmp"]
    for name in theirs:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("the user's\n")
    args = with_stages(args_for(tiny_qwen3, prompt_file, out), "regenerate")
    assert main(args) == 0
    assert [name for name in theirs if not (out / name).is_file()] == []
    # a temporary of ours in the run's own (marked) stage folder does go
    (out / "regen" / ".records.jsonl.ab12cd34.tmp").write_text("half written\n")
    assert main(args) == 0
    assert not (out / "regen" / ".records.jsonl.ab12cd34.tmp").exists()
    assert [name for name in theirs if not (out / name).is_file()] == []
    drill("corruption", "another application's settings.json and temporary-looking files in --out")


def test_outputs_edited_or_their_checksums_deleted_after_their_stage_are_refused(evaluated, tiny_qwen3, prompt_file,
                                                                               tmp_path, capsys, drill):
    """The eval stage records report.json and sts.json, the train stage final/checksums.json: an STS edited by hand
    is not exported, a report rewritten by another eval is not printed as the run's, and deleting checksums.json
    does not turn the draft's verification off."""
    for damaged, stages in [("eval/sts.json", "export"), ("eval/report.json", "eval"),
                            ("train/final/checksums.json", "export")]:
        out = tmp_path / damaged.replace("/", "-")
        shutil.copytree(evaluated, out, ignore=lambda d, names: [".draftsmith.lock"] if d == str(evaluated) else [])
        shutil.rmtree(out / "export")
        if damaged.endswith("checksums.json"):
            (out / damaged).unlink()
            _flip_byte(out / "train" / "final" / "model.safetensors")
        else:
            (out / damaged).write_text((out / damaged).read_text().replace("1", "2", 1))
        assert main(with_stages(args_for(tiny_qwen3, prompt_file, out), stages) + EVAL_SETS) == 2
        message = capsys.readouterr().err
        assert str(out / damaged) in message and "refusing to read it" in message, message
        assert not (out / "export" / "DONE.json").exists()
        drill("corruption", f"{damaged} {'deleted' if damaged.endswith('checksums.json') else 'edited'} after its stage")
