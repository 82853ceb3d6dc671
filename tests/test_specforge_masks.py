"""Our assistant-only loss masks against SpecForge's, two ways:

* the reference files SpecForge's own tests pin (`../shared/data/specforge-references/`, read by path, never
  copied into the project): token ids and masks its parser produced with the Qwen3 vocabulary;
* SpecForge 0.2.0's preprocessing itself (installed --no-deps by the test command) on conversations of our own, with the
  real SmolLM2 and Qwen3 tokenizers.

Where the two designs differ on purpose, the test says so and pins the difference (see the reasoning case).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from data.chat import build_messages, tokenize_conversation

REFERENCES = Path(__file__).resolve().parents[2] / "shared" / "data" / "specforge-references"
SYSTEM = "You are a helpful assistant."  # SpecForge's Qwen templates always inject it; we pass it explicitly

needs_references = pytest.mark.skipif(not REFERENCES.is_dir(), reason=f"{REFERENCES} not present on this checkout")


def reference(name: str) -> dict:
    return json.loads((REFERENCES / name).read_text())


def conversation(name: str) -> list[dict]:
    return json.loads((REFERENCES / "conversations.json").read_text())[name]


def with_inline_reasoning(messages: list[dict]) -> list[dict]:
    """SpecForge renders `reasoning_content` as `<think>\\n...\\n</think>\\n\\n` before the answer; our records carry
    reasoning inline in the answer text, which the Qwen3 template splits back out the same way."""
    return [{"role": m["role"], "content": f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}
            if "reasoning_content" in m else {"role": m["role"], "content": m["content"]} for m in messages]


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of 1s as (start, end) token positions."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


# ---------------------------------------------------------------- SpecForge's reference files


@needs_references
def test_qwen3_instruct_reference_ids_and_mask_equal(qwen3_tokenizer):
    ref = reference("qwen3-instruct_standard_ref.json")
    messages = [{"role": "system", "content": SYSTEM}] + conversation("standard")
    ids, mask = tokenize_conversation(qwen3_tokenizer, messages, enable_thinking=False)
    assert ids == ref["input_ids"]
    # Both leave the non-thinking answer's empty think block unsupervised: prompt text, not generated.
    assert mask == ref["loss_mask"]


@needs_references
def test_qwen3_thinking_reference_equal_except_the_rewritten_first_turn(qwen3_tokenizer):
    ref = reference("qwen3-thinking_reasoning-multi-turn_ref.json")
    messages = [{"role": "system", "content": SYSTEM}] + with_inline_reasoning(conversation("reasoning-multi-turn"))
    ids, mask = tokenize_conversation(qwen3_tokenizer, messages, enable_thinking=True, thinking="keep")
    assert ids == ref["input_ids"]

    ours, theirs = spans(mask), spans(ref["loss_mask"])
    assert len(theirs) == 2 and ours == theirs[1:]
    # Our choice: the Qwen3 template drops the first answer's reasoning once a later user turn exists, so the tokens
    # of that turn in this rendering are not what the model generated (it generated `<think>...` first). SpecForge
    # supervises them anyway; we leave the turn unsupervised rather than teach the drafter a continuation the target
    # never produces in that context. Everything else is identical.
    first = qwen3_tokenizer.decode(ids[theirs[0][0]:theirs[0][1]])
    assert first == "Sure! I think I can help with that.<|im_end|>\n"
    assert [i for i, (a, b) in enumerate(zip(mask, ref["loss_mask"])) if a != b] == list(range(*theirs[0]))


@needs_references
def test_chatml_reference_spans_on_smollm2(smollm2_tokenizer):
    # qwen_standard_ref.json is another vocabulary; with SmolLM2 (also ChatML) the supervised text must be the same.
    messages = [{"role": "system", "content": SYSTEM}] + conversation("standard")
    ids, mask = tokenize_conversation(smollm2_tokenizer, messages, enable_thinking=False)
    supervised = [smollm2_tokenizer.decode(ids[a:b]) for a, b in spans(mask)]
    assert supervised == ["My name is Qwen2.<|im_end|>\n", "11 years old.<|im_end|>\n"]


# ---------------------------------------------------------------- SpecForge's parser on conversations of our own

OWN_CONVERSATIONS = {
    "three turns": (["What is 2 + 2?", "And times 3?", "Say it in words."], ["4.", "12.", "Twelve."]),
    "answer repeats the question": (["Repeat: the cat sat on the mat."], ["the cat sat on the mat."]),
    "multibyte and newlines": (["Übersetze: 東京は大きい。"], ["Tokyo is big.\n\n- 東京 = Tokyo\n- 大きい = big 🙂"]),
    "code": (["Write a function that adds."], ["```python\ndef add(a, b):\n    return a + b\n```"]),
    "long answer": (["Count to forty."], [" ".join(str(i) for i in range(1, 41))]),
}


def specforge_mask(tokenizer, template: str, messages: list[dict], max_length: int = 4096):
    """SpecForge's own preprocessing (`preprocess_conversations`, as its data pipeline calls it) of one conversation."""
    preprocessing = pytest.importorskip("specforge.data.preprocessing",
                                        reason="the test command installs specforge==0.2.0")
    from specforge.data.template import TEMPLATE_REGISTRY

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that it uses our system message instead of its own
        out = preprocessing.preprocess_conversations(tokenizer, [messages], TEMPLATE_REGISTRY.get(template),
                                                     max_length=max_length, tools=[[]])
    return out["input_ids"][0][0].tolist(), out["loss_mask"][0][0].tolist()


@pytest.mark.parametrize("case", sorted(OWN_CONVERSATIONS))
@pytest.mark.parametrize("name,template,enable_thinking", [("smollm2", "qwen", False),
                                                          ("qwen3", "qwen3-instruct", False)])
def test_masks_equal_specforge_parser(request, case, name, template, enable_thinking):
    tokenizer = request.getfixturevalue(f"{name}_tokenizer")
    turns, answers = OWN_CONVERSATIONS[case]
    messages = build_messages(turns, answers, SYSTEM)
    ids, mask = tokenize_conversation(tokenizer, messages, enable_thinking=enable_thinking)
    sf_ids, sf_mask = specforge_mask(tokenizer, template, messages)
    assert ids == sf_ids
    assert mask == sf_mask, [tokenizer.decode(ids[a:b]) for a, b in spans(mask)]


def test_specforge_parser_differs_where_an_answer_contains_the_end_marker_text(smollm2_tokenizer):
    # Not a shared convention: SpecForge finds turns with a regex up to the first end-of-turn text, so an answer that
    # quotes `<|im_end|>\n` is cut there; we locate each turn's generated text from the template itself.
    messages = build_messages(["How does ChatML end a turn?"], ["With <|im_end|>\n then the next turn."], SYSTEM)
    ids, mask = tokenize_conversation(smollm2_tokenizer, messages, enable_thinking=False)
    _, sf_mask = specforge_mask(smollm2_tokenizer, "qwen", messages)
    ours = [smollm2_tokenizer.decode(ids[a:b]) for a, b in spans(mask)]
    assert ours == ["With <|im_end|>\n then the next turn.<|im_end|>\n"]
    assert sum(sf_mask) < sum(mask)


@pytest.mark.parametrize("case", ["one turn", "two turns"])
def test_thinking_masks_equal_specforge_on_the_last_turn(qwen3_tokenizer, case):
    # SpecForge reads reasoning from `reasoning_content`; our records carry it inline. The last turn (the only one a
    # thinking conversation keeps its reasoning in) is supervised identically, reasoning included.
    convo = [{"role": "user", "content": "Is 91 prime?"},
             {"role": "assistant", "content": "No: 91 = 7 x 13.", "reasoning_content": "Try 7: 7 x 13 = 91."}]
    if case == "two turns":
        convo += [{"role": "user", "content": "And 97?"},
                  {"role": "assistant", "content": "Yes.", "reasoning_content": "No factor up to 9 divides 97."}]
    system = [{"role": "system", "content": SYSTEM}]
    ids, mask = tokenize_conversation(qwen3_tokenizer, system + with_inline_reasoning(convo), enable_thinking=True,
                                      thinking="keep")
    sf_ids, sf_mask = specforge_mask(qwen3_tokenizer, "qwen3-thinking", system + convo)
    assert ids == sf_ids
    assert spans(mask)[-1] == spans(sf_mask)[-1]
    assert qwen3_tokenizer.decode(ids[slice(*spans(mask)[-1])]).startswith("<think>\n")
    # The earlier turn, whose reasoning the template dropped, is the one deliberate difference (see above).
    assert len(spans(mask)) == 1 and len(spans(sf_mask)) == (1 if case == "one turn" else 2)
