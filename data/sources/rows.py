"""The prompt record and the one row normaliser every prompt source shares.

A training prompt is the user side of a conversation: the target model regenerates the answers, so a source row is
reduced to its user turns (and an optional leading system message) as a :class:`Prompt`. Rows come in the shapes of
:data:`ACCEPTED_SHAPES`, which may be mixed within one file; a row of no known shape is refused with its file, its row
number, the keys it has and the shapes accepted. The readers that turn files into rows are readers.py; which source reads
which file is registry.py (both in data/sources/).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.io import DamagedFileError

__all__ = ["ACCEPTED_SHAPES", "IdMaker", "Prompt", "ShapeError", "clean_answers", "clean_turns", "gsm8k_answer",
           "parse_row", "row_id", "rows_to_prompts", "shape_error"]

logger = logging.getLogger(__name__)

ACCEPTED_SHAPES = (
    '{"conversations": [{"role"|"from": ..., "content"|"value": ...}, ...]}  '
    "(ShareGPT / OpenAI style; \"messages\" is accepted too; roles user/human, "
    "assistant/gpt, system; assistant messages are dropped)",
    '{"turns": [str, ...]}',
    '{"question": str}',
    '{"prompt": str}',
)

_USER_ROLES = frozenset({"user", "human"})
_SYSTEM_ROLES = frozenset({"system"})
# Assistant messages become Prompt.answers (regen.backend: source); everything else (bing, bard, tool, ...) is
# discarded.
_ASSISTANT_ROLES = frozenset({"assistant", "gpt", "bot", "model", "chatgpt"})
_ID_KEYS = ("id", "prompt_id", "question_id", "task_id", "uuid")
_SHAPE_KEYS = ("conversations", "messages", "turns", "question", "prompt")  # the keys of ACCEPTED_SHAPES


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


class ShapeError(ValueError):
    """A row has no recognised shape (the caller adds file and row number)."""


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
    raise ShapeError(f"message content of type {type(value).__name__}")


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
            raise ShapeError(f"a message is {type(msg).__name__}, not an object")
        role = msg.get("role")
        if role is None:
            role = msg.get("from")
        if role is None:
            raise ShapeError(f"a message has no 'role'/'from' (keys {sorted(msg)})")
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


def parse_row(row: Mapping[str, Any]) -> tuple[str | None, list[str], list[str]]:
    """(system, user turns, the source's answers) of a row in one of ACCEPTED_SHAPES, else ShapeError.

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
            raise ShapeError("'turns' must be a list of strings")
        return system, list(row["turns"]), []
    if "question" in present and isinstance(row["question"], str):
        return system, [row["question"]], gsm8k_answer(row)
    if "prompt" in present and isinstance(row["prompt"], str):
        return system, [row["prompt"]], []
    nulls = [key for key in _SHAPE_KEYS if key in row and key not in present]
    if nulls and not present - {"system", *_ID_KEYS}:  # {"prompt": null}: say so, not "keys seen: []"
        raise ShapeError(f"{' / '.join(map(repr, nulls))} is null or missing: give the prompt's text")
    raise ShapeError(f"unrecognised row shape (keys seen: {sorted(present)})")


def shape_error(where: str, index: int, row: Any, detail: str) -> DamagedFileError:
    """The error for row ``index`` of ``where``: the problem, the keys the row has, and every accepted shape."""
    if isinstance(row, Mapping):
        keys = sorted(k for k, v in row.items() if v is not None)
        seen = f"keys seen: {keys}" if keys or not row else "no key has a value"
    else:
        seen = f"row is a {type(row).__name__}"
    shapes = "\n".join(f"  - {s}" for s in ACCEPTED_SHAPES)
    return DamagedFileError(f"{where}: row {index + 1}: {detail}; {seen}. Accepted row shapes:\n{shapes}")


def clean_turns(turns: Iterable[str]) -> tuple[str, ...]:
    """The turns stripped, empty ones dropped."""
    return tuple(t.strip() for t in turns if t and t.strip())


def clean_answers(answers: Sequence[str], turns: Sequence[str], cleaned_turns: Sequence[str]) -> tuple[str, ...]:
    """The answers, up to the first empty one; none when clean_turns dropped a turn (the pairs would shift)."""
    if len(cleaned_turns) != len(turns):
        return ()
    out = []
    for answer in answers:
        if not (answer and answer.strip()):
            break
        out.append(answer.strip())
    return tuple(out)


def gsm8k_answer(row: Mapping[str, Any]) -> list[str]:
    """GSM8K's worked answer without its calculator annotations (<<48/2=24>>), which no chat model writes."""
    answer = row.get("answer")
    return [re.sub(r"<<[^<>]*>>", "", answer)] if isinstance(answer, str) else []


def row_id(row: Mapping[str, Any], index: int) -> str:
    """The row's own id (the first of _ID_KEYS it has), else its index in the source."""
    for key in _ID_KEYS:
        value = row.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) != "":
            return str(value)
    return str(index)


class IdMaker:
    """Makes ``f"{source}:{raw}"`` unique within a source (later repeats get ``#2``, ``#3``...)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.seen: dict[str, int] = {}

    def __call__(self, raw: str) -> str:
        n = self.seen.get(raw, 0) + 1
        self.seen[raw] = n
        return f"{self.source}:{raw}" if n == 1 else f"{self.source}:{raw}#{n}"


def rows_to_prompts(rows: Iterable[Any], source: str, where: str, limit: int | None) -> list[Prompt]:
    """Generic rows (ACCEPTED_SHAPES) -> prompts; rows without a non-empty user turn are dropped.

    Stops pulling rows as soon as ``limit`` prompts are made, so a streamed file is read no further than needed.
    """
    make_id = IdMaker(source)
    out: list[Prompt] = []
    dropped = 0
    if limit is not None and limit <= 0:
        return out
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise shape_error(where, index, row, "row is not a JSON object")
        try:
            system, turns, answers = parse_row(row)
        except ShapeError as exc:
            raise shape_error(where, index, row, str(exc)) from None
        cleaned = clean_turns(turns)
        pid = make_id(row_id(row, index))
        if not cleaned:
            dropped += 1
            continue
        out.append(Prompt(id=pid, turns=cleaned, system=system.strip() if system else None, source=source,
                          answers=clean_answers(answers, turns, cleaned)))
        if limit is not None and len(out) >= limit:
            break
    if dropped:
        logger.debug("%s: dropped %d rows without a non-empty user turn", where, dropped)
    return out
