"""The `cache` stage: one target forward per regenerated conversation, stored in the hidden-state cache.

Every record keeps input ids, the assistant-only loss mask, the outputs of the recipe's target layers and the
final-norm state (target logits are recomputed later with the frozen lm_head; vocabulary-sized logits are never
stored). Shards are fixed up front (`cache.records_per_shard` conversations each), shard s is written by rank
s % world, and each shard is published atomically, so a killed run resumes with the missing shards only and the
finished cache is byte-identical to an uninterrupted one. See data/states/cache.py for the on-disk format.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from data.states.cache import CacheSpec, TargetCache, bytes_per_token, format_bytes
from data.states.cache_writer import CacheWriter
from data.chat import tokenize_conversation, tokenizer_fingerprint
from data.regen.regenerate import RECORDS_NAME, iter_records
from data.states.engine import EngineStates, EngineStatesError
from modeling.anatomy import final_norm
from modeling.target import (capture_hidden_states, check_layer_ids, decoder_layers, target_hidden_size,
                             weights_fingerprint)
from modeling.vocab import count_tokens
from core import stage
from core.dist import Dist, fault_point
from core.recipe import Recipe
from core.redact import redact_url
from core.io import require_free_space, sha256_file


TOKEN_COUNTS_KEY = "loss_token_counts"  # in the manifest's meta
TARGET_WEIGHTS_META = "target_weights"  # in the manifest's meta: the weights fingerprint of the target that ran


def cache_spec(recipe, hidden_size: int, tokenizer) -> CacheSpec:
    return CacheSpec(target=recipe.target.name_or_path, layer_ids=tuple(recipe.target.layer_ids),
                     hidden_size=hidden_size, dtype=recipe.cache.dtype,
                     tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), encoding=recipe.cache.encoding)


def most_cache_bytes(recipe, hidden_size: int) -> tuple[int, int]:
    """(bytes, bytes a token): the most the cache stage can write for `recipe`, every prompt's conversation cut at
    data.max_length tokens. Known before regeneration, when only this bound is (the stage checks the real count)."""
    per_token = bytes_per_token(CacheSpec(target=recipe.target.name_or_path, layer_ids=tuple(recipe.target.layer_ids),
                                          hidden_size=hidden_size, dtype=recipe.cache.dtype,
                                          encoding=recipe.cache.encoding))
    return recipe.data.num_prompts * recipe.data.max_length * per_token, per_token


ONLINE_ADVICE = "; or train with --set train.hidden_states=online (no cache: the train stage runs the target itself)"


def tokenize_record(record: dict, tokenizer, recipe) -> dict | None:
    """A conversation's {id, input_ids, loss_mask}; None when it has fewer than data.min_loss_tokens supervised tokens.
    A truncated record's last answer (cut at regen.max_new_tokens) is not supervised as ended."""
    input_ids, loss_mask = tokenize_conversation(
        tokenizer, record["conversations"], enable_thinking=recipe.regen.enable_thinking,
        thinking=recipe.data.thinking, max_length=recipe.data.max_length,
        last_answer_cut=record.get("truncated", False))
    if sum(loss_mask) < recipe.data.min_loss_tokens:
        return None
    return {"id": record["id"], "input_ids": input_ids, "loss_mask": loss_mask}


def tokenize_records(records, tokenizer, recipe) -> tuple[list[dict], int]:
    """(input_ids, loss_mask) lists per conversation, and how many tokenize_record dropped."""
    rows = [tokenize_record(record, tokenizer, recipe) for record in records]
    kept = [row for row in rows if row is not None]
    return kept, len(rows) - len(kept)


def regen_digest(regen_dir: Path) -> str:
    """sha256 of a finished regeneration's records: what the cache (or an online train stage) is made from. The
    records' digest, not their path, so a cache is byte-identical wherever the run folder lives."""
    if not stage.is_done(regen_dir):
        raise RuntimeError(f"{regen_dir} holds no finished regeneration: run the regenerate stage first "
                           f"(--stages regenerate,...)")
    verified = stage.verify_outputs(regen_dir)  # cut or edited after the stage finished: refused, naming the file
    return verified.get(RECORDS_NAME) or sha256_file(Path(regen_dir) / RECORDS_NAME)


def training_rows(recipe, regen_dir: Path, tokenizer) -> tuple[list[dict], int]:
    """The regenerated conversations as (input_ids, loss_mask) rows, in record order, and how many were dropped. The
    records are read one at a time and each row keeps numpy arrays (int32 ids, uint8 mask: 5 bytes a token, where
    Python lists took ~44): every rank holds all rows, so this is what grows with the prompt count."""
    rows, dropped = [], 0
    for record in iter_records(regen_dir):
        row = tokenize_record(record, tokenizer, recipe)
        if row is None:
            dropped += 1
        else:
            rows.append({"id": row["id"], "input_ids": np.asarray(row["input_ids"], dtype=np.int32),
                         "loss_mask": np.asarray(row["loss_mask"], dtype=np.uint8)})
    if not rows:
        raise RuntimeError(f"no conversation in {regen_dir} has {recipe.data.min_loss_tokens}+ supervised tokens "
                           f"(data.min_loss_tokens)")
    return rows, dropped


def loss_token_counts(rows: list[dict]) -> list[list[int]]:
    """[[token id, count], ...] (ascending ids) of the supervised tokens (loss_mask 1) of every conversation. Written
    into the manifest at cache time: Eagle3's pruned draft vocabulary is the most frequent of them, and reading
    them back costs nothing, where counting means reading (and CRC-checking) every record again."""
    counts = Counter()
    for row in rows:
        ids = np.asarray(row["input_ids"], dtype=np.int64)[np.asarray(row["loss_mask"], dtype=bool)]
        tokens, times = np.unique(ids, return_counts=True)
        counts.update(dict(zip(tokens.tolist(), times.tolist())))
    return [[int(t), int(c)] for t, c in sorted(counts.items())]


def read_loss_token_counts(cache: TargetCache, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64 counts of the cache's supervised tokens, from its manifest (a cache written before the
    counts were stored is counted record by record, as before)."""
    pairs = cache.manifest.get("meta", {}).get(TOKEN_COUNTS_KEY)
    if pairs is None:
        return count_tokens(((cache[i]["input_ids"], cache[i]["loss_mask"]) for i in range(len(cache))), vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    if pairs:
        ids, values = torch.tensor(pairs, dtype=torch.int64).T
        if int(ids.max()) >= vocab_size:
            raise ValueError(f"{cache.root}: the manifest counts token id {int(ids.max())}, outside the target "
                             f"vocabulary of {vocab_size}")
        counts[ids] = values
    return counts


def capture_rows(model, rows: list[dict], layer_ids: list[int], dtype,
                 to_host: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden_states [T, K*H], last_hidden_state [T, H]) of each row, in `dtype`, from one target forward over the
    rows (right-padded: the forward is causal, so real positions never see the padding). The cache stage stores these
    from the CPU (`to_host`); the train stage's online mode (data/states/online.py) computes them for each step's rows
    and keeps them on the target's device (`to_host=False`: a GPU's states never round-trip through the host)."""
    device = model.device
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r["input_ids"])] = torch.as_tensor(r["input_ids"])
        attention_mask[i, : len(r["input_ids"])] = 1
    hidden, last = capture_hidden_states(model, input_ids.to(device), attention_mask.to(device), layer_ids)
    out = "cpu" if to_host else hidden.device
    return [(hidden[i, :len(r["input_ids"])].to(out, dtype), last[i, :len(r["input_ids"])].to(out, dtype))
            for i, r in enumerate(rows)]


def _shard_records(capture, rows: list[dict], first_id: int, batch_size: int, dtype, bar):
    """Yield cache records for `rows` (record ids first_id, first_id+1, ...), `batch_size` conversations per
    `capture(rows, dtype)` (one target forward, or one round of engine requests)."""
    for start in range(0, len(rows), batch_size):
        batch = rows[start: start + batch_size]
        for i, (r, (hidden, last)) in enumerate(zip(batch, capture(batch, dtype))):
            yield {
                "record_id": first_id + start + i,
                "input_ids": torch.tensor(r["input_ids"], dtype=torch.int32),
                "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.uint8),
                "hidden_states": hidden,
                "last_hidden_state": last,
            }
            bar.update(len(r["input_ids"]))


ENCODING_NOTE = ("cache.encoding differs (None stands for raw, pinned as before the key existed). The default is fp8 "
                 "since the half-size cache matched raw's held-out tau; --set cache.encoding=raw reads or resumes a raw "
                 "cache as it is.")


@dataclass
class CacheJob:
    """What one cache stage runs: the recipe, the regenerate stage's folder it reads, the folder it writes, its
    ranks, the target (`get_target()` loads it when needed) and its tokenizer."""

    recipe: Recipe
    regen_dir: Path
    out_dir: Path
    dist: Dist
    get_target: Callable
    tokenizer: object


def run_cache(job: CacheJob) -> dict:
    """The `cache` stage; `job.get_target()` loads the target when needed (under cache.backend engine, the target
    without its decoder layers: modeling/target.load_target_parts). Returns the stats in DONE.json."""
    recipe, regen_dir, out_dir, dist = job.recipe, job.regen_dir, Path(job.out_dir), job.dist
    get_model, tokenizer = job.get_target, job.tokenizer
    records_sha256 = regen_digest(regen_dir)
    spec = cache_spec(recipe, target_hidden_size(recipe.target.name_or_path), tokenizer)
    settings = {"regen_records_sha256": records_sha256, "spec": asdict(spec), "cache": asdict(recipe.cache),
                "data": {k: getattr(recipe.data, k) for k in ("max_length", "thinking", "min_loss_tokens")}}
    if spec.encoding == "raw":  # pinned as before cache.encoding existed: older runs' finished caches still skip
        del settings["spec"]["encoding"], settings["cache"]["encoding"]
    # Where the servers are and their tuning flags may change between a run and its resume (as regen.server_args);
    # which backend computed the states may not (their numbers differ in the last bits). The default's settings stay
    # as before the key existed.
    for key in ("server_urls", "states_dir", "server_args", "max_concurrency",
                *(("backend",) if recipe.cache.backend == "hf" else ())):
        del settings["cache"][key]
    done = stage.start(out_dir, settings, "cache", dist.is_main, notes={"cache.encoding": ENCODING_NOTE})
    if done is not None:
        return done
    model = get_model()
    check_layer_ids(model, recipe.target.layer_ids)

    rows, dropped = training_rows(recipe, regen_dir, tokenizer)
    num_tokens = sum(len(r["input_ids"]) for r in rows)
    per_token = bytes_per_token(spec)
    dist.print(f"[cache] {len(rows)} conversations ({dropped} dropped under data.min_loss_tokens), {num_tokens} tokens; "
               f"{per_token} B/token ({len(spec.layer_ids)} layers + final norm, hidden {spec.hidden_size}, "
               f"{spec.dtype}, encoding {spec.encoding}) -> about {format_bytes(per_token * num_tokens)}")

    per_shard = recipe.cache.records_per_shard
    writer = CacheWriter(str(out_dir), spec, num_records=len(rows), records_per_shard=per_shard,
                         meta={"regen_records_sha256": records_sha256, "dropped": dropped,
                               TOKEN_COUNTS_KEY: loss_token_counts(rows),
                               # in the plan too: resuming with other weights at the same path is refused
                               TARGET_WEIGHTS_META: weights_fingerprint(model)})
    pending = writer.pending_shards()
    pending_tokens = sum(len(r["input_ids"]) for s in pending for r in rows[s * per_shard: (s + 1) * per_shard])
    require_free_space(out_dir, per_token * pending_tokens, f"the hidden-state cache ({pending_tokens:,} tokens x "
                       f"{per_token:,} B)", advice=ONLINE_ADVICE)
    todo = dist.mine(pending)
    todo_tokens = sum(len(r["input_ids"]) for s in todo for r in rows[s * per_shard: (s + 1) * per_shard])
    dtype = getattr(torch, recipe.cache.dtype)
    start = time.perf_counter()
    engine_info: dict = {}
    with _capturer(recipe, model, dist, out_dir, bool(todo), engine_info) as (capture, per_round):
        bar = tqdm(total=todo_tokens, desc=f"cache[rank {dist.rank}]", unit="tok", unit_scale=True,
                   position=dist.rank, disable=not todo)
        for s in todo:
            shard_rows = rows[s * per_shard: (s + 1) * per_shard]
            try:
                writer.write_shard(s, _with_fault(_shard_records(capture, shard_rows, s * per_shard, per_round,
                                                                 dtype, bar), s))
            except EngineStatesError as exc:  # which shard the engine's row was for: nothing of it published
                raise EngineStatesError(f"cache shard {s}: {exc}") from None
        bar.close()
    elapsed = time.perf_counter() - start
    dist.wait()  # ranks finish their shards at different times: the long timeout, then the per-step collectives
    elapsed = dist.max(elapsed)
    done_tokens, = dist.sum(todo_tokens)
    startup = dist.max(engine_info.get("server_startup_s", 0.0))
    dist.barrier()
    if dist.is_main:
        manifest = writer.finalize()
        stats = {"records": manifest["num_records"], "tokens": manifest["num_tokens"], "bytes_per_token": per_token,
                 "total_bytes": sum(s["num_bytes"] for s in manifest["shards"]), "dropped": dropped,
                 **stage.throughput(done_tokens, elapsed)}
        if recipe.cache.backend == "engine":  # the seconds above include it, as the in-process ones its forwards'
            stats["server_startup_s"] = startup
        stage.mark_done(out_dir, stats)
        print(f"[cache] {stats['records']} records, {stats['tokens']} tokens, {per_token} B/token, "
              f"{format_bytes(stats['total_bytes'])} on disk; {stage.throughput_line(stats)}", flush=True)
    dist.wait()  # rank 0 finalized the whole cache meanwhile
    return stage.read_done(out_dir)


@contextlib.contextmanager
def _capturer(recipe, model, dist: Dist, out_dir: Path, needed: bool, info: dict):
    """(capture(rows, dtype) -> [(hidden, last)], rows per call): the in-process target's forward (cache.batch_size
    rows, padded), or a vLLM engine's (cache.backend engine; a shard's rows streamed in order, as many in flight as
    cache.max_concurrency allows, the engine batching them itself; `info` gets its server's start-up seconds). The
    engine's server, when the stage starts one, is stopped whatever happens."""
    if recipe.cache.backend != "engine":
        yield (lambda rows, dtype: capture_rows(model, rows, recipe.target.layer_ids, dtype)), recipe.cache.batch_size
        return
    if not needed:  # this rank has no shard left: no server started
        yield None, 1
        return
    engine = EngineStates(recipe, dist, out_dir, final_norm(model), len(decoder_layers(model)))
    if engine.server is not None:
        info["server_startup_s"] = round(engine.server.startup_s, 2)
    try:
        dist.print(f"[cache] hidden states from the vLLM engine at {', '.join(map(redact_url, engine.urls))} "
                   f"(cache.backend engine; its layers {engine.aux_ids})")
        yield engine.capture, recipe.cache.records_per_shard  # a shard's rows streamed (EngineStates.capture)
    finally:
        engine.close()


def _with_fault(records, shard: int):
    """Pass records through; DRAFTSMITH_KILL_AT=cache:<shard> kills the process midway through that shard."""
    for i, record in enumerate(records):
        if i == 1:
            fault_point("cache", shard)
        yield record


def open_cache(recipe, cache_dir: Path, hidden_size: int, tokenizer, verify: bool = False) -> TargetCache:
    """The reader, refusing a cache whose target, layers, hidden size or tokenizer differ from the recipe."""
    return TargetCache(str(cache_dir), expect=cache_spec(recipe, hidden_size, tokenizer), verify=verify)
