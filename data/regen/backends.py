"""The regenerate stage's backends (regenerate.py beside it is the stage): `generate(list of message lists, seed) ->
list of Answer`, one Answer per conversation, in order.
  * `HFBackend`: in-process batched `model.generate` (default; the embedded target on CPU, any HF model on GPU);
  * `OpenAIBackend`: any OpenAI-compatible server already running (SGLang `launch_server`, vLLM); several URLs = data
    parallel;
  * `VLLMBackend`, `SGLangBackend` (`OwnServerBackend`): a vLLM or SGLang server the stage starts itself, one per
    rank (on a GPU machine the rank's GPU), sent token ids and answering token ids;
  * `SourceBackend` (regen.backend: source) generates nothing: it keeps the source's own answers (EAGLE's fixed-data
    training), for `loss.ce_labels: target`, where the target's labels come from the cache stage's forward.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import torch
from transformers import DynamicCache

from data.chat import render_prompt_ids
from data.sources.rows import Prompt
from core.dist import Dist
from core.redact import redact_url, redact_urls
from core.server import (LiveServer, default_engine_python, engine_python_problem, free_port, sglang_server_command,
                         vllm_server_command)
from core.server_procs import visible_gpu
from modeling.target import full_attention_only, new_cache, resolve_target, target_dtype


@dataclass
class Answer:
    text: str = ""
    token_ids: list[int] | None = None
    error: str | None = None
    #: the prompt no longer fits data.max_length: a later turn ends the conversation there, a first turn fails it.
    too_long: bool = False
    #: the server failed, not the prompt (HTTP 429/5xx, no connection, a timeout): the next run asks again.
    retryable: bool = False
    #: the answer reached the token limit without ending its turn.
    truncated: bool = False


# --- backends -----------------------------------------------------------------------------------------------------


_LONGEST_TOKEN: dict[int, tuple[object, int | None]] = {}  # id -> (the tokenizer, kept alive so the id is its own)


def _longest_token_chars(tokenizer) -> int | None:
    """The most characters one token stands for (a byte-level token's string has one character a byte); None for a
    tokenizer with no vocabulary to read."""
    known = _LONGEST_TOKEN.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        vocab = getattr(tokenizer, "get_vocab", None)
        known = _LONGEST_TOKEN[id(tokenizer)] = (tokenizer, max(map(len, vocab()), default=1) if vocab else None)
    return known[1]


def too_long_by_characters(tokenizer, messages: list[dict], max_length: int) -> Answer | None:
    """The too-long refusal of a prompt whose characters alone fill data.max_length tokens of the tokenizer's longest:
    decided without tokenizing it (a 50 MB line took minutes and GBs to tokenize, to be refused)."""
    chars, longest = sum(len(m.get("content") or "") for m in messages), _longest_token_chars(tokenizer)
    if longest and chars >= max_length * longest:
        return Answer(error=f"prompt is {chars:,} characters, more than data.max_length={max_length} tokens hold",
                      too_long=True)
    return None


def fitting_prompt_ids(tokenizer, messages: list[dict], regen, max_length: int) -> list[int] | Answer:
    """The ids the target is prompted with, or the too-long refusal when they leave no room below data.max_length."""
    if (refused := too_long_by_characters(tokenizer, messages, max_length)) is not None:
        return refused
    ids = render_prompt_ids(tokenizer, messages, enable_thinking=regen.enable_thinking)
    if len(ids) >= max_length:
        return Answer(error=f"prompt is {len(ids)} tokens, not below data.max_length={max_length}", too_long=True)
    return ids


class HFBackend:
    """Batched sampling with a transformers model, left-padded."""

    def __init__(self, model, tokenizer, regen, max_length: int):
        self.model, self.tokenizer, self.regen, self.max_length = model, tokenizer, regen, max_length

    def generate(self, conversations: list[list[dict]], seed: int) -> list[Answer]:
        answers: list[Answer | None] = [None] * len(conversations)
        prompts, slots = [], []
        for i, messages in enumerate(conversations):
            ids = fitting_prompt_ids(self.tokenizer, messages, self.regen, self.max_length)
            if isinstance(ids, Answer):
                answers[i] = ids
            else:
                prompts.append(ids)
                slots.append(i)
        if prompts:
            for i, answer in zip(slots, self._sample(prompts, seed)):
                answers[i] = answer
        return answers

    @torch.inference_mode()
    def _sample(self, prompts: list[list[int]], seed: int) -> list[Answer]:
        pad = self.tokenizer.pad_token_id
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        device = self.model.device
        regen = self.regen
        sample = regen.temperature > 0
        limits = [min(regen.max_new_tokens, self.max_length - len(p)) for p in prompts]
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            past_key_values=self._prompt_cache(prompts, width),
            # each row's own limit is cut below: a short prompt is not cut short by the batch's longest one
            max_new_tokens=max(limits),
            do_sample=sample,
            temperature=regen.temperature if sample else None,
            top_p=regen.top_p if sample else None,
            top_k=regen.top_k if sample else None,
            pad_token_id=pad,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        answers = []
        eos = self.tokenizer.eos_token_id
        for row, limit in zip(out[:, width:].tolist(), limits):
            row = row[:limit]
            truncated = eos not in row  # generation stops at eos: a row without one ran into its token limit
            row = [t for t in row if t != pad] if truncated else row[: row.index(eos) + 1]
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            answers.append(Answer(text=text, token_ids=row, truncated=truncated))
        return answers

    def _prompt_cache(self, prompts: list[list[int]], width: int) -> DynamicCache | None:
        """On a CPU, the batch's KV cache for all but each prompt's last token, every prompt run alone and its cache
        left-padded (the padding masked, as generate's own prefill masks it). A CPU's prefill of a batch padded to its
        longest prompt costs batch x width tokens, and ShareGPT lengths differ 10x within a batch: this costs the
        prompts' own tokens (measured: the same greedy answers, 1.4x faster on a 16-prompt batch of 33-407 tokens).
        None (generate's own padded prefill) on a GPU, where the padded prefill runs in parallel, with
        regen.prefill: padded, and for a target whose cache is not keys and values over the whole sequence (sliding
        windows keep their last tokens only, linear attention a running state: neither pads nor merges)."""
        if self.regen.prefill == "padded" or self.model.device.type != "cpu" or min(map(len, prompts)) < 2 \
                or not full_attention_only(new_cache(self.model)):
            return None
        caches = []
        for ids in prompts:
            cache = new_cache(self.model)
            self.model(input_ids=torch.tensor([ids[:-1]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            caches.append(cache)
        batch = new_cache(self.model)
        pad = [(0, 0, width - len(ids), 0) for ids in prompts]  # on the left of the sequence axis
        for layer in range(len(caches[0].layers)):
            keys = [torch.nn.functional.pad(c.layers[layer].keys, p) for c, p in zip(caches, pad)]
            values = [torch.nn.functional.pad(c.layers[layer].values, p) for c, p in zip(caches, pad)]
            batch.update(torch.cat(keys), torch.cat(values), layer)
        return batch


#: the longest wait a server's Retry-After header gets.
MAX_RETRY_AFTER_S = 30.0
#: HTTP statuses that blame the request itself (an over-long prompt, a bad body): final, like data.max_length's refusal.
_REQUEST_ERRORS = frozenset({400, 413, 422})


class RegenStallError(RuntimeError):
    """The servers stopped answering: no request finished for regen.stall_timeout_s."""


class OpenAIBackend:
    """POST /v1/chat/completions to one or more servers; request i goes to server i % len(urls)."""

    def __init__(self, tokenizer, regen, model_name: str):
        self.tokenizer, self.regen, self.model_name = tokenizer, regen, model_name
        self.urls = [u.rstrip("/") for u in regen.server_urls]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=regen.max_concurrency)
        self.stalled = threading.Event()  # set once a stall stopped the stage: no request starts another attempt

    def generate(self, conversations: list[list[dict]], seed: int) -> list[Answer]:
        futures = [self.pool.submit(self._one, messages, seed + i, self.urls[i % len(self.urls)])
                   for i, messages in enumerate(conversations)]
        return self._gather(futures)

    def _gather(self, futures: list) -> list[Answer]:
        """The futures' answers; RegenStallError when none of them finishes for regen.stall_timeout_s (the chunk is
        then not written, so a rerun asks again)."""
        pending = {f for f in futures if isinstance(f, concurrent.futures.Future)}
        while pending:
            finished, pending = concurrent.futures.wait(pending, timeout=self.regen.stall_timeout_s,
                                                        return_when=concurrent.futures.FIRST_COMPLETED)
            if not finished:
                self.stalled.set()
                servers = ", ".join(redact_url(u) for u in self.urls)
                raise RegenStallError(
                    f"no answer from {servers} for {self.regen.stall_timeout_s:g} s (regen.stall_timeout_s) with "
                    f"{len(pending)} requests in flight: the server accepts connections but does not answer. The "
                    f"chunks in flight were not marked done; fix or restart the server and rerun to resume")
        return [f.result() if isinstance(f, concurrent.futures.Future) else f for f in futures]

    def _one(self, messages: list[dict], seed: int, url: str) -> Answer:
        payload = {"model": self.model_name, "messages": messages, "max_tokens": self.regen.max_new_tokens,
                   **self._sampling(seed), "chat_template_kwargs": {"enable_thinking": self.regen.enable_thinking}}
        return self._post(url, "/v1/chat/completions", payload, self._chat_answer)

    def _sampling(self, seed: int) -> dict:
        regen = self.regen
        # -1 for no top-k cut: SGLang refuses 0 (vLLM takes either)
        top_k = regen.top_k if regen.top_k > 0 else -1
        return {"temperature": regen.temperature, "top_p": regen.top_p, "top_k": top_k, "seed": seed}

    def _chat_answer(self, choice: dict) -> Answer:
        text = choice["message"]["content"] or ""
        return Answer(text=text, token_ids=self.tokenizer.encode(text, add_special_tokens=False),
                      truncated=choice.get("finish_reason") == "length")

    def _post(self, url: str, path: str, payload: dict, parse) -> Answer:
        """POST with retries; `parse(choices[0]) -> Answer` on a 200, or the reason it failed and whether the next run
        should ask again."""
        regen = self.regen
        error, wait = "no attempt made", 0.0
        for attempt in range(regen.request_attempts):
            if self.stalled.is_set():  # the stage is stopping: no attempt that would keep the process alive
                break
            if attempt:
                time.sleep(wait)
            wait = min(2**attempt, 10) * 0.5
            try:
                # a read that outlasts the stall deadline is a stall: the thread ends by then, not hours later
                response = requests.post(f"{url}{path}", json=payload,
                                         timeout=min(regen.request_timeout_s, regen.stall_timeout_s))
            except requests.RequestException as exc:  # refused, reset, timed out: the server's state, not the prompt's
                error = f"{type(exc).__name__} from {url}: {exc}"
                continue
            if response.status_code == 200:
                try:
                    return parse(response.json()["choices"][0])
                except (KeyError, IndexError, TypeError, ValueError) as exc:
                    error = f"malformed response from {url}: {type(exc).__name__}: {exc}"
                    continue
            error = f"HTTP {response.status_code} from {url}: {response.text[:300]}"
            if response.status_code != 429 and response.status_code < 500:
                # Asking again at once will not help; a 401/404 (the server's setup) may once the server is fixed.
                return Answer(error=redact_urls(error), retryable=response.status_code not in _REQUEST_ERRORS)
            wait = _retry_after_s(response, wait)
        return Answer(error=redact_urls(f"{error} ({regen.request_attempts} attempts)"), retryable=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class OwnServerBackend(OpenAIBackend):
    """A server for the target that the stage starts itself (regen.backend: vllm, sglang), one per rank, data parallel
    over the ranks: it sends every prompt as the token ids the HF backend would feed the model to /v1/completions and
    keeps the token ids the server returns (no text round trip: greedy answers equal the HF backend's, token for
    token; both engines take a prompt of ids and answer `choices[0].token_ids`, the stop token included, under
    `return_token_ids`), and stops the server when the stage ends, whatever happened. Its log is
    `<stage folder>/<engine>-rank<r>.log`. A subclass names the engine and how its server is started and placed."""

    ENGINE = ""

    def __init__(self, tokenizer, regen, max_length: int, target: str, dtype: str, dist: Dist, log_dir: Path):
        target_path = resolve_target(target)
        super().__init__(tokenizer, regen, model_name=target_path)
        self.max_length = max_length
        python = regen.engine_python or default_engine_python(self.ENGINE)
        dtype = str(target_dtype(dtype, dist.device)).removeprefix("torch.")  # the HF backend's
        port = free_port()
        argv = self.command(python, target_path, port, dtype, on_gpu=dist.device.type == "cuda")
        self.server = LiveServer(argv, port=port, log_path=Path(log_dir) / f"{self.ENGINE}-rank{dist.rank}.log",
                                 env=self.placement(dist), startup_timeout=regen.server_startup_s)
        self.server.__enter__()  # the last step: nothing after it can fail and leave the server running
        self.startup_s = self.server.startup_s
        self.urls = [self.server.url]

    def command(self, python: str, target_path: str, port: int, dtype: str, on_gpu: bool) -> list[str]:
        raise NotImplementedError

    @staticmethod
    def placement(dist: Dist) -> dict[str, str]:
        """The server's environment that puts it on rank `dist.rank`'s share of the machine."""
        raise NotImplementedError

    def generate(self, conversations: list[list[dict]], seed: int) -> list[Answer]:
        futures = []
        for i, messages in enumerate(conversations):
            ids = fitting_prompt_ids(self.tokenizer, messages, self.regen, self.max_length)
            if isinstance(ids, Answer):
                futures.append(ids)
                continue
            payload = {"model": self.model_name, "prompt": ids, "return_token_ids": True, "skip_special_tokens": True,
                       "max_tokens": min(self.regen.max_new_tokens, self.max_length - len(ids)),
                       **self._sampling(seed + i)}
            futures.append(self.pool.submit(self._post, self.urls[0], "/v1/completions", payload,
                                            self._ids_answer))
        return self._gather(futures)

    def _ids_answer(self, choice: dict) -> Answer:
        ids = list(choice["token_ids"])
        return Answer(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids,
                      truncated=choice.get("finish_reason") == "length")

    def close(self) -> None:
        super().close()
        self.server.stop()


class VLLMBackend(OwnServerBackend):
    """regen.backend: vllm. On a CPU machine each rank's server gets the rank's share of the cores, on a GPU machine
    the rank's GPU. vLLM batches the requests continuously (a finished answer's slot is refilled at once, prompts are
    not padded): on 2 CPU cores it regenerates ~3x faster than the HF backend (benchmarks/regenerate.py)."""

    ENGINE = "vllm"

    def command(self, python: str, target_path: str, port: int, dtype: str, on_gpu: bool) -> list[str]:
        eager = () if on_gpu else ("--enforce-eager",)  # torch.compile on CPU: minutes of startup, same numerics
        # The server's sampling defaults come from the request alone, not from the model's generation_config.json
        # (its extra stop tokens or default temperature would make answers differ from the HF backend's).
        return vllm_server_command(python, target_path, port, dtype=dtype, max_model_len=self.max_length,
                                   extra=("--generation-config", "vllm", *eager, *self.regen.server_args))

    @staticmethod
    def placement(dist: Dist) -> dict[str, str]:
        """The rank's GPU (`gpu_placement`), or its own share of the CPU cores (all of them for one rank: vLLM's
        default keeps one core back, a third of the speed on 2 cores)."""
        if dist.device.type == "cuda":
            return gpu_placement(dist)
        cores = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else list(range(os.cpu_count() or 1)))
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        share = max(len(cores) // ranks_here, 1)
        mine = cores[dist.local_rank * share: (dist.local_rank + 1) * share] or cores
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}


class SGLangBackend(OwnServerBackend):
    """regen.backend: sglang (the Qwen3 recipes'), SGLang 0.5.23's `launch_server`, each rank's on the rank's GPU.
    GPU only: SGLang's CPU engine needs a CPU build of sgl_kernel that no wheel ships (pipeline.py refuses the backend
    without CUDA). Unlike vLLM's it also stops at generation_config.json's extra eos ids (Qwen3's <|endoftext|>; no
    flag turns that off), where the HF backend goes on. Not yet run on a GPU: its command line is checked by SGLang's
    own parser, its requests and answers against a fake server in SGLang's response shape (test_regen_sglang.py).

    Sampled answers are not reproducible: each request carries its `seed`, which SGLang reads as `sampling_seed` but
    uses only under --enable-deterministic-inference (srt/sampling/sampling_batch_info.py), slower and not passed
    here. A chunk asked again after a crash gets other answers than the lost ones (the HF backend's are the same)."""

    ENGINE = "sglang"

    def command(self, python: str, target_path: str, port: int, dtype: str, on_gpu: bool) -> list[str]:
        # --sampling-defaults openai: the request alone sets the sampling (under `model`, SGLang's default, the
        # model's generation_config.json would fill what the request leaves out: its min_p, repetition_penalty).
        # --sampling-backend pytorch: SGLang's default, flashinfer, compiles its top-k/top-p sampling kernel with nvcc
        # on the first sampled batch (flashinfer ships no prebuilt one): without a CUDA toolkit every server would die
        # there, minutes into the stage. Its pytorch backend (sort, cumsum, multinomial) needs no build; its cost
        # beside flashinfer's kernel has not been measured here.
        return sglang_server_command(python, target_path, port, dtype=dtype, context_length=self.max_length,
                                     extra=("--sampling-defaults", "openai", "--sampling-backend", "pytorch",
                                            *self.regen.server_args))

    @staticmethod
    def placement(dist: Dist) -> dict[str, str]:
        return gpu_placement(dist) if dist.device.type == "cuda" else {}


def gpu_placement(dist: Dist) -> dict[str, str]:
    """The environment that puts rank `dist.rank`'s server on its own GPU: `visible_gpu`, among the GPUs this process
    was given."""
    return {"CUDA_VISIBLE_DEVICES": visible_gpu(dist.device.index or 0)}


def _retry_after_s(response, default: float) -> float:
    """The wait a 429/503's Retry-After header asks for in seconds, up to MAX_RETRY_AFTER_S; `default` without one
    (or with an HTTP date)."""
    try:
        seconds = float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return default
    return default if math.isnan(seconds) else min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


class SourceBackend:
    """The source's own answers as the conversation's answers: no generation at all. A prompt whose source has no
    answer for a turn ends there (a first turn without one fails the prompt, named in errors.jsonl)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def answer(self, prompt: Prompt, turn: int) -> Answer:
        if turn >= len(prompt.answers):
            return Answer(error="the source has no answer for this turn (regen.backend: source needs sources with "
                                "assistant answers: sharegpt, gsm8k, chat files with assistant messages)",
                          too_long=turn > 0)
        text = prompt.answers[turn]
        return Answer(text=text, token_ids=self.tokenizer.encode(text, add_special_tokens=False))


#: regen.backend -> the backend that starts its own server (core/recipe.py's names; pipeline.py checks its python).
OWN_SERVER_BACKENDS = {"vllm": VLLMBackend, "sglang": SGLangBackend}


def choose_backend(regen) -> tuple[str, str]:
    """regen.backend auto: (backend, why). vLLM's server where it can run (no CUDA device: the project's vLLM is the CPU
    build; a python with vLLM found), which regenerates ~3x faster than the in-process backend on 2 CPU cores; else
    hf, saying how to get the faster one."""
    if torch.cuda.is_available():
        return "hf", "hf (a CUDA device: in-process batches on the GPU; regen.backend=vllm needs a GPU build of vLLM)"
    problem = engine_python_problem("vllm", regen.engine_python, "regen.engine_python or $DRAFTSMITH_VLLM_PYTHON")
    if problem is None:
        return "vllm", f"vllm (a server started by the stage, {regen.engine_python or default_engine_python('vllm')})"
    return "hf", (f"hf, in-process ({problem}; vLLM's server regenerates ~3x faster on CPU cores: build it with `make "
                  f"venv-vllm`)")


@contextlib.contextmanager
def open_backend(recipe, out_dir: Path, dist: Dist, get_model, tokenizer, needed: bool):
    """The recipe's backend, closed (a started server stopped) when the stage ends; None when this rank has no chunk
    to do (no server started, no model loaded)."""
    regen = recipe.regen
    name = choose_backend(regen)[0] if needed and regen.backend == "auto" else regen.backend  # pipeline.py's choice
    if not needed:
        backend = None
    elif name == "openai":
        backend = OpenAIBackend(tokenizer, regen, regen.served_model or recipe.target.name_or_path)
    elif name in OWN_SERVER_BACKENDS:
        backend = OWN_SERVER_BACKENDS[name](tokenizer, regen, recipe.data.max_length,
                                            recipe.target.name_or_path, recipe.target.dtype, dist, out_dir)
    elif name == "source":
        backend = SourceBackend(tokenizer)
    else:
        backend = HFBackend(get_model(), tokenizer, regen, recipe.data.max_length)
    try:
        yield backend
    finally:
        if hasattr(backend, "close"):
            backend.close()
