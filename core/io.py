"""Atomic, durable file and folder publishing: the one place DraftSmith writes anything a crash could leave half done.

A reader sees the old file (or folder) or the whole new one, never a part: everything is written under a temporary
name in the destination's own folder, fsynced, then moved into place with os.replace, and the folder entry is
fsynced too (a rename is only durable once the directory itself reaches the disk).

    atomic_write_json(run / "DONE.json", stats)
    with publish_dir(out / "final") as tmp:     # tmp is a fresh folder beside out/final
        save_something(tmp)                     # on success it replaces out/final in one rename
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, Iterator

FILE_MODE = 0o644  # mkstemp makes files 0600; a serving engine may read them as another user


def fsync_dir(path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_file(handle) -> None:
    """Flush an open file object all the way to the disk."""
    handle.flush()
    os.fsync(handle.fileno())


def replace(src, dst) -> None:
    """os.replace(src, dst), durable: the destination folder's entry is fsynced."""
    os.replace(src, dst)
    fsync_dir(Path(dst).resolve().parent)


def atomic_write_bytes(path, data: bytes, *, tmp_path=None) -> None:
    """Write `data` to `path` atomically. `tmp_path` fixes the temporary name (a format whose recovery recognises
    its own scratch files, like the hidden-state cache); by default it is a unique name beside `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tmp_path is None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        handle = os.fdopen(fd, "wb")
    else:
        tmp = str(tmp_path)
        handle = open(tmp, "wb")
    try:
        with handle:
            handle.write(data)
            sync_file(handle)
        os.chmod(tmp, FILE_MODE)
        replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path, validate: Callable | None = None):
    """json.load(path), then `validate(obj)` if given; every error (bad JSON or invalid content) names the file."""
    with open(path) as handle:
        try:
            obj = json.load(handle)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
    if validate is None:
        return obj
    try:
        return validate(obj)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def sync_tree(root) -> None:
    """fsync every file and folder under `root` (before a pointer to it is published)."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(folder)


@contextlib.contextmanager
def publish_dir(dst, *, if_exists: str = "replace") -> Iterator[Path]:
    """Yield a fresh temporary folder beside `dst`; when the block ends without an error, fsync what it holds and
    move it to `dst` in one rename. On an error nothing changes at `dst` and the temporary folder is removed.

    if_exists: "replace" (the old folder is moved aside only once the new one is complete, then deleted),
    "keep" (another process published first, e.g. a parallel rank converting the same model: keep theirs),
    "error" (FileExistsError).
    """
    if if_exists not in ("replace", "keep", "error"):
        raise ValueError(f"if_exists must be replace, keep or error, got {if_exists!r}")
    dst = Path(dst)
    if if_exists == "error" and dst.exists():
        raise FileExistsError(f"{dst} already exists")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        sync_tree(tmp)
        if dst.exists() and if_exists == "replace":
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / "x")
            replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                replace(tmp, dst)
            except OSError:
                # rename(2) fails on a non-empty destination: someone else published it meanwhile.
                if if_exists == "keep" and dst.is_dir() and any(dst.iterdir()):
                    return
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def is_temporary(name: str) -> bool:
    """Whether `name` is one of the temporary names this module writes beside a destination: publish_dir's
    `.<name>.tmp-*` and `.<name>.old-*` folders, atomic_write_bytes' `.<name>.*.tmp` files."""
    return name.startswith(".") and (".tmp-" in name or ".old-" in name or name.endswith(".tmp"))


def remove_stale_temps(root) -> list[Path]:
    """Delete the temporary files and folders a killed process left anywhere under `root`; returns what went.
    Only for a folder whose lock this process holds (lock_for_process): another live writer's temporaries would
    go too."""
    removed = []
    for folder, dirs, files in os.walk(root):
        for name in [d for d in dirs if is_temporary(d)]:
            dirs.remove(name)  # not walked into: it is going
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            removed.append(Path(folder) / name)
        for name in files:
            if is_temporary(name):
                Path(folder, name).unlink(missing_ok=True)
                removed.append(Path(folder) / name)
    return removed


def sha256_file(path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_failure(path, err: BaseException) -> OSError:
    """The error to raise when writing `path` failed: which file, why, and the room left on its filesystem (torch's
    writer reports a full disk as an 'iostream error', Python's names no file)."""
    folder = Path(path).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    return OSError(f"could not write {path}: {err} ({free / 2**30:.2f} GiB free on its filesystem; a full disk or a "
                   f"file-size limit stops writes). Nothing half-written was published: make room and rerun, the run "
                   f"resumes where it stopped")


CHECKSUMS_NAME = "checksums.json"


def write_checksums(folder) -> None:
    """sha256 of every file under `folder` into its checksums.json, so a reader can refuse a damaged file by name."""
    folder = Path(folder)
    sums = {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != CHECKSUMS_NAME}
    atomic_write_json(folder / CHECKSUMS_NAME, sums)


def verify_checksums(folder) -> None:
    """Raise ValueError naming the first file of `folder` that is missing or differs from its checksums.json (a
    folder without one, written before checksums existed, is not checked)."""
    folder = Path(folder)
    if not (folder / CHECKSUMS_NAME).is_file():
        return
    for name, digest in read_json(folder / CHECKSUMS_NAME).items():
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path} is missing (listed in {folder / CHECKSUMS_NAME})")
        if sha256_file(path) != digest:
            raise ValueError(f"{path} is damaged: its sha256 differs from the one in {folder / CHECKSUMS_NAME}")


class LockedError(RuntimeError):
    """Another live process holds the lock: two runs on one output folder would corrupt each other."""


_HELD: dict[str, int] = {}  # lock path -> open fd, kept for the life of the process


def lock_for_process(lock_path, what: str) -> None:
    """Take an advisory lock (flock on `lock_path`) until this process exits, or raise LockedError naming the pid
    and host that hold it. The kernel releases it when the holder dies, however it dies (kill -9 included), so a
    requeued job never finds a stale lock; a second live run on the same `what` is refused instead of interleaving
    writes with the first. Taking a lock this process already holds is a no-op."""
    lock_path = Path(lock_path)
    key = str(lock_path.resolve())
    if key in _HELD:
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown pid"
        os.close(fd)
        raise LockedError(f"{what} is in use by another run ({holder}, lock file {lock_path}): wait for it to "
                          f"finish or stop it, or use another output folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _HELD[key] = fd
