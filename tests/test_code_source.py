"""The code prompt source (data/sources/libcode.py, source `libcode`) and the chat : GSM8K-train : code recipe mix:
enough distinct prompts in both shapes, deterministic, nothing HumanEval defines, and no held-out prompt (MT-bench,
HumanEval, GSM8K test, loaded the way eval loads them) among the training prompts."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from conftest import ROOT
from core.recipe import load_recipe
from data.sources.libcode import LibFunction, _task, library_functions
from data.sources.prompts import eval_prompts, load_prompts
from data.sources.registry import humaneval_names, load_source, source_problem

# grade-school-math's files, read by path and never committed (../shared/data/gsm8k); a small fixture otherwise
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
CODEMIX = "dspark_smollm2_135m_codemix"


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path_factory, monkeypatch):
    """Keep datasets' Arrow cache for the small test files out of the user's HF cache."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_ds"))


@pytest.fixture(scope="module")
def code_prompts():
    return load_source("libcode")


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


# ---------------------------------------------------------------- the source


def test_libcode_gives_thousands_of_distinct_prompts_in_both_shapes(code_prompts, record_property):
    texts = [p.turns[0] for p in code_prompts]
    distinct = {_norm(t) for t in texts}
    record_property("figure", f"libcode: {len(distinct)} distinct code prompts from the standard library")
    assert len(distinct) >= 3000 and len({p.id for p in code_prompts}) == len(code_prompts)
    assert all(p.id.startswith("libcode:") and p.source == "libcode" and len(p.turns) == 1 for p in code_prompts)
    shapes = {"function completion": r"Complete the following Python function:\n\n```python\n(@\S+\n)*def ",
              "method completion": r"Complete the following method of the Python class `\w+`:\n\n```python\nclass ",
              "instruction": r"Write a Python function that [a-z]+s ",
              "instruction with a signature": r"Write a Python function `\w+\(.*\)` that [a-z]+s "}
    for shape, pattern in shapes.items():
        assert sum(bool(re.match(pattern, t)) for t in texts) > 100, shape


def test_libcode_is_deterministic(code_prompts):
    """The walk itself (not a cache) gives the same prompts in the same order; a recipe's seed then picks them."""
    library_functions.cache_clear()
    assert load_source("libcode") == code_prompts
    assert load_source("libcode", limit=5) == code_prompts[:5]


def test_libcode_leaves_out_every_function_humaneval_defines(code_prompts):
    names = humaneval_names()
    shown = {m for p in eval_prompts("humaneval", None, 0) for m in re.findall(r"\bdef\s+(\w+)", p.turns[0])}
    assert len(shown) > 150 and shown <= names and {"encode_cyclic", "decode_cyclic", "make_palindrome"} <= names
    ids = {p.id for p in code_prompts}
    for collision in ("statistics.median", "operator.add", "re.search", "base64.encode"):  # stdlib names HumanEval uses
        assert f"libcode:{collision}" not in ids
    assert all(p.id.rsplit(".", 1)[-1] not in names for p in code_prompts)
    named = re.compile(r"\bdef\s+(\w+)\s*\(|`(\w+)\(")  # a function defined or asked for (not a `parameter`)
    assert not {m for p in code_prompts for pair in named.findall(p.turns[0]) for m in pair if m} & names


def test_libcode_shows_the_signature_and_docstring_never_the_body(tmp_path):
    """A folder of one's own as `path`: public documented functions and methods only, tests and private files skipped,
    HumanEval's names (has_close_elements, below_zero) left out even there."""
    lib = tmp_path / "mylib"
    (lib / "tests").mkdir(parents=True)
    (lib / "tools.py").write_text(
        'def add_numbers(a, b=2):\n    """Return the sum of a and b, as an int."""\n    return SECRET_BODY\n\n\n'
        'def has_close_elements(numbers, threshold):\n    """Check if two numbers are closer than threshold."""\n\n\n'
        'def _private(x):\n    """Return x unchanged, privately."""\n\n\ndef terse():\n    """Too short."""\n\n\n'
        'class Box:\n    def push(self, item):\n        """Push an item onto the box, at its top."""\n'
        '        SECRET_BODY\n\n'
        '    def below_zero(self, operations):\n        """Detect whether the balance falls below zero."""\n')
    (lib / "_impl.py").write_text('def hidden(x):\n    """Return x from a private module."""\n')
    (lib / "tests" / "test_tools.py").write_text('def test_add(x):\n    """Check that add works on x."""\n')
    got = load_source("libcode", path=str(lib))
    assert [p.id for p in got] == ["libcode:tools.add_numbers", "libcode:tools.Box.push"]
    add, push = (p.turns[0] for p in got)
    assert "SECRET_BODY" not in add + push
    assert ("def add_numbers(a, b=2):\n" in add and '"""Return the sum of a and b, as an int."""' in add
            or "that returns the sum of a and b, as an int" in add)
    assert ("class Box:\n    def push(self, item):" in push or "that pushes an item onto the box, at its top" in push)
    assert source_problem("libcode", str(lib)) is None
    assert source_problem("libcode", str(tmp_path / "missing")) == f"folder {tmp_path / 'missing'} not found"


@pytest.mark.parametrize("doc,task", [
    ("Return the sum of a and b.", "returns the sum of a and b"),
    ("Returns the sum of a and b.", "returns the sum of a and b"),
    ("Apply f to every item of xs.", "applies f to every item of xs"),
    ("Push an item. Then more text.", "pushes an item"),
    ("Process the queue until empty.", "processes the queue until empty"),
    ("This is a helper for the parser.", None),  # not a verb: only a completion request is made from it
    ("Return x.", None),  # too short to say what to write
])
def test_instruction_from_the_first_sentence(doc, task):
    assert _task(LibFunction("m", None, "f", "def f(x):", "x", doc)) == task


# ---------------------------------------------------------------- the recipe mix


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory):
    """(train.jsonl, test.jsonl): grade-school-math's where this checkout has them, else a small fixture."""
    if (GSM8K / "train.jsonl").is_file() and (GSM8K / "test.jsonl").is_file():
        return GSM8K / "train.jsonl", GSM8K / "test.jsonl"
    folder = tmp_path_factory.mktemp("gsm8k")
    for split, n in (("train", 1100), ("test", 40)):
        rows = [{"question": f"A {split} farmer has {i} sheep and buys {i + 3} more. How many sheep now?",
                 "answer": f"{i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3}\n#### {2 * i + 3}"}
                for i in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "train.jsonl", folder / "test.jsonl"


@pytest.fixture(scope="module")
def held_out(gsm8k_files):
    """The held-out prompts, loaded the way eval loads them (eval_prompts, every row)."""
    return (eval_prompts("mtbench", None, 0) + eval_prompts("humaneval", None, 0)
            + eval_prompts("gsm8k", None, 0, path=str(gsm8k_files[1])))


def _codemix(gsm8k_train):
    """The codemix recipe with its gsm8k source read from `gsm8k_train` (the offline form its comment documents)."""
    recipe = load_recipe(CODEMIX)
    sources = [dataclasses.replace(s, path=str(gsm8k_train)) if s.name == "gsm8k" else s for s in recipe.data.sources]
    return recipe, sources


def _leaks(train, held) -> list[str]:
    """Every held-out prompt found among the training prompts: a turn equal to one (exactly, or after whitespace and
    case are normalised), a held-out turn inside a training turn, or a HumanEval signature line in one."""
    exact = {t: p.id for p in held for t in p.turns}
    normal = {_norm(t): p.id for p in held for t in p.turns}
    found = [f"{q.id} = {exact.get(t) or normal[_norm(t)]}" for q in train for t in q.turns
             if t in exact or _norm(t) in normal]
    corpus = "\0".join(_norm(t) for q in train for t in q.turns)
    found += [f"{pid} inside a training prompt" for text, pid in normal.items() if text in corpus]
    signatures = {_norm(m) for p in held if p.source == "humaneval"
                  for m in re.findall(r"^def \w+\(.*:\s*$", p.turns[0].split("```python\n")[-1], re.M)}
    return found + [f"HumanEval signature {s!r} in a training prompt" for s in signatures if s in corpus]


def test_codemix_recipe_is_the_default_with_chat_math_and_code_one_to_one_to_one():
    recipe, default = load_recipe(CODEMIX), load_recipe("dspark_smollm2_135m")
    assert [(s.name, s.weight) for s in recipe.data.sources] == [("sharegpt", 1.0), ("gsm8k", 1.0), ("libcode", 1.0)]
    same = dataclasses.asdict(recipe) | {"name": default.name, "data": dataclasses.asdict(default.data)}
    assert same == dataclasses.asdict(default)  # every other setting inherited from the default


@pytest.mark.parametrize("name, num_prompts", [(CODEMIX, None), (CODEMIX, 3000), ("dspark_smollm2_135m", None)],
                         ids=["codemix, the recipe's num_prompts", "codemix, 3000 prompts", "the default recipe"])
def test_no_held_out_prompt_is_trained_on(name, num_prompts, gsm8k_files, held_out, record_property):
    if name == CODEMIX:
        recipe, sources = _codemix(gsm8k_files[0])
    else:
        recipe = load_recipe(name)
        sources = recipe.data.sources
    data = recipe.data
    train = load_prompts(sources, num_prompts or data.num_prompts, data.holdout_fraction, recipe.seed,
                         allow_fewer=data.allow_fewer)  # as the regenerate stage loads them
    shares = {s.name: sum(p.source == s.name for p in train) for s in sources}
    assert len(train) == (num_prompts or data.num_prompts) and max(shares.values()) - min(shares.values()) <= 1
    record_property("figure", f"{name}: {len(train)} training prompts {shares} against {len(held_out)} held-out "
                              f"({'grade-school-math' if gsm8k_files[0].parent == GSM8K else 'fixture'} GSM8K)")
    assert _leaks(train, held_out) == []


def test_the_leak_check_sees_a_planted_leak(tmp_path, held_out):
    """The check above can fail: a held-out MT-bench question with its spaces changed, a GSM8K test question quoted
    inside a longer prompt, and a HumanEval signature in a code prompt are each found."""
    mtbench = next(p for p in held_out if p.source == "mtbench").turns[0]
    gsm8k = next(p for p in held_out if p.source == "gsm8k").turns[0]
    rows = [{"prompt": "  " + mtbench.replace(" ", "   ") + "\n"}, {"prompt": f"Please solve: {gsm8k} Thanks!"},
            {"prompt": "Write this:\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"}]
    planted = tmp_path / "planted.jsonl"
    planted.write_text("".join(json.dumps(r) + "\n" for r in rows))
    leaks = _leaks(load_source(str(planted)), held_out)
    assert any(leak.startswith("planted:0 = mtbench:") for leak in leaks)
    assert any(leak.startswith("gsm8k:") and "inside" in leak for leak in leaks)
    assert any("HumanEval signature 'def has_close_elements(" in leak for leak in leaks)
