"""Chat-template rendering and assistant-only loss masks.

A drafter is trained on the target model's own conversations, rendered with the
target tokenizer's chat template, and only the assistant responses are supervised.
This module is the single place where DraftSmith turns messages into token ids, so
training, regeneration and evaluation all see the same text:

* :func:`build_messages` turns user turns and answers into a message list and decides
  the system prompt the same way everywhere (``None`` keeps the template's default).
* :func:`render_prompt_ids` gives the prompt for the next assistant turn (regeneration,
  evaluation).
* :func:`tokenize_conversation` renders a whole conversation once and returns
  ``(input_ids, loss_mask)``.
* :func:`tokenizer_fingerprint` identifies a tokenizer + template for cache keys.

How the loss mask is found
--------------------------
Role markers are not parsed. For each assistant message ``j`` the tokenizer's own
template is asked for two renderings::

    P = render(messages[:j],   add_generation_prompt=True)   # prompt the model answers
    D = render(messages[:j+1], add_generation_prompt=False)  # the same, answered

``D`` must start with ``P``; what ``D`` adds, ``D[len(P):]``, is exactly what the model
generates for that turn, end-of-turn marker included (``"answer<|im_end|>\\n"`` for
ChatML). That text is then located, turn by turn, in the rendering of the whole
conversation, and the tokens whose character span starts inside it get ``loss_mask=1``.
Template details (the Qwen3 empty think block of a non-thinking prompt, a default
system prompt, extra headers) therefore stay unsupervised as prompt text, with no
per-template code.

A template may render an earlier turn differently once later turns exist (Qwen3 drops
the reasoning of assistant turns that precede the last user message). Such a turn's
text is not found verbatim in the full rendering, and the turn is left unsupervised
rather than raising: its tokens in the full rendering are not what the model would
have generated in that context. This happens with ``thinking="keep"`` for every turn
with reasoning except the last, and with ``enable_thinking=True`` on Qwen3-style
templates for every turn except the last (the prompt has no empty think block, so the
answered turn starts with ``<think>\\n\\n</think>\\n\\n``, which history rewriting removes).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal, Sequence

__all__ = [
    "build_messages",
    "render_prompt_ids",
    "tokenize_conversation",
    "tokenizer_fingerprint",
    "strip_think",
]

Message = dict[str, str]

_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_PROBE = "DRAFTSMITH-ANSWER-PROBE"  # a content no template rewrites, to see what follows an answer


def build_messages(turns: Sequence[str], answers: Sequence[str], system_prompt: str | None) -> list[Message]:
    """Interleave user ``turns`` with assistant ``answers`` into a message list.

    ``answers`` holds one answer per turn, or one fewer (the last turn awaits an answer).
    A system message comes first when ``system_prompt`` is a string (an empty string is
    an explicit empty system prompt). ``None`` adds no system message, so the template
    applies its own default: SmolLM2's injects its stock system prompt, Qwen3's none.
    Training and evaluation both build prompts here, so they agree on the system prompt.
    """
    if isinstance(turns, str) or isinstance(answers, str):
        raise TypeError("turns and answers must be sequences of strings, not a single string")
    if not turns:
        raise ValueError("a conversation needs at least one user turn")
    if len(answers) not in (len(turns), len(turns) - 1):
        raise ValueError(
            f"got {len(turns)} user turns and {len(answers)} answers; "
            f"expected {len(turns)} or {len(turns) - 1} answers"
        )
    for kind, items in (("turn", turns), ("answer", answers)):
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise TypeError(f"{kind} {i} is {type(item).__name__}, expected str")

    messages: list[Message] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def strip_think(text: str) -> str:
    """Remove ``<think>...</think>`` blocks and the whitespace after them.

    A ``</think>`` without an opening tag (models whose prompt already ends with
    ``<think>``) is treated as the end of a reasoning block that started at the beginning
    of the text: everything up to it is dropped as well.
    """
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1].lstrip()
    return text


def _tokenizer_name(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"{type(tokenizer).__name__}({name!r})" if name else type(tokenizer).__name__


def _require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {_tokenizer_name(tokenizer)} has no chat template; "
            "set tokenizer.chat_template or use the target model's instruct tokenizer"
        )


def _render(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool, enable_thinking: bool) -> str:
    text = tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
    if not isinstance(text, str):
        raise TypeError(
            f"apply_chat_template of {_tokenizer_name(tokenizer)} returned {type(text).__name__}, expected str"
        )
    return text


def render_prompt_ids(tokenizer: Any, messages: Sequence[Message], enable_thinking: bool) -> list[int]:
    """Token ids of the prompt for the next assistant turn after ``messages``.

    Rendered with ``add_generation_prompt=True`` and tokenized without extra special
    tokens (the template already contains them), exactly as :func:`tokenize_conversation`
    tokenizes, so a regenerated answer appended to these ids continues the same text.
    """
    _require_chat_template(tokenizer)
    text = _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=enable_thinking)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _end_of_turn(tokenizer: Any, messages: Sequence[Message], j: int, enable_thinking: bool) -> str:
    """What the template writes after the content of assistant message ``j`` (ChatML: ``"<|im_end|>\\n"``)."""
    probe = [*messages[:j], {**messages[j], "content": _PROBE}]
    text = _render(tokenizer, probe, add_generation_prompt=False, enable_thinking=enable_thinking)
    return text[text.rfind(_PROBE) + len(_PROBE):]


def _assistant_spans(
    tokenizer: Any, messages: Sequence[Message], full: str, enable_thinking: bool, last_answer_cut: bool
) -> list[tuple[int, int]]:
    """Character spans in ``full`` of the text generated for each assistant turn (``last_answer_cut``: the last one
    without the end-of-turn text the template adds after its content)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    last = max((j for j, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    for j, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = _render(tokenizer, messages[:j], add_generation_prompt=True, enable_thinking=enable_thinking)
        answered = _render(tokenizer, messages[: j + 1], add_generation_prompt=False, enable_thinking=enable_thinking)
        if not answered.startswith(prompt):
            around = answered[max(0, len(prompt) - 60) : len(prompt) + 40]
            raise ValueError(
                f"chat template of {_tokenizer_name(tokenizer)} does not render assistant message {j} as a "
                f"continuation of its generation prompt (enable_thinking={enable_thinking}): the prompt ends with "
                f"{prompt[-60:]!r} but the answered conversation continues {around!r}. "
                "A template that changes the prompt depending on the answer (e.g. an empty think block in a "
                "non-thinking prompt while the answer carries reasoning) cannot give a consistent loss mask"
            )
        generated = answered[len(prompt) :]
        if not generated:
            continue
        # Start the search after the messages preceding this turn whenever the full rendering
        # starts with them, so an answer that repeats the user's text is not matched inside
        # the user message.
        history = ""
        if j:
            history = _render(tokenizer, messages[:j], add_generation_prompt=False, enable_thinking=enable_thinking)
        start = max(cursor, len(history)) if full.startswith(history) else cursor
        pos = full.find(generated, start)
        if pos < 0:
            # The template rewrote this turn once later turns exist (see module docstring).
            continue
        end = pos + len(generated)
        if last_answer_cut and j == last:
            tail = _end_of_turn(tokenizer, messages, j, enable_thinking)
            # A template that wrote this turn some other way: none of it is supervised rather than its end.
            end -= len(tail) if generated.endswith(tail) else len(generated)
        spans.append((pos, end))
        cursor = pos + len(generated)
    return spans


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[Message],
    enable_thinking: bool,
    thinking: Literal["drop", "keep"] = "drop",
    max_length: int | None = None,
    last_answer_cut: bool = False,
) -> tuple[list[int], list[int]]:
    """Render ``messages`` once and return ``(input_ids, loss_mask)``.

    The conversation is rendered with ``add_generation_prompt=False`` and tokenized with
    ``add_special_tokens=False``. ``loss_mask[i]`` is 1 when token ``i`` belongs to the
    text an assistant turn generates (its answer and end-of-turn marker), found from the
    template itself as described in the module docstring.

    ``thinking="drop"`` removes ``<think>...</think>`` blocks from assistant messages
    before rendering; ``"keep"`` leaves them. Turns that the template renders differently
    in the full conversation than when they were generated (history rewriting, e.g. Qwen3
    dropping earlier reasoning) are left unsupervised instead of raising.

    Raises ``ValueError`` when the tokenizer has no chat template or when the template
    renders an answered turn as something other than its generation prompt followed by
    the answer. ``max_length`` truncates both lists.

    ``last_answer_cut``: the last answer stopped at the token limit, not where the model ended its turn, so the
    end-of-turn text the template puts after it gets ``loss_mask=0``: supervising it would teach the drafter to end
    answers there.
    """
    _require_chat_template(tokenizer)
    if thinking not in ("drop", "keep"):
        raise ValueError(f"thinking must be 'drop' or 'keep', got {thinking!r}")
    if max_length is not None and max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {_tokenizer_name(tokenizer)} is not a fast tokenizer; offsets are needed for the loss mask"
        )

    msgs = [dict(m) for m in messages]
    if thinking == "drop":
        for m in msgs:
            if m.get("role") == "assistant" and isinstance(m.get("content"), str):
                m["content"] = strip_think(m["content"])
                m.pop("reasoning_content", None)  # the templates that read it (Qwen3's) would render it back

    full = _render(tokenizer, msgs, add_generation_prompt=False, enable_thinking=enable_thinking)
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]

    spans = _assistant_spans(tokenizer, msgs, full, enable_thinking, last_answer_cut)
    loss_mask = [0] * len(input_ids)
    k = 0
    for i, (tok_start, _) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= tok_start:
            k += 1
        if k < len(spans) and spans[k][0] <= tok_start:
            loss_mask[i] = 1

    if max_length is not None:
        input_ids = input_ids[:max_length]
        loss_mask = loss_mask[:max_length]
    return input_ids, loss_mask


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Short sha256 hex digest of the vocabulary, special tokens and chat template.

    Two tokenizers with the same fingerprint map text to the same ids and render chats
    the same way, so caches of tokenized data can be keyed on it.
    """
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens_map": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "all_special_tokens": sorted(str(t) for t in tokenizer.all_special_tokens),
        "added_tokens": sorted((int(i), str(t), bool(getattr(t, "special", False))) for i, t in added.items()),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    blob = json.dumps(payload, ensure_ascii=False, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]
