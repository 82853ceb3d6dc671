"""Regeneration: the target answers every training prompt itself, so the drafter learns the target's distribution.

Each user turn is replayed in order with the target's own earlier answers as context; the source's answers are never
used. Two backends share one interface, `generate(list of message lists) -> list of Answer`:
  * `HFBackend`: in-process batched `model.generate` (default; the embedded target on CPU, any HF model on GPU);
  * `OpenAIBackend`: any OpenAI-compatible server (SGLang `launch_server`, vLLM); several URLs = data parallel.
A third, `SourceBackend` (regen.backend: source), generates nothing: it keeps the source's own answers (EAGLE's
fixed-data training), for `loss.ce_labels: target`, where the target's labels come from the cache stage's forward.

Resume: prompts are cut into fixed chunks of `regen.batch_size`; chunk k goes to rank k % world and is written to
`chunks/chunk-k.json` atomically once all its conversations are done, with a seed derived from (recipe seed, k).
A killed run therefore restarts with only the missing chunks and ends with exactly the records of an uninterrupted
run, none twice. The folder pins a digest of the chosen prompts, so a prompt file edited between two runs is refused
rather than mixed. Rank 0 then merges the chunks into `records.jsonl` (+ `errors.jsonl` with the reason of every
failed request) and writes `DONE.json`.

Nothing is lost silently. A request the server failed (HTTP 429 or 5xx after `regen.request_attempts` tries, no
connection, a timeout) is not the prompt's fault: its chunk goes to `chunks/failed-k.json` instead, is done again by
the next run, and the stage stops without DONE.json while any remain. Only the prompt's own failures (too long, no
source answer, HTTP 400) are final, in errors.jsonl; a stage that regenerated nothing at all is an error too.

Record: {"id", "source", "conversations": [{"role", "content"}...], "response_ids": [[token ids of answer 1], ...],
"truncated": the last answer was cut at regen.max_new_tokens (it ends the conversation, and its end-of-turn marker,
which the target never wrote there, is not supervised; a record without the key is not truncated)}.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from data.chat import build_messages, render_prompt_ids
from data.prompts import load_prompts
from data.rows import Prompt
from core import stage
from core.io import atomic_open, atomic_write_json
from core.dist import Dist, fault_point
from core.redact import redact_url, redact_urls
from core.server import LiveServer, default_engine_python, free_port, vllm_server_command
from core.server_procs import visible_gpu
from modeling.target import resolve_target, target_dtype


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


def fitting_prompt_ids(tokenizer, messages: list[dict], regen, max_length: int) -> list[int] | Answer:
    """The ids the target is prompted with, or the too-long refusal when they leave no room below data.max_length."""
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
        None (generate's own padded prefill) on a GPU, where the padded prefill runs in parallel, and with
        regen.prefill: padded."""
        if self.regen.prefill == "padded" or self.model.device.type != "cpu" or min(map(len, prompts)) < 2:
            return None
        caches = []
        for ids in prompts:
            cache = DynamicCache(config=self.model.config)
            self.model(input_ids=torch.tensor([ids[:-1]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            caches.append(cache)
        batch = DynamicCache(config=self.model.config)
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
        return {"temperature": regen.temperature, "top_p": regen.top_p, "top_k": regen.top_k, "seed": seed}

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


class VLLMBackend(OpenAIBackend):
    """regen.backend: vllm. Starts a vLLM server for the target itself (one per rank: on a CPU machine the rank's
    share of the cores, on a GPU machine the rank's GPU), sends every prompt as the token ids the HF backend would
    feed the model, keeps the token ids the server returns (no text round trip: greedy answers equal the HF
    backend's, token for token), and stops the server when the stage ends, whatever happened. vLLM batches the
    requests continuously (a finished answer's slot is refilled at once, prompts are not padded): on 2 CPU cores it
    regenerates ~3x faster than the HF backend (benchmarks/regenerate.py)."""

    def __init__(self, tokenizer, regen, max_length: int, target: str, dtype: str, dist: Dist, log_dir: Path):
        target_path = resolve_target(target)
        super().__init__(tokenizer, regen, model_name=target_path)
        self.max_length = max_length
        python = regen.engine_python or default_engine_python("vllm")
        on_gpu = dist.device.type == "cuda"
        dtype = str(target_dtype(dtype, dist.device)).removeprefix("torch.")  # the HF backend's
        port = free_port()
        eager = () if on_gpu else ("--enforce-eager",)  # torch.compile on CPU: minutes of startup, same numerics
        # The server's sampling defaults come from the request alone, not from the model's generation_config.json
        # (its extra stop tokens or default temperature would make answers differ from the HF backend's).
        argv = vllm_server_command(python, target_path, port, dtype=dtype, max_model_len=max_length,
                                   extra=("--generation-config", "vllm", *eager, *regen.server_args))
        self.server = LiveServer(argv, port=port, log_path=Path(log_dir) / f"vllm-rank{dist.rank}.log",
                                 env=_vllm_placement(dist), startup_timeout=regen.server_startup_s)
        self.server.__enter__()  # the last step: nothing after it can fail and leave the server running
        self.startup_s = self.server.startup_s
        self.urls = [self.server.url]

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


def _vllm_placement(dist: Dist) -> dict[str, str]:
    """The environment that puts rank `dist.rank`'s vLLM server on its own GPU (`visible_gpu`: among the GPUs this
    process was given), or on its own share of the CPU cores (all of them for one rank: vLLM's default keeps one
    core back, a third of the speed on 2 cores)."""
    if dist.device.type == "cuda":
        return {"CUDA_VISIBLE_DEVICES": visible_gpu(dist.device.index or 0)}
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = max(len(cores) // ranks_here, 1)
    mine = cores[dist.local_rank * share: (dist.local_rank + 1) * share] or cores
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}


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


# --- the stage ----------------------------------------------------------------------------------------------------


RECORDS_NAME = "records.jsonl"  # the regenerated conversations, one JSON object a line: what cache, train and opd read
PROMPTS_KEY = "prompts_sha256"
_PROMPTS_CHANGED = (
    f"The prompts changed: {PROMPTS_KEY} is a digest of the chosen prompts (ids, turns, system, source answers), and "
    "a prompt file of data.sources was edited since this folder was started (None: the folder predates the digest); "
    "resuming would mix answers to the old prompts with answers to the new ones. Restore the file to resume.")


def regen_settings(recipe, prompts_sha256: str | None) -> dict:
    """The recipe keys a regeneration folder depends on, and the digest of its prompts (`prompts_digest`)."""
    from dataclasses import asdict

    # allow_fewer only decides whether a short source is an error: the prompts (and runs made before it) are the same
    data = {k: v for k, v in asdict(recipe.data).items() if k != "allow_fewer"}
    # how requests reach the servers changes no answer (and the servers' URLs are fixed by rerunning)
    transport = ("server_urls", "max_concurrency", "request_timeout_s", "request_attempts", "stall_timeout_s",
                 "engine_python",
                 "server_args", "server_startup_s")
    return {"target": recipe.target.name_or_path, "seed": recipe.seed, "data": data,
            "regen": {k: v for k, v in asdict(recipe.regen).items() if k not in transport},
            PROMPTS_KEY: prompts_sha256}


def prompts_digest(prompts: list[Prompt]) -> str:
    """sha256 of the chosen prompts in order: what the chunks of a regeneration folder answer."""
    rows = [[p.id, p.turns, p.system, p.answers] for p in prompts]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()


def chunk_path(out_dir: Path, chunk: int) -> Path:
    return out_dir / "chunks" / f"chunk-{chunk:05d}.json"


def failed_chunk_path(out_dir: Path, chunk: int) -> Path:
    """Where a chunk whose server failed keeps its errors until a later run does it again."""
    return out_dir / "chunks" / f"failed-{chunk:05d}.json"


def regenerate_chunk(backend, prompts: list[Prompt], recipe, chunk_seed: int) -> tuple[list, list, int]:
    """Replay every user turn of `prompts` in order; returns (records, errors, generated tokens)."""
    answers: dict[str, list[Answer]] = {p.id: [] for p in prompts}
    failed: dict[str, Answer] = {}
    ended: set[str] = set()  # conversations cut short after at least one answer (data.max_length, a truncated answer)
    max_turns = recipe.data.max_turns
    num_tokens = 0
    for turn in range(max_turns):
        active = [p for p in prompts if turn < len(p.turns) and p.id not in failed and p.id not in ended]
        if not active:
            break
        if isinstance(backend, SourceBackend):
            replies = [backend.answer(p, turn) for p in active]
        else:
            batch = [build_messages(list(p.turns[: turn + 1]), [a.text for a in answers[p.id]], _system(p, recipe))
                     for p in active]
            replies = backend.generate(batch, seed=chunk_seed * 64 + turn)
        for prompt, answer in zip(active, replies):
            if answer.too_long and turn > 0:
                ended.add(prompt.id)
            elif answer.error is not None:
                failed[prompt.id] = Answer(error=f"turn {turn}: {answer.error}", retryable=answer.retryable,
                                           too_long=answer.too_long)
            else:
                answers[prompt.id].append(answer)
                num_tokens += len(answer.token_ids)
                if answer.truncated:  # the next user turn would follow an answer the target never finished
                    ended.add(prompt.id)
    records, errors = [], []
    for p in prompts:
        if p.id in failed:
            # a first turn longer than data.max_length was never meant to be used: skipped, not failed
            errors.append({"id": p.id, "source": p.source, "reason": failed[p.id].error}
                          | ({"retryable": True} if failed[p.id].retryable else {})
                          | ({"skipped": True} if failed[p.id].too_long else {}))
            continue
        turns = list(p.turns[: len(answers[p.id])])
        records.append({
            "id": p.id,
            "source": p.source,
            "conversations": build_messages(turns, [a.text for a in answers[p.id]], _system(p, recipe)),
            "response_ids": [a.token_ids for a in answers[p.id]],
            "truncated": answers[p.id][-1].truncated,
        })
    return records, errors, num_tokens


def _first_turn_length(prompt: Prompt, recipe, tokenizer) -> int:
    messages = build_messages([prompt.turns[0]], [], _system(prompt, recipe))
    return len(render_prompt_ids(tokenizer, messages, enable_thinking=recipe.regen.enable_thinking))


def _system(prompt: Prompt, recipe) -> str | None:
    # A source's own system message belongs to the prompt; otherwise the recipe's (None = the template default).
    return prompt.system if prompt.system is not None else recipe.data.system_prompt


def run_regenerate(recipe, out_dir: Path, dist: Dist, get_model, tokenizer) -> dict:
    """The `regenerate` stage; `get_model()` loads the target when needed. Returns the stats in DONE.json."""
    out_dir = Path(out_dir)
    if stage.is_done(out_dir):  # skipped without reading its prompts: the digest it pinned stands for them
        prompts, digest = None, stage.pinned(out_dir).get(PROMPTS_KEY)
    else:  # before the folder is pinned: a recipe its sources cannot fill is refused here
        prompts = load_prompts(recipe.data.sources, recipe.data.num_prompts, recipe.data.holdout_fraction,
                               recipe.seed, allow_fewer=recipe.data.allow_fewer)
        if not prompts:
            raise ValueError(f"no prompt was loaded from data.sources {_source_names(recipe)}: they hold no row with "
                             f"a non-empty user turn outside the held-out split (data.holdout_fraction="
                             f"{recipe.data.holdout_fraction}). Point data.sources at files with prompts")
        digest = prompts_digest(prompts)
    done = stage.start(out_dir, regen_settings(recipe, digest), "regenerate", dist.is_main,
                       notes={PROMPTS_KEY: _PROMPTS_CHANGED})
    if done is not None:
        return done

    # A batch is left-padded to its longest prompt, and on a CPU the prefill of the padded prompts costs more than the
    # answers: batch prompts of similar length (first turn, as rendered) so that little is spent on padding.
    prompts = sorted(prompts, key=lambda p: (_first_turn_length(p, recipe, tokenizer), p.id))
    size = recipe.regen.batch_size
    chunks = [prompts[i: i + size] for i in range(0, len(prompts), size)]
    todo = [k for k in dist.mine(range(len(chunks))) if not chunk_path(out_dir, k).is_file()]
    dist.print(f"[regenerate] {len(prompts)} prompts in {len(chunks)} chunks of {size}; "
               f"backend {recipe.regen.backend}; {len(chunks) - len(_done_chunks(out_dir))} chunks to do")

    start, num_tokens = time.perf_counter(), 0
    bar = tqdm(total=sum(len(chunks[k]) for k in todo), desc=f"regenerate[rank {dist.rank}]", unit="conv",
               position=dist.rank, disable=not todo)
    with _open_backend(recipe, out_dir, dist, get_model, tokenizer, needed=bool(todo)) as backend:
        for k, (records, errors, tokens) in _regenerate_chunks(backend, chunks, todo, recipe):
            if any(e.get("retryable") for e in errors):  # not done: the next run does the whole chunk again
                atomic_write_json(failed_chunk_path(out_dir, k), {"chunk": k, "errors": errors})
            else:
                atomic_write_json(chunk_path(out_dir, k), {"chunk": k, "records": records, "errors": errors,
                                                           "generated_tokens": tokens})
                failed_chunk_path(out_dir, k).unlink(missing_ok=True)
            num_tokens += tokens
            bar.update(len(chunks[k]))
            bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - start):.1f}")
            fault_point("regenerate", k)
        startup_s = getattr(backend, "startup_s", 0.0)
    bar.close()
    elapsed = time.perf_counter() - start
    dist.wait()  # ranks finish their chunks hours apart: the long timeout, then the per-step collectives
    total_tokens, = dist.sum(num_tokens)
    elapsed, startup_s = dist.max(elapsed), dist.max(startup_s)
    dist.barrier()
    _check_no_server_failures(out_dir, len(chunks))  # every rank reads the same files: all of them stop, or none
    if dist.is_main:
        stats = _merge(out_dir, len(chunks))
        if stats["records"]:  # nothing regenerated is not done: every rank raises below
            stats.update(stage.throughput(total_tokens, elapsed))
            if startup_s:  # in `seconds` too: the tok/s a user gets, server start included
                stats["server_startup_s"] = round(startup_s, 2)
            stage.mark_done(out_dir, stats, outputs=[RECORDS_NAME])  # cache, train and opd check it
            print(f"[regenerate] {stats['records']} conversations, {stats['skipped']} skipped (prompt longer than "
                  f"data.max_length), {stats['errors']} failed, "
                  f"{stats['generated_tokens']} answer tokens; {stage.throughput_line(stats)}", flush=True)
    dist.wait()  # rank 0 merged every chunk meanwhile
    if not stage.is_done(out_dir):
        first = json.loads((out_dir / "errors.jsonl").read_text().partition("\n")[0])
        raise ValueError(f"no conversation was regenerated from data.sources {_source_names(recipe)}: all "
                         f"{len(prompts)} prompts failed (the first, {first['id']}: {first['reason']}); every reason "
                         f"is in {out_dir / 'errors.jsonl'}. Fix the sources or the recipe, and run into a new --out")
    return stage.read_done(out_dir)


@contextlib.contextmanager
def _open_backend(recipe, out_dir: Path, dist: Dist, get_model, tokenizer, needed: bool):
    """The recipe's backend, closed (a started server stopped) when the stage ends; None when this rank has no chunk
    to do (no server started, no model loaded)."""
    regen = recipe.regen
    if not needed:
        backend = None
    elif regen.backend == "openai":
        backend = OpenAIBackend(tokenizer, regen, regen.served_model or recipe.target.name_or_path)
    elif regen.backend == "vllm":
        backend = VLLMBackend(tokenizer, regen, recipe.data.max_length, recipe.target.name_or_path,
                              recipe.target.dtype, dist, out_dir)
    elif regen.backend == "source":
        backend = SourceBackend(tokenizer)
    else:
        backend = HFBackend(get_model(), tokenizer, regen, recipe.data.max_length)
    try:
        yield backend
    finally:
        if hasattr(backend, "close"):
            backend.close()


def _regenerate_chunks(backend, chunks: list, todo: list[int], recipe):
    """(k, regenerate_chunk's result) for every chunk k in `todo`. A server backend works on several chunks at once:
    their requests queue for regen.max_concurrency connections, so that while one chunk waits for the last answer of
    a turn (the next turn needs it) the others keep the server's batch full (measured with 4x fewer chunks at once:
    the server mostly ran 1-20 requests of 64, and regenerated 3.5x the HF backend's tokens/s after its start instead
    of 4.0x). The in-process backends take the chunks in order."""
    regen = recipe.regen
    seed = lambda k: recipe.seed * 100_003 + k  # noqa: E731
    in_flight = max(4 * regen.max_concurrency // regen.batch_size, 1) if isinstance(backend, OpenAIBackend) else 1
    if in_flight == 1:
        for k in todo:
            yield k, regenerate_chunk(backend, chunks[k], recipe, chunk_seed=seed(k))
        return
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=in_flight)
    futures = {pool.submit(regenerate_chunk, backend, chunks[k], recipe, seed(k)): k for k in todo}
    try:
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()
    finally:
        # Stopped early (an error, Ctrl-C, SIGTERM, a fault point): the chunks not started yet are not started, and
        # the running ones are not waited for (several chunks of answers: minutes). Their results are never written;
        # closing the backend (the caller's next step) cancels their queued requests and stops a started server.
        pool.shutdown(wait=False, cancel_futures=True)


def _source_names(recipe) -> list[str]:
    return [s.name if s.path is None else f"{s.name} ({s.path})" for s in recipe.data.sources]


def _check_no_server_failures(out_dir: Path, num_chunks: int) -> None:
    """Raise while a chunk failed on the server: marking the stage done would drop those conversations for good."""
    failed = [failed_chunk_path(out_dir, k) for k in range(num_chunks)
              if not chunk_path(out_dir, k).is_file() and failed_chunk_path(out_dir, k).is_file()]
    errors = [e for path in failed for e in json.loads(path.read_text())["errors"] if e.get("retryable")]
    if errors:
        raise RuntimeError(
            f"regeneration is not complete: {len(errors)} conversations failed on the server, in {len(failed)} of "
            f"{num_chunks} chunks (the first: {errors[0]['id']}, {errors[0]['reason']}). Fix the server / "
            f"regen.server_urls and rerun: finished chunks are kept, the failed ones are done again")


def _done_chunks(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "chunks").glob("chunk-*.json"))


def _merge(out_dir: Path, num_chunks: int) -> dict:
    """The chunks, in order, into records.jsonl and errors.jsonl, one chunk in memory at a time: every line held at
    once, then joined, cost rank 0 twice the records file (benchmarks/README.md, "Scale rehearsal on CPU")."""
    missing = [k for k in range(num_chunks) if not chunk_path(out_dir, k).is_file()]
    if missing:
        raise RuntimeError(f"regeneration chunks {missing} are missing in {out_dir / 'chunks'}")
    records = errors = generated = skipped = 0
    with atomic_open(out_dir / RECORDS_NAME) as record_file, atomic_open(out_dir / "errors.jsonl") as error_file:
        for k in range(num_chunks):
            chunk = json.loads(chunk_path(out_dir, k).read_text())
            record_file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chunk["records"]).encode())
            error_file.write("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in chunk["errors"]).encode())
            records, errors = records + len(chunk["records"]), errors + len(chunk["errors"])
            skipped += sum(bool(e.get("skipped")) for e in chunk["errors"])
            generated += chunk["generated_tokens"]
    return {"records": records, "errors": errors - skipped, "skipped": skipped, "generated_tokens": generated}


def iter_records(out_dir: Path):
    """The regenerated records, one at a time, in file order."""
    with open(Path(out_dir) / RECORDS_NAME) as handle:
        for line in handle:
            yield json.loads(line)


def read_records(out_dir: Path) -> list[dict]:
    return list(iter_records(out_dir))
