"""Choosing prompts for training and evaluation: weighted mixing, a stable held-out split, deduplication.

Every prompt has a stable id ``f"{source}:{original id or row index}"``.  :func:`load_prompts`
puts a prompt in the held-out split iff ``sha256(seed, id)`` falls under ``holdout_fraction``:
a per-row decision, independent of how many rows were loaded, of their order and of the other
sources.  Each source contributes ``round(num_prompts * w / sum(w))`` prompts (largest
remainder, so the total is exact).  Within a source the quota is filled in a fixed per-source
order: a seeded hash order for sources that are read whole, file order for the streamed
ShareGPT file.  Asking for more prompts therefore only adds prompts, and the result never
depends on the internal read limit.  The mixed list is shuffled with ``random.Random(seed)``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import random
import warnings
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from data.sources.rows import Prompt
from data.sources.registry import SourceSpec, read_source, resolve_source, source_file

__all__ = ["DEFAULT_HOLDOUT_FRACTION", "eval_prompts", "is_holdout", "load_prompts", "local_source", "split_trained",
           "trained_keys", "training_overlap"]

DEFAULT_HOLDOUT_FRACTION = 0.05
_SPLITS = ("train", "holdout")


def _split_unit(prompt_id: str, seed: int) -> float:
    digest = hashlib.sha256(f"draftsmith-split\0{seed}\0{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _order_key(prompt_id: str, seed: int) -> bytes:
    return hashlib.sha256(f"draftsmith-order\0{seed}\0{prompt_id}".encode()).digest()


def is_holdout(prompt_id: str, holdout_fraction: float, seed: int) -> bool:
    """Whether a prompt id is in the held-out split (a per-id decision, stable across runs)."""
    return _split_unit(prompt_id, seed) < holdout_fraction


def _norm(text: str | None) -> str:
    return " ".join(text.split()) if text else ""


def _dedup_key(p: Prompt) -> tuple[str, tuple[str, ...]]:
    return _norm(p.system), tuple(_norm(t) for t in p.turns)


def _allocate(total: int, weights: Sequence[float]) -> list[int]:
    """round(total * w / sum(w)) per source, by largest remainder so the sum is exact."""
    wsum = float(sum(weights))
    exact = [total * (w / wsum) for w in weights]  # w / wsum first: total * w may overflow
    counts = [math.floor(x) for x in exact]
    rest = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


def _source_fields(src: Any) -> tuple[str, str | None, float, str]:
    if isinstance(src, str):
        return src, None, 1.0, "train"
    get = src.get if isinstance(src, Mapping) else functools.partial(getattr, src)
    name = get("name", None)
    if name is None:
        raise ValueError(f"prompt source {src!r} has no `name`")
    weight = get("weight", 1.0)
    weight = 1.0 if weight is None else float(weight)
    return str(name), get("path", None), weight, get("split", None) or "train"


def _select(
    spec: SourceSpec,
    dataset_split: str,
    quota: int | None,
    holdout_fraction: float,
    seed: int,
    want_holdout: bool,
    seen: set,
) -> list[Prompt]:
    """Up to ``quota`` (None: all) prompts of one source in the requested split.

    Deduplicates against ``seen`` (keys of earlier sources, updated here) and within the
    source (first occurrence in source order wins).  The result is a prefix of a fixed
    per-source order, so it never depends on how much of the source was read.
    """
    fraction = holdout_fraction if want_holdout else 1.0 - holdout_fraction
    if fraction <= 0.0 or quota == 0:
        return []
    limit: int | None = None
    if spec.streamed and quota is not None:
        limit = max(256, math.ceil(3 * quota / fraction) + 64)
    while True:
        pool = read_source(spec, dataset_split, limit)
        exhausted = limit is None or len(pool) < limit
        keys_here: set = set()
        candidates = []
        for p in pool:
            key = _dedup_key(p)
            if key in seen or key in keys_here:
                continue
            keys_here.add(key)
            if is_holdout(p.id, holdout_fraction, seed) == want_holdout:
                candidates.append(p)
        if exhausted or len(candidates) >= quota:
            break
        limit *= 4
    if not spec.streamed:
        candidates.sort(key=lambda p: _order_key(p.id, seed))
    seen |= keys_here
    return candidates if quota is None else candidates[:quota]


def load_prompts(
    sources: Sequence[Any],
    num_prompts: int,
    holdout_fraction: float,
    seed: int,
    split: str = "train",
    allow_fewer: bool = True,
    local_only: bool = False,
) -> list[Prompt]:
    """Mix prompts from several sources by weight; deterministic for the same inputs.

    ``sources``: objects (or mappings) with ``name``, ``path``, ``weight``, ``split``
    (a bare string is a source of weight 1).  Exact duplicates (same system + turns after
    whitespace normalisation) are dropped, keeping the first (earlier sources win).
    A prompt is held out iff ``is_holdout(id, holdout_fraction, seed)``; ``split`` selects
    ``"train"`` or ``"holdout"`` prompts.  Each source gives
    ``round(num_prompts * w / sum(w))`` prompts (total exactly ``num_prompts``); a source
    that runs short gives what it has, with a warning, or, with ``allow_fewer=False``, the
    call raises ValueError naming every short source (a recipe asking for more data than
    its sources hold is refused before anything is regenerated).  Shuffled with
    ``random.Random(seed)``.  ``local_only``: the sources read from the hub give nothing (their shares are not
    handed to the others): what can be read before the regenerate stage reaches the hub.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    if not 0.0 <= holdout_fraction <= 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1], got {holdout_fraction}")
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 0:
        raise ValueError(f"num_prompts must be an int >= 0, got {num_prompts!r}")
    if isinstance(sources, (str, Mapping)) or not isinstance(sources, Iterable):
        sources = [sources]
    fields = [_source_fields(s) for s in sources]
    if not fields:
        raise ValueError("no prompt sources given")
    for name, _, weight, _ in fields:
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"source {name!r}: weight must be finite and >= 0, got {weight}")
    weights = [w for _, _, w, _ in fields]
    if not 0 < sum(weights) < math.inf:
        raise ValueError(f"the source weights sum to {sum(weights)}: they are relative shares, give each a positive "
                         "number such as 1.0")
    specs = [resolve_source(name, path) for name, path, _, _ in fields]
    quotas = _allocate(num_prompts, weights)

    want_holdout = split == "holdout"
    seen: set = set()
    out: list[Prompt] = []
    short: list[str] = []
    for spec, (name, _, _, ds_split), quota in zip(specs, fields, quotas):
        if quota == 0 or (local_only and not local_source(spec)):
            continue
        got = _select(spec, ds_split, quota, holdout_fraction, seed, want_holdout, seen)
        if len(got) < quota and not allow_fewer:
            short.append(f"{name!r} holds {len(got)} {split} prompts for its share of {quota}")
        elif len(got) < quota:
            warnings.warn(
                f"prompt source {name!r} has only {len(got)} {split} prompts (after dedup, "
                f"holdout_fraction={holdout_fraction}) for its share of {quota}; using all of "
                "them, so fewer prompts than requested are returned",
                UserWarning,
                stacklevel=2,
            )
        out.extend(got)
    if short:
        raise ValueError(
            f"asked for {num_prompts} prompts, but " + "; ".join(short)
            + f" (after dedup, holdout_fraction={holdout_fraction}). Add or reweight sources, lower "
            "data.num_prompts, or set data.allow_fewer: true to train on what there is")
    random.Random(seed).shuffle(out)
    return out


_BENCHMARKS = ("humaneval", "mtbench")


def _read_whole(spec: SourceSpec) -> bool:
    """Whether eval_prompts reads every row of the source (a test set, or a file named for evaluation) rather than
    its held-out split."""
    return spec.kind in _BENCHMARKS or spec.kind in ("gsm8k", "file")


def local_source(spec: SourceSpec) -> bool:
    """Whether a source is read here, not from the hub (which only the regenerate stage reaches)."""
    return spec.kind != "hub" and not (spec.kind == "gsm8k" and not spec.path)


def _rows_read(spec: SourceSpec, split: str) -> tuple:
    """What a source reads: ("file", its real path) for a local file (a built-in's packaged one included), else its
    kind, hub id and split. Two sources read the same rows when these are equal or their files' bytes are."""
    file = source_file(spec)
    if file is not None and file.is_file():
        return "file", os.path.realpath(file)
    by_split = spec.kind == "hub" or (spec.kind == "gsm8k" and not spec.path)  # the others ignore the split
    return spec.kind, spec.path, split if by_split else None


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _same_rows(a: tuple, b: tuple) -> bool:
    """Whether two _rows_read values read the same rows: equal, or two files of equal size and sha256 (a copy under
    another name reads what the original does)."""
    if a == b:
        return True
    if a[0] != "file" or b[0] != "file":
        return False
    stats = [os.stat(a[1]), os.stat(b[1])]
    return stats[0].st_size == stats[1].st_size and len({_file_digest(p, st.st_size, st.st_mtime_ns)
                                                         for p, st in zip((a[1], b[1]), stats)}) == 1


def training_overlap(eval_name: str, sources: Sequence[Any], holdout_fraction: float) -> str | None:
    """Why ``eval_prompts(eval_name, ..., holdout_fraction=holdout_fraction)`` would hold prompts that
    ``load_prompts(sources, ..., holdout_fraction)`` trains on (with one seed), and what to do; None when none.

    Decided from what each source reads, whatever it is called: an eval set read whole shares every row of a training
    source that reads the same rows (the same file, or a byte-identical copy); a held-out split shares none unless
    nothing is held out. Which prompts are shared is :func:`split_trained`'s, by content.
    """
    spec = resolve_source(eval_name, None)
    whole = _read_whole(spec)
    read = _rows_read(spec, "test" if whole else "train")
    for i, src in enumerate(sources):
        name, path, _, split = _source_fields(src)
        if not _same_rows(_rows_read(resolve_source(name, path), split), read):
            continue
        if whole:
            return (f"the eval reads every row of it, and data.sources[{i}] trains on the same rows (all but the "
                    "data.holdout_fraction held out). Evaluate on prompts not in data.sources (mtbench, humaneval, "
                    "or a file of other prompts)")
        if holdout_fraction <= 0:
            return (f"it is data.sources[{i}], whose held-out split the eval draws, and data.holdout_fraction is 0 "
                    "(nothing is held out). Set data.holdout_fraction > 0 (e.g. 0.05), or evaluate on prompts not in "
                    "data.sources")
    return None


def _key(p: Prompt, turns: int) -> tuple[str, tuple[str, ...]]:
    # the system prompt aside: regeneration and the eval each set their own (data.system_prompt, the source's)
    return _dedup_key(dataclasses.replace(p, turns=p.turns[:turns], system=None))


def trained_keys(prompts: Iterable[Prompt], max_turns: int | None = None) -> frozenset:
    """The loader's dedup key of every conversation training answers: each prompt's first 1..max_turns user turns
    (an answer is regenerated after each)."""
    return frozenset(_key(p, n) for p in prompts for n in range(1, len(p.turns[:max_turns or None]) + 1))


def split_trained(prompts: Sequence[Prompt], keys: frozenset) -> tuple[list[Prompt], list[Prompt]]:
    """(the eval prompts training never answered, those it did), by what they say: an eval prompt's first turn, the
    one the eval decodes, under the loader's dedup key, whatever its source is called or wherever its file sits."""
    trained = [p for p in prompts if _key(p, 1) in keys]
    return [p for p in prompts if _key(p, 1) not in keys], trained


def eval_prompts(
    name_or_path: str,
    num_samples: int | None,
    seed: int,
    path: str | None = None,
    *,
    holdout_fraction: float = DEFAULT_HOLDOUT_FRACTION,
) -> list[Prompt]:
    """Prompts to evaluate a drafter on.

    * ``humaneval`` / ``mtbench``: the benchmark rows (they are test sets).
    * ``gsm8k``: the hub ``test`` split, or all rows of the file at ``path`` (point it at a
      test file).
    * a local JSON/JSONL file: its rows (a file named for evaluation is an eval set).
    * anything else (``sharegpt``, hub ids): the held-out rows of
      :func:`load_prompts` - pass the training recipe's ``seed`` and ``holdout_fraction`` so
      that they are disjoint from what the drafter was trained on.

    ``num_samples``: how many; ``None`` or <= 0 means all.  Benchmarks are subsampled with
    ``random.Random(seed)`` and returned in source order; held-out rows come as
    :func:`load_prompts` returns them.
    """
    spec = resolve_source(name_or_path, path)
    everything = num_samples is None or num_samples <= 0
    if _read_whole(spec):
        rows = read_source(spec, "test", None)
        if everything or num_samples >= len(rows):
            return rows
        picked = set(random.Random(seed).sample(range(len(rows)), num_samples))
        return [p for i, p in enumerate(rows) if i in picked]
    if everything:
        rows = _select(spec, "train", None, holdout_fraction, seed, True, set())
        random.Random(seed).shuffle(rows)
        return rows
    source = SimpleNamespace(name=name_or_path, path=path, weight=1.0, split="train")
    return load_prompts([source], num_samples, holdout_fraction, seed, split="holdout")
