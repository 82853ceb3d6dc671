"""Atomic, durable file and folder publishing: the one place DraftSmith writes anything a crash could leave half
done, or a planted link could send outside the run's folder.

A reader sees the old file (or folder) or the whole new one, never a part: everything is written under a temporary
name in the destination's own folder, fsynced, then moved into place with os.replace, and the folder entry is
fsynced too (a rename is only durable once the directory itself reaches the disk).

No write ever goes through a symbolic link: a link at the final path is replaced (rename(2) moves the new file over
the link itself, never into what it points to), a scratch file is created exclusively without following one
(O_EXCL | O_NOFOLLOW, after removing whatever stale entry had its name), and below a folder declared with `own_root`
(a run's --out) a folder that is a link is refused, naming it. tests/test_output_safety.py fails when project code
outside these writers opens a file for writing.

    own_root(out)                               # once, before the first write below `out`
    atomic_write_json(run / "DONE.json", stats)
    with publish_dir(out / "final") as tmp:     # tmp is a fresh folder beside out/final
        save_something(tmp)                     # on success it replaces out/final in one rename
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator

def umask() -> int:
    """The process's umask, read without setting it (os.umask would open a window in which another thread's files
    get mode 0666)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): the portable way
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode open() would give a new file: mkstemp makes 0600, which a serving engine running as another user
    cannot read; the user's umask still decides who else may."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


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
    """os.replace(src, dst), durable: the destination folder's entry is fsynced. A link at `dst` is replaced, not
    followed."""
    os.replace(src, dst)
    fsync_dir(Path(os.path.abspath(dst)).parent)  # not resolve(): that would follow a link that stood at dst


# --- never through a link ------------------------------------------------------------------------------------------


class LinkedPathError(OSError):
    """A path DraftSmith would write (or read back as its own) is a symbolic link it did not make."""


class DamagedFileError(ValueError):
    """A file a run reads is damaged or not in its format (cut, edited, missing, malformed); the message names the
    file and what to do. The pipeline prints it as one `error:` line with exit code 2: the user's to mend, not a bug."""


_ROOTS: set[str] = set()  # folders this process writes into (own_root): no folder below them may be a link


def own_root(root) -> Path:
    """Declare `root` (a run's --out, eval.py's, an export's) a folder this process writes into: from now on every
    writer here refuses a path below it whose folders pass through a symbolic link, so nothing lands outside it.
    `root` itself may be a link (runs -> /scratch/runs is the user's choice, made before the run); below it, every
    folder is the run's own."""
    root = Path(os.path.abspath(root))
    _ROOTS.add(str(root))
    return root


def link_problem(path, setting: str = "--out") -> str:
    """The refusal for a link found at `path`, naming where it points (never what it holds) and the `setting` whose
    folder it is in."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (f"{path} is a symbolic link (to {target}): DraftSmith never writes through, nor reads back as its own, a "
            f"link it did not make. Remove the link (the run makes its own file or folder there), or point {setting} "
            f"at another folder")


def _check_folders(folder: Path) -> None:
    """Raise LinkedPathError when `folder`, or a folder between it and the root it lies below (own_root), is a link;
    NotADirectoryError when one of them is a file. Outside every root nothing is checked (the user's own paths)."""
    folder = Path(os.path.abspath(folder))
    roots = [Path(r) for r in _ROOTS if folder == Path(r) or Path(r) in folder.parents]
    if not roots:
        return
    root = max(roots, key=lambda r: len(r.parts))
    current = root
    for part in folder.parts[len(root.parts):]:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return  # made from here down by make_dir
        if stat.S_ISLNK(mode):
            raise LinkedPathError(link_problem(current))
        if not stat.S_ISDIR(mode):
            raise NotADirectoryError(f"{current} is a file where DraftSmith keeps a folder: move it away, or point "
                                     f"--out at another folder")


def make_dir(folder) -> Path:
    """mkdir -p `folder`, refusing a link on the way below its root (own_root)."""
    folder = Path(folder)
    _check_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file, or a link to one, has its name
        raise NotADirectoryError(f"{folder} is {'a link to ' if folder.is_symlink() else ''}a file where DraftSmith "
                                 f"makes a folder: move it away, or point --out at another folder") from None
    return folder


def fresh_dir(folder) -> Path:
    """An empty folder at `folder`, made now: whatever had its name (a folder a killed write left half full, a planted
    link) is removed first (a link itself, never what it points to)."""
    folder = Path(folder)
    make_dir(folder.parent)
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    return folder


def open_new(path):
    """A new file open for writing bytes at `path` (a fixed scratch name, as the hidden-state cache's recovery expects;
    a server's log): a stale file or planted link of that name is removed first (the link, not its target), and the
    file is created exclusively, so no link can be followed (O_EXCL | O_NOFOLLOW)."""
    path = Path(path)
    make_dir(path.parent)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "wb")


def open_append(path):
    """`path` open for appending text (a log written line by line, metrics.jsonl), created when missing; a link at
    `path` is refused (O_NOFOLLOW), never appended through."""
    path = Path(path)
    make_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if path.is_symlink():
            raise LinkedPathError(link_problem(path)) from None
        raise write_failure(path, err) from err
    return os.fdopen(fd, "a")


def own_file(path) -> bool:
    """Whether `path` is a file this run may read back as its own (a stage's settings.json, DONE.json): True for a
    regular file, False when nothing is there, LinkedPathError for a link (never taken for ours)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISLNK(mode):
        raise LinkedPathError(link_problem(path))
    return stat.S_ISREG(mode)


def links_under(folder) -> list[Path]:
    """Every symbolic link inside `folder` (its files and folders, walked without following one), and `folder` itself
    when it is one: what a stage refuses to start on (its folder holds only what DraftSmith wrote)."""
    folder = Path(folder)
    if folder.is_symlink():
        return [folder]
    found = []
    for parent, dirs, files in os.walk(folder):
        found += [Path(parent, name) for name in dirs + files if os.path.islink(os.path.join(parent, name))]
    return sorted(found)


def atomic_write_bytes(path, data: bytes, *, tmp_path=None) -> None:
    """Write `data` to `path` atomically. `tmp_path` fixes the temporary name (a format whose recovery recognises
    its own scratch files, like the hidden-state cache); by default it is a unique name beside `path`."""
    with atomic_open(path, tmp_path=tmp_path) as handle:
        handle.write(data)


@contextlib.contextmanager
def atomic_open(path, *, tmp_path=None):
    """A file open for writing bytes that becomes `path` atomically when the block ends without an error: a file
    written piece by piece, never held whole in memory (the merged regeneration records). On an error the temporary
    is removed and `path` stays as it was. A link at `path` is replaced by the new file, never written through."""
    path = Path(path)
    make_dir(path.parent)
    if tmp_path is None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL: no link followed
        handle = os.fdopen(fd, "wb")
    else:
        tmp = str(tmp_path)
        handle = open_new(tmp)
    try:
        with handle:
            yield handle
            sync_file(handle)
        os.chmod(tmp, file_mode())
        replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):  # say which file
            raise write_failure(path, err) from err
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
            raise DamagedFileError(f"{path}: not valid JSON ({err})") from err
    if validate is None:
        return obj
    try:
        return validate(obj)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def share_as_umask_allows(root) -> None:
    """Give `root`, and every folder and file under it, the mode open() and mkdir would have given them: mkdtemp makes
    0700 and some writers (mkstemp, safetensors) 0600, which a server running as another user cannot read."""
    os.chmod(root, dir_mode())
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), dir_mode())
        for name in files:
            os.chmod(os.path.join(folder, name), file_mode())


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

    if_exists: "replace" (the old folder, or a link standing at `dst`, is moved aside only once the new one is
    complete, then deleted: a link itself, never what it points to), "keep" (another process published first, e.g. a
    parallel rank converting the same model: keep theirs), "error" (FileExistsError). With "keep" or "error" a link
    at `dst` is refused.
    """
    if if_exists not in ("replace", "keep", "error"):
        raise ValueError(f"if_exists must be replace, keep or error, got {if_exists!r}")
    dst = Path(dst)
    if dst.is_symlink() and if_exists != "replace":
        raise LinkedPathError(link_problem(dst))
    if if_exists == "error" and dst.exists():
        raise FileExistsError(f"{dst} already exists")
    make_dir(dst.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield tmp
        share_as_umask_allows(tmp)
        sync_tree(tmp)
        if os.path.lexists(dst) and if_exists == "replace":
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / "x")  # renames the entry at dst: a link moves, its target stays where it is
            replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)  # unlinks a link inside, never follows it
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


# The temporary names this module's writers make, and nothing else: mkstemp and mkdtemp append 8 characters from
# [a-z0-9_]. A user's `.bashrc.old-2023` or `.latex.old-backup/` does not match and is never removed.
_TEMP_FILE = re.compile(r"^\.(?P<dst>.+)\.[a-z0-9_]{8}\.tmp$")          # atomic_write_bytes
_TEMP_DIR = re.compile(r"^\.(?P<dst>.+)\.(?:tmp|old)-[a-z0-9_]{8}$")   # publish_dir


def temporary_destination(name: str) -> str | None:
    """The destination whose temporary `name` is, when it is one of the names this module's writers make
    (publish_dir's `.<dst>.tmp-XXXXXXXX` and `.<dst>.old-XXXXXXXX`, atomic_write_bytes' `.<dst>.XXXXXXXX.tmp`);
    None for any other name."""
    match = _TEMP_FILE.match(name) or _TEMP_DIR.match(name)
    return match.group("dst") if match else None


def is_temporary(name: str) -> bool:
    return temporary_destination(name) is not None


def remove_own_temps(root, stage_dirs, root_names=()) -> list[Path]:
    """Delete the temporaries a killed run left, and only those: names this module's writers make, anywhere inside
    `stage_dirs` (folders the project made itself) and, directly in `root`, only those whose destination is one of
    `root_names`. Whatever else `root` holds is the user's and is never touched, however its name looks. Returns
    what went. Only for a folder whose lock this process holds (lock_for_process): another live writer's
    temporaries would go too."""
    root, removed = Path(root), []

    def remove(path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)

    if root.is_dir():
        for path in root.iterdir():
            if temporary_destination(path.name) in root_names:
                remove(path)
    for stage_dir in stage_dirs:
        if Path(stage_dir).is_symlink():
            continue  # not a folder this run made: another run's, or a planted link
        for folder, dirs, files in os.walk(stage_dir):
            for name in [d for d in dirs if is_temporary(d)]:
                dirs.remove(name)  # not walked into: it is going
                remove(Path(folder, name))
            for name in files:
                if is_temporary(name):
                    remove(Path(folder, name))
    return removed


def sha256_file(path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class WriteFailure(OSError):
    """A write that failed, naming its file and the room left (write_failure)."""


def write_failure(path, err: BaseException) -> OSError:
    """The error to raise when writing `path` failed: which file, why, and the room left on its filesystem (torch's
    writer reports a full disk as an 'iostream error', Python's names no file). A failure that already names its file
    (a file of the folder `path`) keeps its own message."""
    if isinstance(err, WriteFailure):
        return WriteFailure(str(err))
    free = shutil.disk_usage(_existing(Path(path).parent)).free
    return WriteFailure(f"could not write {path}: {err} ({free / 2**30:.2f} GiB free on its filesystem; a full disk or a "
                   f"file-size limit stops writes). Nothing half-written was published: make room and rerun, the run "
                   f"resumes where it stopped")


def _existing(folder: Path) -> Path:
    """`folder` or its nearest existing parent (the filesystem it will be on)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def require_free_space(folder, need: int, what: str, advice: str = "") -> None:
    """Refuse to start writing `need` bytes of `what` into `folder` when its filesystem has less free: an OSError
    with both numbers, before hours of work fill the disk halfway."""
    free = shutil.disk_usage(_existing(folder)).free
    if need > free:
        raise OSError(f"not enough free space for {what} in {folder}: it needs about {need / 2**30:,.2f} GiB "
                      f"({need:,} bytes) and its filesystem has {free / 2**30:,.2f} GiB ({free:,} bytes) free. "
                      f"Make room or point --out at a larger disk{advice}")


CHECKSUMS_NAME = "checksums.json"


def write_checksums(folder) -> None:
    """sha256 of every file under `folder` into its checksums.json, so a reader can refuse a damaged file by name."""
    folder = Path(folder)
    sums = {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != CHECKSUMS_NAME}
    atomic_write_json(folder / CHECKSUMS_NAME, sums)


def verify_checksums(folder, required: bool = False) -> None:
    """Raise DamagedFileError naming the first file of `folder` that is missing or differs from its checksums.json. A
    folder without one (written before checksums existed, or by hand) is not checked, unless `required`: a folder its
    writer always checksums (a checkpoint, a stage's published draft), whose checksums.json was deleted, is refused."""
    folder = Path(folder)
    if not (folder / CHECKSUMS_NAME).is_file():
        if required:
            raise DamagedFileError(f"{folder / CHECKSUMS_NAME} is missing: the folder's files cannot be checked "
                                   f"against what was written, so none is trusted. Restore it, or make the folder "
                                   f"again")
        return
    for name, digest in read_json(folder / CHECKSUMS_NAME).items():
        path = folder / name
        if not path.is_file():
            raise DamagedFileError(f"{path} is missing (listed in {folder / CHECKSUMS_NAME})")
        if sha256_file(path) != digest:
            raise DamagedFileError(f"{path} is damaged: its sha256 differs from the one in {folder / CHECKSUMS_NAME}")


class LockedError(RuntimeError):
    """Another live process holds the lock: two runs on one output folder would corrupt each other."""


_HELD: dict[str, int] = {}  # lock path -> open fd, kept for the life of the process (-1: a pid file holds it)
_HOLDER_BYTES = 200  # what a lock file says of its holder is read back up to this many bytes: `pid N on HOST`


def _open_lock_file(path: Path, flags: int) -> int:
    """os.open of a lock or pid file that never follows a link (a planted one would have us truncate, or print, the
    file it points to) and is a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)  # open() applies the umask itself
    except OSError:
        if path.is_symlink():
            raise LinkedPathError(link_problem(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LockedError(f"{path} is not a regular file: DraftSmith's lock file is; move it away")
    return fd


def lock_for_process(lock_path, what: str) -> None:
    """Take an advisory lock (flock on `lock_path`) until this process exits, or raise LockedError naming the pid
    and host that hold it. The kernel releases it when the holder dies, however it dies (kill -9 included), so a
    requeued job never finds a stale lock; a second live run on the same `what` is refused instead of interleaving
    writes with the first. Taking a lock this process already holds is a no-op. A link at `lock_path` is refused
    (LinkedPathError), never opened."""
    lock_path = Path(lock_path)
    key = os.path.abspath(lock_path)
    if key in _HELD:
        return
    make_dir(lock_path.parent)
    fd = _open_lock_file(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, _HOLDER_BYTES, 0).decode(errors="replace").strip() or "unknown pid"
        os.close(fd)
        raise LockedError(f"{what} is in use by another run ({holder}, lock file {lock_path}): wait for it to "
                          f"finish or stop it, or use another output folder") from None
    except OSError as err:  # no flock on this file system (some Lustre and NFS mounts): ENOLCK, EOPNOTSUPP
        os.close(fd)
        _lock_by_pid_file(lock_path, what, err)
        _HELD[key] = -1
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _HELD[key] = fd


@contextlib.contextmanager
def exclusive(lock_path) -> Iterator[None]:
    """Hold a blocking flock on `lock_path` for the block (ranks of one job, or parallel test workers, converting
    one shared asset: one works, the others wait); a link at `lock_path` is refused, never opened."""
    lock_path = Path(lock_path)
    make_dir(lock_path.parent)
    fd = _open_lock_file(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock_by_pid_file(lock_path: Path, what: str, why: OSError) -> None:
    """The lock where flock is missing: `<lock>.pid`, created exclusively, holding `pid N on HOST`, removed at exit.
    A holder on this host that is no longer alive is stale and replaced; one on another host cannot be checked from
    here, so it is refused until someone deletes the file (the message says so)."""
    pid_file = lock_path.with_name(lock_path.name + ".pid")
    me = f"pid {os.getpid()} on {socket.gethostname()}"
    for _ in range(2):
        try:
            fd = os.open(pid_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            reader = _open_lock_file(pid_file, os.O_RDONLY)  # a link there: refused, its target never printed
            try:
                holder = os.read(reader, _HOLDER_BYTES).decode(errors="replace").strip()
            finally:
                os.close(reader)
            pid, _, host = holder.removeprefix("pid ").partition(" on ")
            if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                pid_file.unlink(missing_ok=True)  # its run died without removing it
                continue
            raise LockedError(f"{what} is in use by another run ({holder}, lock file {pid_file}; this file system "
                              f"has no flock, so a run on another host cannot be checked from here): wait for it "
                              f"to finish, or delete {pid_file} if that run is gone") from None
        with os.fdopen(fd, "w") as handle:
            handle.write(me + "\n")
        atexit.register(lambda: pid_file.unlink(missing_ok=True))
        print(f"[draftsmith] {lock_path.parent} has no flock ({why.strerror or why}): locked with {pid_file} "
              f"instead; two runs on one host are still refused, runs on two hosts only while the file exists",
              flush=True)
        return
    raise LockedError(f"could not take {pid_file}: it reappeared while a stale one was removed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True

