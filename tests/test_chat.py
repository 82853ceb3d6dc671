"""Tests for data/chat.py (templates, loss masks) and the offline Qwen3 tokenizer of data/assets.py.

The golden ids below were computed once with the real SmolLM2 and Qwen3 tokenizers and checked
token by token (decoded and compared with the rendered ChatML); they pin the exact rendering,
tokenization and loss mask so any drift in templates or tokenizers shows up here.
"""

from __future__ import annotations

import copy

import pytest

from data.chat import (
    build_messages,
    render_prompt_ids,
    strip_think,
    tokenize_conversation,
    tokenizer_fingerprint,
)

TURNS = ["What is 2+2?", "And 3+3?"]
ANSWERS = ["2+2 is 4.", "3+3 is 6."]
# Both templates end an assistant turn with "<|im_end|>\n", and that is supervised.
EXPECTED_SPANS = ["2+2 is 4.<|im_end|>\n", "3+3 is 6.<|im_end|>\n"]
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# (input_ids, indices where loss_mask == 1), enable_thinking=False, thinking="drop".
GOLDEN = {
    ("smollm2", None): (
        [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
         8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198, 34, 27, 34,
         314, 216, 36, 30, 2, 198, 1, 4093, 198, 3528, 216, 35, 27, 35, 47, 2, 198, 1, 520, 9531, 198, 35,
         27, 35, 314, 216, 38, 30, 2, 198],
        list(range(37, 46)) + list(range(61, 70)),
    ),
    ("smollm2", "You are terse."): (
        [1, 9690, 198, 2683, 359, 1733, 313, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198,
         1, 520, 9531, 198, 34, 27, 34, 314, 216, 36, 30, 2, 198, 1, 4093, 198, 3528, 216, 35, 27, 35, 47, 2,
         198, 1, 520, 9531, 198, 35, 27, 35, 314, 216, 38, 30, 2, 198],
        list(range(26, 35)) + list(range(50, 59)),
    ),
    ("qwen3", None): (
        [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198, 17, 10, 17, 374,
         220, 19, 13, 151645, 198, 151644, 872, 198, 3036, 220, 18, 10, 18, 30, 151645, 198, 151644, 77091,
         198, 151667, 271, 151668, 271, 18, 10, 18, 374, 220, 21, 13, 151645, 198],
        list(range(15, 24)) + list(range(42, 51)),
    ),
    ("qwen3", "You are terse."): (
        [151644, 8948, 198, 2610, 525, 50537, 13, 151645, 198, 151644, 872, 198, 3838, 374, 220, 17, 10, 17,
         30, 151645, 198, 151644, 77091, 198, 17, 10, 17, 374, 220, 19, 13, 151645, 198, 151644, 872, 198,
         3036, 220, 18, 10, 18, 30, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271, 18, 10, 18,
         374, 220, 21, 13, 151645, 198],
        list(range(24, 33)) + list(range(51, 60)),
    ),
}

GOLDEN_TEXT = {
    "smollm2": (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n2+2 is 4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n3+3 is 6.<|im_end|>\n"
    ),
    # The final assistant turn carries the empty think block of a non-thinking Qwen3 prompt.
    "qwen3": (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n2+2 is 4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n3+3 is 6.<|im_end|>\n"
    ),
}


@pytest.fixture
def tokenizers(smollm2_tokenizer, qwen3_tokenizer):
    return {"smollm2": smollm2_tokenizer, "qwen3": qwen3_tokenizer}


def supervised_spans(tokenizer, ids, mask):
    """Decoded text of each maximal run of loss_mask == 1."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


# ---------------------------------------------------------------- offline Qwen3 tokenizer


def test_qwen3_tokenizer_matches_reference_ids(qwen3_tokenizer):
    tok = qwen3_tokenizer
    assert tok.encode("Hello", add_special_tokens=False) == [9707]
    assert len(tok) == 151669
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        151643, 151644, 151645, 151667, 151668,
    ]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # Role words and newlines as in the published Qwen3 tokenizer.
    assert tok.encode("<|im_start|>system\n", add_special_tokens=False) == [151644, 8948, 198]
    assert tok.encode("<|im_start|>assistant\n\n", add_special_tokens=False) == [151644, 77091, 271]
    # Digits are split one by one (Qwen regex), unlike the cl100k-style default.
    assert tok.encode("2024", add_special_tokens=False) == [17, 15, 17, 19]


def test_qwen3_tokenizer_special_flags_as_qwen3(qwen3_tokenizer):
    # <think> is an atomic added token but not "special" in Qwen3: skipping specials keeps it.
    ids = qwen3_tokenizer.encode("<|im_start|><think>x</think><|im_end|>", add_special_tokens=False)
    assert ids[0] == 151644 and ids[1] == 151667 and ids[-1] == 151645
    assert qwen3_tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_qwen3_tokenizer_agrees_with_tiktoken(qwen3_tokenizer):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    from data.assets import QWEN3_PRETOKENIZE_PATTERN, QWEN3_SPECIAL_TOKENS, _qwen_tiktoken_path

    enc = tiktoken.Encoding(
        "qwen-reference",
        pat_str=QWEN3_PRETOKENIZE_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(_qwen_tiktoken_path()),
        special_tokens={t: 151643 + i for i, (t, _) in enumerate(QWEN3_SPECIAL_TOKENS)},
    )
    texts = [
        "Hello world! It's 12:30, isn't it?",
        "def f(x):\n\treturn x ** 2  # square\n\n\n",
        "日本語のテキスト。中文也可以。 Émoji 🤖🎉",
        "   leading and trailing   ",
        "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
    ]
    for text in texts:
        assert qwen3_tokenizer.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all"), text


def test_qwen3_saved_tokenizer_round_trips(tmp_path, monkeypatch, qwen3_tokenizer):
    from transformers import AutoTokenizer

    import data.assets as assets

    save_dir = tmp_path / "qwen3"
    saved = assets.build_qwen3_tokenizer(save_dir)
    saved_files = sorted(p.name for p in save_dir.iterdir())
    assert saved_files == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in tmp_path.iterdir() if p.name != "qwen3"]  # no temp dir left behind

    def no_save(*args, **kwargs):
        raise AssertionError("an existing saved tokenizer must be reused, not rewritten")

    class LoadStub:  # loading is covered below; here only the reuse decision matters
        @staticmethod
        def from_pretrained(path):
            return ("loaded", path)

    monkeypatch.setattr(assets, "publish_dir", no_save)
    monkeypatch.setattr(assets, "PreTrainedTokenizerFast", LoadStub)
    assert assets.build_qwen3_tokenizer(save_dir) == ("loaded", str(save_dir))

    auto = AutoTokenizer.from_pretrained(str(save_dir))
    msgs = build_messages(TURNS, ANSWERS, None)
    expected = tokenize_conversation(qwen3_tokenizer, msgs, enable_thinking=False)
    for tok in (saved, auto):
        assert len(tok) == 151669
        assert tok.chat_template == qwen3_tokenizer.chat_template
        assert tokenize_conversation(tok, msgs, enable_thinking=False) == expected
    assert tokenizer_fingerprint(auto) == tokenizer_fingerprint(qwen3_tokenizer)


# ---------------------------------------------------------------- build_messages


def test_build_messages_interleaves_and_places_system_first():
    assert build_messages(["a", "b"], ["x", "y"], "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "y"},
    ]
    assert build_messages(["a", "b"], ["x"], None) == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "b"},
    ]
    # An empty string is an explicit (empty) system prompt, not "use the default".
    assert build_messages(["a"], [], "")[0] == {"role": "system", "content": ""}


@pytest.mark.parametrize("answers", [[], ["x", "y", "z"]])
def test_build_messages_rejects_wrong_answer_count(answers):
    with pytest.raises(ValueError, match="answers"):
        build_messages(["a", "b"], answers, None)


def test_build_messages_rejects_empty_and_non_string():
    with pytest.raises(ValueError):
        build_messages([], [], None)
    with pytest.raises(TypeError):
        build_messages("a question", [], None)
    with pytest.raises(TypeError):
        build_messages(["a"], [None], None)


# ---------------------------------------------------------------- golden conversations


@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
@pytest.mark.parametrize("system_prompt", [None, "You are terse."])
def test_golden_two_turn_conversation(tokenizers, name, system_prompt):
    tok = tokenizers[name]
    msgs = build_messages(TURNS, ANSWERS, system_prompt)
    ids, mask = tokenize_conversation(tok, msgs, enable_thinking=False)

    golden_ids, golden_mask_positions = GOLDEN[(name, system_prompt)]
    assert ids == golden_ids
    assert [i for i, m in enumerate(mask) if m] == golden_mask_positions
    assert supervised_spans(tok, ids, mask) == EXPECTED_SPANS

    text = tok.decode(ids)
    if system_prompt is not None:
        assert text == f"<|im_start|>system\n{system_prompt}<|im_end|>\n" + GOLDEN_TEXT[name]
    elif name == "smollm2":
        assert text == f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n" + GOLDEN_TEXT[name]
    else:
        assert text == GOLDEN_TEXT[name]


def test_smollm2_default_system_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    default = tok.decode(render_prompt_ids(tok, build_messages(["Hi"], [], None), enable_thinking=False))
    assert default.startswith(f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi")

    custom = tok.decode(render_prompt_ids(tok, build_messages(["Hi"], [], "Be brief."), enable_thinking=False))
    assert custom.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert "SmolLM" not in custom


def test_qwen3_template_has_no_default_system_prompt(qwen3_tokenizer):
    text = qwen3_tokenizer.decode(render_prompt_ids(qwen3_tokenizer, build_messages(["Hi"], [], None), True))
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------- prompts


SMOLLM2_ASSISTANT_HEADER = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"
QWEN3_ASSISTANT_HEADER = [151644, 77091, 198]
QWEN3_EMPTY_THINK = [151667, 271, 151668, 271]  # "<think>\n\n</think>\n\n"


def test_render_prompt_ids_ends_with_assistant_header(smollm2_tokenizer, qwen3_tokenizer):
    msgs = build_messages(TURNS, ANSWERS[:1], None)
    smol = render_prompt_ids(smollm2_tokenizer, msgs, enable_thinking=False)
    assert smol[-4:] == SMOLLM2_ASSISTANT_HEADER
    qwen_think = render_prompt_ids(qwen3_tokenizer, msgs, enable_thinking=True)
    assert qwen_think[-3:] == QWEN3_ASSISTANT_HEADER
    qwen_no_think = render_prompt_ids(qwen3_tokenizer, msgs, enable_thinking=False)
    assert qwen_no_think[-7:] == QWEN3_ASSISTANT_HEADER + QWEN3_EMPTY_THINK
    assert qwen_no_think[:-4] == qwen_think


@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_prompt_is_prefix_of_conversation_and_mask_starts_after_it(tokenizers, name):
    # Regeneration feeds render_prompt_ids to the target; training must see the same ids
    # before the answer, and supervise from the first answer token on.
    tok = tokenizers[name]
    msgs = build_messages(TURNS, ANSWERS, None)
    ids, mask = tokenize_conversation(tok, msgs, enable_thinking=False)
    prompt = render_prompt_ids(tok, msgs[:-1], enable_thinking=False)
    assert ids[: len(prompt)] == prompt
    assert mask[len(prompt) - 1] == 0
    assert all(mask[len(prompt):])


# ---------------------------------------------------------------- thinking


THINK_ANSWERS = ["<think>\nreason one\n</think>\n\nA1", "<think>\nreason two\n</think>\n\nA2"]


def test_strip_think():
    assert strip_think("<think>\nx\n</think>\n\nAnswer") == "Answer"
    assert strip_think("pre <think>a</think> mid <think>b</think>end") == "pre mid end"
    assert strip_think("reasoning without opening tag</think>\n\nAnswer") == "Answer"
    assert strip_think("no reasoning") == "no reasoning"


def test_qwen3_thinking_drop_non_thinking(qwen3_tokenizer):
    msgs = build_messages(TURNS, THINK_ANSWERS, None)
    ids, mask = tokenize_conversation(qwen3_tokenizer, msgs, enable_thinking=False, thinking="drop")
    text = qwen3_tokenizer.decode(ids)
    assert "reason" not in text
    assert supervised_spans(qwen3_tokenizer, ids, mask) == ["A1<|im_end|>\n", "A2<|im_end|>\n"]


def test_qwen3_thinking_keep_supervises_last_turn_reasoning(qwen3_tokenizer):
    msgs = build_messages(TURNS, THINK_ANSWERS, None)
    ids, mask = tokenize_conversation(qwen3_tokenizer, msgs, enable_thinking=True, thinking="keep")
    text = qwen3_tokenizer.decode(ids)
    # The template drops the reasoning of turns before the last user message...
    assert "reason one" not in text and "reason two" in text
    # ...so turn 1 as rendered is not what the model generated: it is left unsupervised.
    assert supervised_spans(qwen3_tokenizer, ids, mask) == ["<think>\nreason two\n</think>\n\nA2<|im_end|>\n"]


def test_qwen3_thinking_drop_with_thinking_prompt(qwen3_tokenizer):
    # With enable_thinking=True the generated text starts with the (empty) think block, which
    # history rewriting removes from turn 1: only the last turn can be supervised.
    msgs = build_messages(TURNS, THINK_ANSWERS, None)
    ids, mask = tokenize_conversation(qwen3_tokenizer, msgs, enable_thinking=True, thinking="drop")
    assert "reason" not in qwen3_tokenizer.decode(ids)
    assert supervised_spans(qwen3_tokenizer, ids, mask) == ["<think>\n\n</think>\n\nA2<|im_end|>\n"]


def test_qwen3_keep_reasoning_with_non_thinking_prompt_is_a_template_error(qwen3_tokenizer):
    msgs = build_messages(TURNS[:1], THINK_ANSWERS[:1], None)
    with pytest.raises(ValueError, match="chat template"):
        tokenize_conversation(qwen3_tokenizer, msgs, enable_thinking=False, thinking="keep")


def test_invalid_thinking_mode(qwen3_tokenizer):
    with pytest.raises(ValueError, match="thinking"):
        tokenize_conversation(qwen3_tokenizer, build_messages(TURNS, ANSWERS, None), False, thinking="strip")


# ---------------------------------------------------------------- masks: edge cases


@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_answer_repeating_user_text_is_found_in_assistant_turn(tokenizers, name):
    tok = tokenizers[name]
    msgs = build_messages(["Yes", "Yes"], ["Yes", "Yes"], "S")
    ids, mask = tokenize_conversation(tok, msgs, enable_thinking=False)
    assert supervised_spans(tok, ids, mask) == ["Yes<|im_end|>\n", "Yes<|im_end|>\n"]
    # Each supervised run must start right after an assistant header, not inside a user turn.
    header = SMOLLM2_ASSISTANT_HEADER if name == "smollm2" else QWEN3_ASSISTANT_HEADER
    header_ends = [i + len(header) for i in range(len(ids)) if ids[i : i + len(header)] == header]
    if name == "qwen3":
        header_ends[-1] += len(QWEN3_EMPTY_THINK)  # the final turn carries the empty think block
    run_starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    assert run_starts == header_ends


@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_multibyte_and_unnormalized_text(tokenizers, name):
    import unicodedata

    tok = tokenizers[name]
    answers = ["cafe\u0301 \u2615 \u65e5\u672c\u8a9e", "\U0001F916\U0001F389 ok"]
    msgs = build_messages(["Say cafe\u0301", "emoji"], answers, "S")
    ids, mask = tokenize_conversation(tok, msgs, enable_thinking=False)
    spans = supervised_spans(tok, ids, mask)
    # Qwen3 applies NFC; SmolLM2 keeps the text as is.
    norm = (lambda s: unicodedata.normalize("NFC", s)) if name == "qwen3" else (lambda s: s)
    assert spans == [norm(a) + "<|im_end|>\n" for a in answers]


def test_single_turn_and_prompt_only(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, mask = tokenize_conversation(tok, build_messages(["Hi"], ["Hello!"], "S"), enable_thinking=False)
    assert supervised_spans(tok, ids, mask) == ["Hello!<|im_end|>\n"]
    ids, mask = tokenize_conversation(tok, build_messages(["Hi"], [], "S"), enable_thinking=False)
    assert ids and not any(mask)


def test_max_length_truncates_both(qwen3_tokenizer):
    msgs = build_messages(TURNS, ANSWERS, None)
    full_ids, full_mask = tokenize_conversation(qwen3_tokenizer, msgs, enable_thinking=False)
    ids, mask = tokenize_conversation(qwen3_tokenizer, msgs, enable_thinking=False, max_length=20)
    assert ids == full_ids[:20] and mask == full_mask[:20]
    assert len(ids) == 20


def test_missing_chat_template_raises_naming_tokenizer(qwen3_tokenizer):
    tok = copy.deepcopy(qwen3_tokenizer)
    tok.chat_template = None
    msgs = build_messages(TURNS, ANSWERS, None)
    with pytest.raises(ValueError, match=r"qwen3-offline.*no chat template"):
        tokenize_conversation(tok, msgs, enable_thinking=False)
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt_ids(tok, msgs, enable_thinking=False)


def test_template_that_rewrites_prompt_raises(qwen3_tokenizer):
    # A template whose generation prompt is not a prefix of the answered turn.
    tok = copy.deepcopy(qwen3_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\nSure! {% endif %}"
    )
    with pytest.raises(ValueError, match="generation prompt"):
        tokenize_conversation(tok, build_messages(["Hi"], ["Hello"], None), enable_thinking=False)


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_stable_and_sensitive(smollm2_tokenizer, qwen3_tokenizer):
    fp = tokenizer_fingerprint(qwen3_tokenizer)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert tokenizer_fingerprint(qwen3_tokenizer) == fp
    assert tokenizer_fingerprint(smollm2_tokenizer) != fp

    changed = copy.deepcopy(qwen3_tokenizer)
    assert tokenizer_fingerprint(changed) == fp
    changed.chat_template = qwen3_tokenizer.chat_template.replace("<|im_end|>\\n", "<|im_end|>")
    assert changed.chat_template != qwen3_tokenizer.chat_template
    assert tokenizer_fingerprint(changed) != fp

    extended = copy.deepcopy(qwen3_tokenizer)
    extended.add_tokens(["<draftsmith_new_token>"])
    assert tokenizer_fingerprint(extended) != fp
