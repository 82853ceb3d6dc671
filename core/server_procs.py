"""The live server's processes, found through /proc (Linux): by the tag in their environment, and by the sockets they
hold. Standard library only, because it also runs as a script: the watchdog LiveServer starts next to the server,

    python core/server_procs.py TAG

which blocks on its stdin (a pipe from the eval) and, once that closes, SIGKILLs every process carrying TAG. The pipe
closes however the eval ends, kill -9 included, so the server's whole tree goes with it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

TAG_VAR = "DRAFTSMITH_LIVE_SERVER"  # set in the server's environment; every process it starts inherits it
TCP_LISTEN = "0A"  # the `st` column of /proc/net/tcp for a listening socket


def tagged_processes(tag: str | None = None) -> list[int]:
    """Pids whose environment carries TAG_VAR (= `tag`, or any value): the server and everything it started, even
    processes that left its process group."""
    want = f"{TAG_VAR}={tag}".encode() if tag else f"{TAG_VAR}=".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if any(item == want if tag else item.startswith(want) for item in env):
            found.append(int(entry.name))
    return found


def kill_tagged(tag: str, timeout: float) -> list[int]:
    """SIGKILL every process carrying `tag` until none is left or `timeout` passed (a dying parent may still fork);
    returns those still listed."""
    deadline = time.monotonic() + timeout
    left = tagged_processes(tag)
    while left and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
        left = tagged_processes(tag)
    return left


def listening_sockets(port: int) -> set[int]:
    """Inodes of the TCP sockets, IPv4 and IPv6, listening on `port` (in this network namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:  # no IPv6
            continue
        for row in rows:
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
            fields = row.split()
            if fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def held_sockets(pids: list[int]) -> set[int]:
    """Inodes of the sockets the processes `pids` hold open (their fds linking to `socket:[INODE]`)."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:["):-1]))
    return inodes


def port_held_by(port: int, pids: list[int]) -> bool:
    """Whether something listens on `port` and every listening socket there is held by one of `pids` (SO_REUSEPORT
    lets another process share the port)."""
    listening = listening_sockets(port)
    return bool(listening) and listening <= held_sockets(pids)


def visible_gpu(index: int, environ: dict[str, str] | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES value that puts a server process on the GPU this process calls `cuda:{index}`: the
    index-th entry of the CUDA_VISIBLE_DEVICES it was given (a scheduler that restricted the node's GPUs to, say,
    `4,5,6,7` means cuda:1 is GPU 5, not GPU 1), or the index itself when the variable is unset."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return str(index)
    visible = [entry.strip() for entry in environ["CUDA_VISIBLE_DEVICES"].split(",") if entry.strip()]
    if not 0 <= index < len(visible):
        raise ValueError(f"cuda:{index} is not among the GPUs CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} "
                         f"makes visible ({len(visible)}): one rank per visible GPU")
    return visible[index]


def watch(tag: str) -> None:
    """Wait for stdin to close (the eval stopped the server, or died), then kill whatever still carries `tag`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the eval's to handle; its stop() closes our stdin
    sys.stdin.buffer.read()
    kill_tagged(tag, timeout=30.0)


if __name__ == "__main__":
    watch(sys.argv[1])
