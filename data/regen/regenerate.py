"""Regeneration: the target answers every training prompt itself, so the drafter learns the target's distribution.

Each user turn is replayed in order with the target's own earlier answers as context; the source's answers are never
used. The backends (in-process HF, servers already running, servers the stage starts itself, the source's own answers)
are in data/regen/backends.py; this module is the stage: chunks, resume, merge.

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
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from data.chat import build_messages, render_prompt_ids
from data.sources.prompts import (DEFAULT_HOLDOUT_FRACTION, eval_prompts, load_prompts, local_source, split_trained,
                                  trained_keys)
from data.sources.registry import resolve_source
from data.regen.backends import Answer, OpenAIBackend, SourceBackend, open_backend, too_long_by_characters
from data.sources.rows import Prompt
from core import stage
from core.io import DamagedFileError, atomic_open, atomic_write_json
from core.dist import Dist, fault_point
from core.recipe import Recipe
from modeling.target import chat_template_pin


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
            PROMPTS_KEY: prompts_sha256, **chat_template_pin(recipe.target.chat_template)}


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
    if too_long_by_characters(tokenizer, messages, recipe.data.max_length):
        return recipe.data.max_length  # last; the backend skips it, untokenized
    return len(render_prompt_ids(tokenizer, messages, enable_thinking=recipe.regen.enable_thinking))


def _system(prompt: Prompt, recipe) -> str | None:
    # A source's own system message belongs to the prompt; otherwise the recipe's (None = the template default).
    return prompt.system if prompt.system is not None else recipe.data.system_prompt


@dataclass
class RegenJob:
    """What one regenerate stage runs: the recipe, the folder it writes, its ranks, the target (`get_target()` loads
    it when the backend needs it in this process) and its tokenizer."""

    recipe: Recipe
    out_dir: Path
    dist: Dist
    get_target: Callable
    tokenizer: object


class SourcesError(ValueError):
    """data.sources cannot give the run its prompts: fewer than asked (data.allow_fewer false), none, or every one
    failed (each too long, say). The recipe's to mend, not a bug: an `error:` line, not a traceback."""


def _hub_prompts_against_eval_set(recipe, prompts: list[Prompt], dist: Dist) -> None:
    """The sources only this stage reads (the hub's) held against the recipe's eval set by what its prompts say, as
    check_inputs held the local ones: all of them training prompts is refused now, not after training; some are
    said, and the eval stage leaves them out."""
    d, e = recipe.data, recipe.eval
    if e.allow_training_prompts or all(local_source(resolve_source(s.name, s.path)) for s in d.sources):
        return
    try:
        held = eval_prompts(e.dataset, e.num_samples, recipe.seed,
                            holdout_fraction=d.holdout_fraction or DEFAULT_HOLDOUT_FRACTION)
    except (ValueError, OSError):
        return  # the eval stage names what is wrong with it
    _, trained = split_trained(held, trained_keys(prompts, d.max_turns))
    if trained and len(trained) == len(held):
        raise SourcesError(f"eval.dataset {e.dataset}: all {len(held)} eval prompts are among the prompts "
                           f"data.sources gave (by what they say); evaluate on other prompts, or set "
                           f"eval.allow_training_prompts=true to measure how the drafter fits them")
    if trained:
        dist.print(f"[regenerate] {len(trained)} of eval.dataset's {len(held)} prompts are training prompts (by what "
                   f"they say): the eval stage leaves them out")


def run_regenerate(job: RegenJob) -> dict:
    """The `regenerate` stage. Returns the stats in DONE.json."""
    recipe, out_dir, dist, get_model, tokenizer = job.recipe, Path(job.out_dir), job.dist, job.get_target, job.tokenizer
    if stage.is_done(out_dir):  # skipped without reading its prompts: the digest it pinned stands for them
        prompts, digest = None, stage.pinned(out_dir).get(PROMPTS_KEY)
    else:  # before the folder is pinned: a recipe its sources cannot fill is refused here
        try:
            prompts = load_prompts(recipe.data.sources, recipe.data.num_prompts, recipe.data.holdout_fraction,
                                   recipe.seed, allow_fewer=recipe.data.allow_fewer)
        except DamagedFileError:
            raise  # names its file: the pipeline's error line as it is
        except ValueError as exc:
            raise SourcesError(f"data.sources: {exc}") from None
        if not prompts:
            raise SourcesError(
                f"no prompt was loaded from data.sources {_source_names(recipe)}: they hold no row with a non-empty "
                f"user turn outside the held-out split (data.holdout_fraction={recipe.data.holdout_fraction}). Point "
                f"data.sources at files with prompts")
        _hub_prompts_against_eval_set(recipe, prompts, dist)
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
    with open_backend(recipe, out_dir, dist, get_model, tokenizer, needed=bool(todo)) as backend:
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
        raise SourcesError(
            f"no conversation was regenerated from data.sources {_source_names(recipe)}: all {len(prompts)} prompts "
            f"failed (the first, {first['id']}: {first['reason']}); every reason is in {out_dir / 'errors.jsonl'}. "
            f"Fix the sources or the recipe, and run into a new --out")
    return stage.read_done(out_dir)


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
    try:
        futures = {pool.submit(regenerate_chunk, backend, chunks[k], recipe, seed(k)): k for k in todo}
        pending = set(futures)
        while pending:
            # Waits of a second: a stop signal the kernel hands to another thread runs its handler (KeyboardInterrupt)
            # in this thread only once this thread wakes; one wait for the next chunk could be minutes.
            finished, pending = concurrent.futures.wait(pending, timeout=1.0,
                                                        return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
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
