"""Resume safety of the trainer's checkpoints, without training: the `latest` pointer is a plain step folder name or
refused, checkpoint files load without unpickling code, checkpoints reach the disk before `latest` names them,
pruning never deletes what `latest` names, metrics.jsonl survives a cut-off last line, the wandb run id is stable
across processes. A DeepSpeed ZeRO checkpoint resumed on another number of ranks is refused before anything loads
(a DDP one resumes). (The end-to-end resumes are in tests/test_trainer.py.)"""

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train.checkpoint as checkpoint
import train.trainer as trainer
from conftest import ROOT, run_cli
from core.dist import Dist
from core.io import write_checksums
from core.recipe import load_recipe
from pipeline import check_inputs
from test_trainer import train_args


def make_checkpoints(root: Path, steps, latest=None):
    for step in steps:
        (root / f"step-{step:07d}").mkdir(parents=True)
        (root / f"step-{step:07d}" / "trainer_state.pt").write_bytes(b"x")
    if latest is not None:
        (root / "latest").write_text(latest + "\n")


def test_latest_pointer_is_a_plain_step_name_inside_the_checkpoint_folder(tmp_path, drill):
    drill("corruption", "`latest` holding a path, a link, garbage")
    root = tmp_path / "checkpoints"
    make_checkpoints(root, [2, 4], latest="step-0000004")
    assert checkpoint.latest_checkpoint(root) == root / "step-0000004"
    (tmp_path / "elsewhere").mkdir()
    for bad in ("../elsewhere", str(tmp_path / "elsewhere"), "step-4", "step-0000004/../step-0000002", ""):
        (root / "latest").write_text(bad + "\n")
        with pytest.raises(ValueError, match="step-0001000") as err:
            checkpoint.latest_checkpoint(root)
        assert str(root / "latest") in str(err.value)
    # a link named like a checkpoint, pointing out of the folder
    (root / "latest").write_text("step-0000006\n")
    (root / "step-0000006").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match="a link"):
        checkpoint.latest_checkpoint(root)


def test_latest_naming_a_missing_folder_fails_naming_it(tmp_path, drill):
    drill("corruption", "`latest` naming a missing checkpoint")
    root = tmp_path / "checkpoints"
    make_checkpoints(root, [2], latest="step-0000004")
    with pytest.raises(FileNotFoundError) as err:
        checkpoint.latest_checkpoint(root)
    assert str(root / "step-0000004") in str(err.value) and "delete" in str(err.value)
    assert checkpoint.latest_checkpoint(tmp_path / "none-yet") is None


class Payload:
    """Unpickling this runs code (touches a file): what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_checkpoint_files_load_without_running_code(tmp_path, drill):
    drill("corruption", "crafted trainer_state.pt / optimizer.pt")
    ckpt, marker = tmp_path / "step-0000002", tmp_path / "code-ran"
    ckpt.mkdir()
    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    engine = SimpleNamespace(kind="ddp")
    # what the trainer writes loads with weights_only=True
    torch.save({"step": 2, "model": module.state_dict(), "first_metrics": {"loss": 1.0, "accept_rate": [0.5]},
                "last_metrics": {"loss": 0.5}}, ckpt / "trainer_state.pt")
    torch.save({"optimizer": optimizer.state_dict()}, ckpt / "optimizer.pt")
    fresh = torch.nn.Linear(2, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(ValueError, match="checksums.json is missing"):  # every checkpoint the trainer saves has one
        checkpoint.load_checkpoint(engine, fresh, fresh_opt, ckpt)
    write_checksums(ckpt)
    state = checkpoint.load_checkpoint(engine, fresh, fresh_opt, ckpt)
    assert state["step"] == 2 and torch.equal(fresh.weight, module.weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
    # a crafted file is refused, naming it, and its code never runs
    for name in ("trainer_state.pt", "optimizer.pt"):
        good = (ckpt / name).read_bytes()
        torch.save({"step": 2, "model": module.state_dict(), "optimizer": Payload(marker)}, ckpt / name)
        write_checksums(ckpt)  # checksums that match: the crafted file itself must be refused
        with pytest.raises(ValueError, match="could run code") as err:
            checkpoint.load_checkpoint(engine, fresh, fresh_opt, ckpt)
        assert str(ckpt / name) in str(err.value)
        assert not marker.exists()
        (ckpt / name).write_bytes(good[: len(good) // 2])  # cut short (a full disk, a copy that stopped)
        write_checksums(ckpt)
        with pytest.raises(ValueError, match="truncated or corrupt") as err:
            checkpoint.load_checkpoint(engine, fresh, fresh_opt, ckpt)
        assert str(ckpt / name) in str(err.value)
        (ckpt / name).write_bytes(good)


class TinyDraft(torch.nn.Linear):
    def save_draft(self, folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"weights")


def test_checkpoint_is_on_disk_before_latest_names_it(tmp_path, monkeypatch):
    events = []
    real_fsync, real_write = os.fsync, checkpoint.atomic_write_text

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def write(path, text):
        events.append(("publish", str(path)))
        return real_write(path, text)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(checkpoint, "atomic_write_text", write)
    module = TinyDraft(2, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    root = tmp_path / "checkpoints"
    average = {"weight": torch.zeros(2, 2), "bias": torch.ones(2)}  # train.ema_decay's, in its own file
    path = checkpoint.save_checkpoint(SimpleNamespace(kind="ddp"), module, optimizer, 2, root, Dist(), {}, average)
    published = events.index(("publish", str(root / "latest")))
    synced = {p for kind, p in events[:published] if kind == "fsync"}
    files = {os.path.realpath(p) for p in path.rglob("*")} | {os.path.realpath(path)}
    assert files and files <= synced, files - synced
    assert "ema.pt" in json.loads((path / "checksums.json").read_text())  # a damaged average is refused on resume
    assert checkpoint.read_average(path).keys() == average.keys()


def test_a_full_disk_is_refused_before_train_final_is_published(tmp_path, monkeypatch, drill):
    """The last checkpoint is copied to train/final at the end: checked for room first, like each checkpoint."""
    drill("disk-full", "free space checked before train/final")
    root = tmp_path / "train" / "checkpoints"
    make_checkpoints(root, [2], latest="step-0000002")
    (root / "step-0000002" / "draft").mkdir()
    (root / "step-0000002" / "draft" / "model.safetensors").write_bytes(b"w" * 10_000)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 4096, 4096))
    job = SimpleNamespace(recipe=SimpleNamespace(train=SimpleNamespace(max_steps=2, ema_decay=0.0)),
                          out_dir=tmp_path / "train", dist=Dist())
    with pytest.raises(OSError, match="not enough free space for the final draft") as refused:
        trainer.finish(job, root, None, {"loss": 1.0})
    assert "10,000 bytes" in str(refused.value) and "4,096 bytes" in str(refused.value)
    assert not (tmp_path / "train" / "final").exists() and not (tmp_path / "train" / "DONE.json").exists()


def test_pruning_keeps_what_latest_names_and_leaves_newer_half_written_folders(tmp_path):
    root = tmp_path / "checkpoints"
    # step-6 was being written when the run was killed: `latest` still names step-4
    make_checkpoints(root, [2, 4, 6], latest="step-0000004")
    deleted = checkpoint.prune_checkpoints(root, keep=1)
    assert [p.name for p in deleted] == ["step-0000002"]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-0000004", "step-0000006"]
    assert checkpoint.prune_checkpoints(root, keep=0) == []


def logger_recipe():
    return SimpleNamespace(name="r", train=SimpleNamespace(wandb_project=None))


def test_metrics_with_a_cut_off_last_line_resume(tmp_path, drill):
    drill("corruption", "metrics.jsonl cut mid-line")
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    path.write_text("\n".join(rows) + '\n{"step": 4, "lo')  # killed (or disk full) mid-append
    trainer.Logger(tmp_path, logger_recipe(), Dist(), resume_step=2).close()
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"


def test_metrics_corrupt_before_the_end_is_an_error_naming_file_and_line(tmp_path, drill):
    drill("corruption", "metrics.jsonl corrupt mid-file")
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nGARBAGE\n{"step": 3}\n')
    with pytest.raises(ValueError) as err:
        trainer.Logger(tmp_path, logger_recipe(), Dist(), resume_step=3)
    assert f"{path}: line 2" in str(err.value)
    assert path.read_text() == '{"step": 1}\nGARBAGE\n{"step": 3}\n'  # nothing rewritten


def test_wandb_run_id_is_the_same_in_every_process(tmp_path):
    code = ("import sys; from pathlib import Path; from train.trainer import wandb_run_id; "
            "print(wandb_run_id('dspark', Path(sys.argv[1])))")
    ids = {subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONHASHSEED=str(seed)), check=True).stdout.strip()
           for seed in (1, 2, 3)}
    assert len(ids) == 1 and ids.pop().startswith("dspark-")
    assert trainer.wandb_run_id("dspark", tmp_path / "run") != trainer.wandb_run_id("dspark", tmp_path / "other")


def test_deepspeed_checkpoints_load_without_running_code(tmp_path, drill):
    drill("corruption", "crafted DeepSpeed checkpoint")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "deepspeed_load_worker.py"), str(tmp_path / "ckpt"),
                           str(tmp_path / "code-ran")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["step"] == 1 and result["same_weights"]
    assert "could run code" in result["crafted"] and "optim_states.pt" in result["crafted"]
    assert not result["code_ran"]


# --- the rank count a checkpoint resumes on -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cached_run(tiny_qwen3, prompt_file, tmp_path_factory):
    """A dspark_qwen3_8b run folder with its regenerate and cache stages done (the tiny Qwen3); tests copy it."""
    out = tmp_path_factory.mktemp("cached")
    done = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out, stages="regenerate,cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def killed_after_first_save(cached_run, tiny_qwen3, prompt_file, out, ranks, zero_stage):
    """A train run on `ranks` ranks killed (every rank) right after its step-2 checkpoint; returns its args."""
    shutil.copytree(cached_run, out)
    args = train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out,
                      **{"train.zero_stage": zero_stage, "train.max_steps": 4, "train.save_every": 2})
    killed = run_cli(args, {"DRAFTSMITH_KILL_AT": "train:2"}, torchrun=ranks if ranks > 1 else None)
    assert killed.returncode != 0 and not (out / "train" / "DONE.json").exists(), killed.stderr[-3000:]
    assert (out / "train" / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    layout = json.loads((out / "train" / "checkpoints" / "step-0000002" / checkpoint.LAYOUT_NAME).read_text())
    assert layout == {"engine": "deepspeed" if zero_stage else "ddp", "world_size": ranks}
    return args


def test_a_zero_checkpoint_resumed_on_another_rank_count_is_refused_before_anything_loads(
        cached_run, tiny_qwen3, prompt_file, tmp_path, drill):
    """ZeRO-2 splits the optimizer state per rank (elastic checkpoints off): a 2-rank run's checkpoint resumed on 1
    rank used to fail inside DeepSpeed's load, after every rank had loaded the target and tokenized the records. The
    input check refuses it first (exit 2) naming the 2 ranks it needs; on 2 ranks the check passes."""
    drill("bad-input", "ZeRO-2 checkpoint of 2 ranks resumed on 1")
    out = tmp_path / "run"
    args = killed_after_first_save(cached_run, tiny_qwen3, prompt_file, out, ranks=2, zero_stage=2)
    before = sorted(p.name for p in (out / "train").rglob("*"))
    resumed = run_cli(args)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "--stages train:" in resumed.stderr and "on 2 rank(s)" in resumed.stderr
    assert "--nproc_per_node 2" in resumed.stderr and "this run has 1" in resumed.stderr
    # refused by the input check: the run never started (its first line comes before the target loads)
    assert "[draftsmith] recipe" not in resumed.stdout and "resuming from" not in resumed.stdout
    assert sorted(p.name for p in (out / "train").rglob("*")) == before
    overrides = [arg for arg in args[args.index("--out") + 2:] if arg != "--set"]
    recipe = load_recipe("dspark_qwen3_8b", overrides)
    assert check_inputs(recipe, ["train"], out, 2) == []
    assert len(check_inputs(recipe, ["train"], out, 1)) == 1


def test_a_ddp_checkpoint_resumes_on_another_rank_count(cached_run, tiny_qwen3, prompt_file, tmp_path):
    """DDP's checkpoint holds the whole optimizer state (rank 0's optimizer.pt) and every step's global batch is cut
    from the same indices whatever the rank count: a 1-rank run's checkpoint resumes on 2 ranks, not refused."""
    out = tmp_path / "run"
    args = killed_after_first_save(cached_run, tiny_qwen3, prompt_file, out, ranks=1, zero_stage=0)
    resumed = run_cli(args, torchrun=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "2 rank(s)" in resumed.stdout
    assert (out / "train" / "DONE.json").exists()
