"""Tests for data.sources (registry, readers, rows, prompts): sources, file formats, row shapes, errors, dedup,
splitting and mixing."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from conftest import ROOT, run_cli
from data.sources import readers
from data.sources import registry as sources
from data.sources.prompts import eval_prompts, is_holdout, load_prompts, split_trained, trained_keys
from data.sources.rows import Prompt
from data.sources.registry import load_source


@dataclass
class Src:
    name: str
    path: str | None = None
    weight: float = 1.0
    split: str = "train"


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path_factory, monkeypatch):
    """Keep datasets' Arrow cache for the tiny test files out of the user's HF cache."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_ds"))


def write_jsonl(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def numbered_rows(prefix, n):
    return [{"id": f"{prefix}{i}", "prompt": f"{prefix} question number {i}?"} for i in range(n)]


# ---------------------------------------------------------------- packaged sources


def test_sharegpt_limit_returns_complete_conversations():
    rows = load_source("sharegpt", limit=25)
    assert len(rows) == 25
    assert rows[0].id == "sharegpt:QWJhYvA_0"  # first conversation of the file
    assert rows[0].turns[0].startswith("Summarize the main ideas of Jeff Walker")
    # The first conversation alternates human/gpt: only the human turns are kept.
    assert all("Here are the main ideas" not in t for t in rows[0].turns)
    assert len({p.id for p in rows}) == 25
    for p in rows:
        assert p.source == "sharegpt" and p.id.startswith("sharegpt:")
        assert p.turns and all(isinstance(t, str) and t.strip() == t and t for t in p.turns)


def test_sharegpt_full_file_stops_cleanly_at_truncation():
    rows = load_source("sharegpt")
    # The packaged file is cut inside conversation 17672: 17671 complete ones, minus
    # those without any (non-empty) human turn.
    assert 17000 < len(rows) <= 17671
    assert len({p.id for p in rows}) == len(rows)  # duplicate upstream ids get a suffix
    assert any(p.system for p in rows)  # leading system messages are kept as `system`
    assert max(len(p.turns) for p in rows) > 2


def test_json_array_stream_reads_only_what_is_consumed():
    items = [{"id": i, "text": "x" * 200} for i in range(2000)]
    data = json.dumps(items)
    f = io.StringIO(data)
    stream = readers.iter_json_array_stream(f, chunk_chars=4096)
    first = [next(stream) for _ in range(3)]
    assert first == items[:3]
    assert f.tell() < len(data) // 10  # not the whole file


def test_json_array_stream_tolerates_truncation_and_big_elements():
    items = [{"id": i, "text": "y" * (i * 3000)} for i in range(6)]
    data = json.dumps(items)
    cut = data[: data.index('"id": 5') + 100]  # element 5 cut off; elements span many chunks
    assert list(readers.iter_json_array_stream(io.StringIO(cut), chunk_chars=512)) == items[:5]
    assert list(readers.iter_json_array_stream(io.StringIO(data), chunk_chars=512)) == items
    assert list(readers.iter_json_array_stream(io.StringIO(data[:-1]), chunk_chars=512)) == items  # no ']'


def test_sharegpt_path_truncated_file(tmp_path):
    convs = [
        {"id": "a", "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi there"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "  Second question  "},
            {"from": "gpt", "value": "Answer."}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "only an answer"}]},
        {"id": "c", "conversations": [{"from": "human", "value": ""}, {"from": "human", "value": "c1"}]},
        {"id": "a", "conversations": [{"from": "human", "value": "repeated id"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "cut here " * 50}]},
    ]
    text = json.dumps(convs, indent=2)
    path = tmp_path / "sg.json"
    path.write_text(text[: text.index("cut here") + 40])
    rows = load_source("sharegpt", path=str(path))
    assert [p.id for p in rows] == ["sharegpt:a", "sharegpt:c", "sharegpt:a#2"]
    assert rows[0].system == "Be brief."
    assert rows[0].turns == ("Hi there", "Second question")
    assert rows[1].turns == ("c1",)
    assert [p.id for p in load_source("sharegpt", path=str(path), limit=2)] == ["sharegpt:a", "sharegpt:c"]


def test_sharegpt_file_cut_at_its_end_keeps_what_came_before_with_a_warning(tmp_path, caplog, drill):
    drill("corruption", "ShareGPT file cut at its end")
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} " + "x" * 40}]}
             for i in range(5)]
    text = json.dumps(convs, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index("question 4") + 20])  # a truncated download: the last conversation runs to EOF
    with caplog.at_level("WARNING", logger="data.sources.readers"):
        rows = load_source("sharegpt", path=str(path))
    assert [p.id for p in rows] == [f"sharegpt:c{i}" for i in range(4)]
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert str(path) in warning.getMessage() and "kept the 4 complete conversations" in warning.getMessage()


@pytest.mark.parametrize("corrupt,element,where", [
    (lambda text: text.replace('"question 2"', '"question 2" "and more"'), 2, '"and more"'),
    (lambda text: text.replace('"question 1"', 'question 1"'), 1, 'question 1"'),
    (lambda text: text + "\n[]", 5, "[]"),  # a second array after the first
], ids=["missing comma", "unquoted string", "data after the array"])
def test_sharegpt_syntax_error_before_the_end_is_refused_with_its_place(tmp_path, corrupt, element, where, drill):
    """Every conversation after a syntax error would be lost: refused, naming the file, the element, its line and
    column, and the fix."""
    drill("corruption", f"ShareGPT file with a syntax error at {where}")
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"}]} for i in range(5)]
    text = corrupt(json.dumps(convs, indent=2))
    path = tmp_path / "broken.json"
    path.write_text(text)
    before = text[: text.index(where)]
    line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
    for chunk_chars in (16, 1 << 20):  # the error inside one chunk or across many
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(readers, "CHUNK_CHARS", chunk_chars)
            with pytest.raises(ValueError) as err:
                load_source("sharegpt", path=str(path))
        message = str(err.value)
        assert str(path) in message and f"element {element} (0-based) at line {line}, column {column}:" in message
        assert "repair the file" in message


def _bad_utf8(path):
    path.write_bytes(b'{"prompt": "caf\xe9 au lait"}\n')  # Latin-1, not UTF-8


def _cut_gz(path):
    rows = "".join(json.dumps({"prompt": f"question {i} " + "x" * 50}) + "\n" for i in range(200))
    packed = gzip.compress(rows.encode())
    path.write_bytes(packed[: len(packed) // 2])  # a download cut half way


@pytest.mark.parametrize("source", ["file", "sharegpt"])
@pytest.mark.parametrize("name,damage,says", [("bad.jsonl", _bad_utf8, "not valid UTF-8"),
                                              ("cut.jsonl.gz", _cut_gz, "the .gz file is cut off or corrupt")],
                         ids=["invalid UTF-8", "cut .gz"])
def test_prompt_file_that_cannot_be_decoded_is_refused_naming_it(tmp_path, source, name, damage, says, drill):
    """Issue 37: invalid UTF-8 and a cut .gz used to stop the run with a decoder's message that names no file. Read
    whole (a prompt file) or streamed (a ShareGPT file), the error names the file, what is wrong and the fix."""
    drill("corruption", f"{source} prompt file: {says}")
    path = tmp_path / name
    damage(path)
    with pytest.raises(ValueError) as err:
        load_source(str(path)) if source == "file" else load_source("sharegpt", path=str(path))
    assert str(path) in str(err.value) and says in str(err.value)


def test_sharegpt_reading_stops_at_limit(tmp_path, monkeypatch):
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i} " + "z" * 300},
                                               {"from": "gpt", "value": "a" * 300}]} for i in range(3000)]
    text = json.dumps(convs)
    path = tmp_path / "big_sharegpt.json"
    path.write_text(text)
    read_chars = []

    class CountingIO(io.StringIO):
        def read(self, size=-1):
            chunk = super().read(size)
            read_chars.append(len(chunk))
            return chunk

    def open_text(p):
        return CountingIO(text)

    monkeypatch.setattr(sources, "open_text", open_text)
    monkeypatch.setattr(readers, "CHUNK_CHARS", 8192)
    rows = load_source("sharegpt", path=str(path), limit=7)
    assert [p.id for p in rows] == [f"sharegpt:c{i}" for i in range(7)]
    assert 0 < sum(read_chars) < len(text) // 20


def test_humaneval_164_rows():
    rows = load_source("humaneval")
    assert len(rows) == 164
    assert rows[0].id == "humaneval:HumanEval/0"
    assert rows[-1].id == "humaneval:HumanEval/163"
    (turn,) = rows[0].turns
    assert "```python\n" in turn and "def has_close_elements" in turn and turn.endswith("```")
    assert "canonical" not in turn and "return" not in turn.split('"""')[-1]  # no solution leaked


def test_mtbench_80_rows_two_turns():
    rows = load_source("mtbench")
    assert len(rows) == 80
    assert all(len(p.turns) == 2 for p in rows)
    assert rows[0].id == "mtbench:81"
    assert len({p.id for p in rows}) == 80
    assert load_source("MT-Bench", limit=5) == rows[:5]  # alias, limit


def test_gsm8k_without_hub_or_path_says_to_set_path():
    with pytest.raises(ValueError, match=r"gsm8k.*`path`"):
        load_source("gsm8k")


# ---------------------------------------------------------------- local files


GSM8K_FIXTURE = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 6 eggs. How many eggs are in 5 boxes?",
     "answer": "5 * 6 = <<5*6=30>>30 eggs.\n#### 30"},
    {"question": "Sara reads 12 pages a day. How many pages does she read in a week?",
     "answer": "12 * 7 = <<12*7=84>>84 pages.\n#### 84"},
]


def test_gsm8k_local_fixture(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k_mini.jsonl", GSM8K_FIXTURE)
    rows = load_source("gsm8k", path=path)
    assert [p.id for p in rows] == ["gsm8k:0", "gsm8k:1", "gsm8k:2"]
    assert rows[1].turns == (GSM8K_FIXTURE[1]["question"],)
    assert all("####" not in t for p in rows for t in p.turns)  # answers are not turns
    # the source's own answer, kept for regen.backend: source, without the calculator annotations
    assert rows[1].answers == ("5 * 6 = 30 eggs.\n#### 30",)
    assert [p.id for p in eval_prompts("gsm8k", None, 0, path=path)] == [p.id for p in rows]


@pytest.mark.parametrize("gz", [False, True])
def test_local_jsonl_each_shape(tmp_path, gz):
    rows = [
        {"conversations": [{"from": "human", "value": "sharegpt style"}, {"from": "gpt", "value": "ans"}]},
        {"conversations": [{"role": "system", "content": "sys"}, {"role": "user", "content": "openai style"},
                           {"role": "assistant", "content": "ans"}, {"role": "user", "content": "again"}]},
        {"turns": ["t1", "t2"]},
        {"question": "a question"},
        {"prompt": "a prompt", "id": "custom"},
        {"prompt": "   "},  # empty: dropped, but keeps its row index
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]},
        # two user turns in a row: the answer after them belongs to neither alone
        {"conversations": [{"from": "human", "value": "u1"}, {"from": "human", "value": "u2"},
                           {"from": "gpt", "value": "a?"}]},
    ]
    path = write_jsonl(tmp_path / ("mixed.jsonl.gz" if gz else "mixed.jsonl"), rows, gz=gz)
    got = load_source(path)
    assert [(p.id, p.system, p.turns) for p in got] == [
        ("mixed:0", None, ("sharegpt style",)),
        ("mixed:1", "sys", ("openai style", "again")),
        ("mixed:2", None, ("t1", "t2")),
        ("mixed:3", None, ("a question",)),
        ("mixed:custom", None, ("a prompt",)),
        ("mixed:6", None, ("parts",)),
        ("mixed:7", None, ("u1", "u2")),
    ]
    # the sources' answers, answers[i] after turns[i], a prefix of the turns
    assert [p.answers for p in got] == [("ans",), ("ans",), (), (), (), (), ()]
    assert all(p.source == "mixed" for p in got)
    assert load_source("json", path=path) == got


def test_local_json_array_file(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([{"turns": ["x"], "system": "s"}, {"prompt": "y"}]))
    got = load_source(str(path))
    assert [(p.id, p.system, p.turns) for p in got] == [("arr:0", "s", ("x",)), ("arr:1", None, ("y",))]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz", "rows.json"])
def test_plain_python_reader_matches_datasets(tmp_path, name):
    rows = [{"prompt": "p1", "id": 1}, {"turns": ["a", "b"]}, {"question": "q"}]
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(rows, indent=1))
    else:
        write_jsonl(path, rows, gz=name.endswith(".gz"))
    assert readers.read_json_rows_python(path) == rows
    via_datasets = [{k: v for k, v in r.items() if v is not None} for r in readers.read_json_rows(path)]
    assert via_datasets == rows


def test_bad_row_shape_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, {"instruction": "x", "output": "y"}])
    with pytest.raises(ValueError) as err:
        load_source(path)
    msg = str(err.value)
    assert "bad.jsonl" in msg and "row 2" in msg
    assert "'instruction'" in msg and "'output'" in msg
    for shape in ("conversations", "turns", "question", "prompt"):
        assert shape in msg


def test_a_null_prompt_is_named_not_keys_seen_nothing(tmp_path, drill):
    """{"prompt": null} used to be refused as 'unrecognised row shape (keys seen: [])'."""
    drill("bad-input", 'a prompt file row {"prompt": null}')
    path = write_jsonl(tmp_path / "p6.jsonl", [{"prompt": None}])
    with pytest.raises(ValueError) as err:
        load_source(path)
    assert f"{path}: row 1: 'prompt' is null or missing" in str(err.value), str(err.value)
    assert "keys seen: []" not in str(err.value)


@pytest.mark.parametrize("text", ["1", '"just a prompt"', "true\n", "3.5\n{}"])
def test_a_file_whose_top_level_is_not_rows_is_refused_naming_it(tmp_path, text, drill):
    """A scalar at the top level (`null` alone crashed the datasets reader: tests/test_bad_inputs.py) is neither a JSON
    array of rows nor JSON Lines: refused naming the file, not read as rows that are not objects."""
    drill("bad-input", f"a prompt file holding {text!r}")
    path = tmp_path / "scalar.json"
    path.write_text(text)
    for read in (readers.read_json_rows, readers.read_json_rows_python):
        with pytest.raises(ValueError, match="neither a JSON array of rows nor JSON Lines") as err:
            read(path)
        assert str(path) in str(err.value)


DEEP = {"deep.jsonl": '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "deep.json": "[" * 100_000 + "]" * 100_000}


@pytest.mark.parametrize("name", DEEP)
def test_a_deeply_nested_prompt_file_is_an_error_line_not_a_crash(name, tmp_path, drill):
    """Nested 100000 deep, a .jsonl prompt file crashed train/main.py and eval.py in pyarrow (rc 139, no message), and
    a .json file ended in a RecursionError traceback naming no file: now one error line naming it, rc 2."""
    drill("bad-input", f"a prompt file {name} nested 100000 deep")
    path = tmp_path / name
    path.write_text(DEEP[name])
    out = tmp_path / "run"
    trained = run_cli(["--recipe", "dspark_smollm2_135m", "--stages", "regenerate", "--out", str(out), "--set",
                       f"data.sources=[{{name: '{path}'}}]", "--set", "data.allow_fewer=true", "--set",
                       "data.holdout_fraction=0", "--set", "regen.backend=hf"])
    evaluated = subprocess.run([sys.executable, "eval.py", "--draft", "ngram", "--target", "smollm2-135m-instruct",
                                "--dataset", str(path), "--out", str(tmp_path / "eval")], cwd=ROOT, timeout=600,
                               env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"), capture_output=True,
                               text=True)
    for done in (trained, evaluated):
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"{path}: line 1: JSON nested over {readers.MAX_JSON_DEPTH} levels deep" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not (out / "recipe.yaml").exists() and not (tmp_path / "eval").exists()


def test_the_depth_bound_counts_brackets_outside_strings_only(tmp_path):
    """Brackets inside a prompt's text are text: a row whose prompt holds 1000 '[' and escaped quotes is read."""
    text = "[" * 1000 + '\\" {'
    path = write_jsonl(tmp_path / "brackets.jsonl", [{"prompt": text}, {"turns": ["ok"]}])
    assert readers.json_depth_problem(path) is None
    assert [p.turns for p in load_source(str(path))] == [(text,), ("ok",)]
    deep = tmp_path / "deep.json"
    deep.write_text("[" + json.dumps({"prompt": "x", "meta": [[[[0]]]]}) + ",\n" + "[" * 70 + "]" * 70 + "]")
    assert f"{deep}: line 2: JSON nested over 64 levels deep" in readers.json_depth_problem(deep)
    for read in (readers.read_json_rows, readers.read_json_rows_python):  # the plain reader: RecursionError named
        too_deep = tmp_path / "too_deep.json"
        too_deep.write_text("[" * 5000 + "]" * 5000)
        with pytest.raises(ValueError, match="nested") as err:
            read(too_deep)
        assert str(too_deep) in str(err.value)


def test_a_byte_order_mark_is_not_prompt_text(tmp_path, drill):
    """A .txt prompt file saved with a BOM (Windows editors) used to keep U+FEFF in its first prompt."""
    drill("bad-input", "a .txt prompt file starting with a UTF-8 byte order mark, CRLF lines")
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfHello there\r\nWhat is 2+2?\r\n")
    assert sorted(p.turns[0] for p in load_prompts([str(path)], 2, 0.0, 42)) == ["Hello there", "What is 2+2?"]
    rows = tmp_path / "bom.jsonl"
    rows.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "Hi"}).encode() + b"\n")
    assert [p.turns for p in load_source(str(rows))] == [("Hi",)]


def test_a_file_in_another_format_is_refused_not_taken_for_a_hub_id(tmp_path, monkeypatch, drill):
    """'dir/prompts.csv' looks like a hub id 'owner/name': it used to be tried on the hub at the regenerate stage,
    while its absolute path was refused up front. An empty or blank file holds no prompt: refused before any work."""
    drill("bad-input", "a relative .csv prompt file, an empty .txt file")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "prompts.csv").write_text("prompt\nhello\n")
    for name in ("dir/prompts.csv", str(tmp_path / "dir" / "prompts.csv")):
        assert f"prompt file {name!r} is not in a prompt format" in sources.source_problem(name)
    for blank in ("", "\n  \n"):
        (tmp_path / "empty.txt").write_text(blank)
        assert sources.source_problem("empty.txt") == "file empty.txt is empty (or blank): it holds no prompt"
    assert sources.source_problem("json", "empty.txt") == "file empty.txt is empty (or blank): it holds no prompt"
    assert sources.source_problem("someone/prompts") is None  # a hub id that is no file stays one


def test_weights_summing_past_the_largest_float_are_refused(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered_rows("a", 10))
    with pytest.raises(ValueError, match="the source weights sum to inf"):
        load_prompts([Src(a, weight=1e308), Src(a, weight=1e308)], 4, 0.0, 0)


def test_message_without_role_is_a_shape_error(tmp_path):
    path = write_jsonl(tmp_path / "norole.jsonl", [{"conversations": [{"text": "hi"}]}])
    with pytest.raises(ValueError, match=r"row 1.*role"):
        load_source(path)


def test_unknown_name_suggests_closest():
    with pytest.raises(ValueError) as err:
        load_source("sharegtp")
    msg = str(err.value)
    assert "Did you mean 'sharegpt'?" in msg
    for name in ("sharegpt", "humaneval", "mtbench", "gsm8k"):
        assert name in msg


def test_hub_id_offline_error_is_clear():
    with pytest.raises(ValueError, match=r"cannot load Hugging Face dataset 'no-such-owner/no-such-set'"):
        load_source("no-such-owner/no-such-set")


def test_missing_local_file():
    with pytest.raises(FileNotFoundError):
        load_source("/nonexistent/prompts.jsonl")


# ---------------------------------------------------------------- load_prompts


def test_dedup_keeps_first(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [
        {"id": "1", "prompt": "Hello   world"},
        {"id": "2", "prompt": "hello world"},  # differs in case: kept
        {"id": "3", "prompt": " Hello world\n"},  # whitespace-only difference: dropped
        {"id": "4", "turns": ["Hello world"], "system": "s"},  # different system: kept
    ])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": "9", "question": "Hello \t world"}, {"id": "8", "prompt": "new"}])
    with pytest.warns(UserWarning, match="has only"):
        got = load_prompts([Src(a), Src(b)], 10, 0.0, 0)
    assert sorted(p.id for p in got) == ["a:1", "a:2", "a:4", "b:8"]


def test_load_prompts_deterministic_and_mixed_by_weight(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered_rows("a", 200))
    b = write_jsonl(tmp_path / "b.jsonl", numbered_rows("b", 200))
    c = write_jsonl(tmp_path / "c.jsonl", numbered_rows("c", 200))
    sources = [Src(a, weight=3), SimpleNamespace(name=b, path=None, weight=1, split="train"),
               Src("json", path=c, weight=1)]
    first = load_prompts(sources, 50, 0.1, seed=7)
    assert first == load_prompts(sources, 50, 0.1, seed=7)
    assert len(first) == 50 and len({p.id for p in first}) == 50
    # 50 * 3/5 = 30, 50 * 1/5 = 10, 10
    assert Counter(p.source for p in first) == {"a": 30, "b": 10, "c": 10}
    # rounding is fixed so the total is exact: 10 * (1/3, 1/3, 1/3) -> 4, 3, 3
    counts = Counter(p.source for p in load_prompts([Src(a), Src(b), Src(c)], 10, 0.1, 7))
    assert sorted(counts.values()) == [3, 3, 4] and sum(counts.values()) == 10
    # shuffled: sources are interleaved, not in blocks
    assert [p.source for p in first[:30]] != ["a"] * 30
    # another seed: another split/selection/order
    assert load_prompts(sources, 50, 0.1, seed=8) != first


def test_short_source_warns_and_gives_what_it_has(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered_rows("a", 100))
    small = write_jsonl(tmp_path / "small.jsonl", numbered_rows("s", 5))
    with pytest.warns(UserWarning, match="'.*small.jsonl' has only 5 train prompts"):
        got = load_prompts([Src(a), Src(small)], 40, 0.0, 0)
    assert Counter(p.source for p in got) == {"a": 20, "small": 5}


def test_short_source_is_refused_unless_allow_fewer(tmp_path):
    """What a recipe (data.allow_fewer: false, the default) gets: an error naming every short source and the fix,
    instead of silently training on a fraction of what it asked for."""
    a = write_jsonl(tmp_path / "a.jsonl", numbered_rows("a", 100))
    small = write_jsonl(tmp_path / "small.jsonl", numbered_rows("s", 5))
    with pytest.raises(ValueError, match=r"asked for 40 prompts, but '.*small\.jsonl' holds 5 train prompts for its "
                                         r"share of 20.*data\.allow_fewer: true"):
        load_prompts([Src(a), Src(small)], 40, 0.0, 0, allow_fewer=False)
    assert len(load_prompts([Src(a), Src(small)], 10, 0.0, 0, allow_fewer=False)) == 10  # enough: no error


def test_holdout_is_disjoint_and_stable(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", numbered_rows("a", 400))
    b = write_jsonl(tmp_path / "b.jsonl", numbered_rows("b", 400))
    sources = [Src(a), Src(b)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_all = {p.id for p in load_prompts(sources, 10_000, 0.2, 3)}
        held_all = {p.id for p in load_prompts(sources, 10_000, 0.2, 3, split="holdout")}
    assert train_all and held_all and not train_all & held_all
    assert len(train_all) + len(held_all) == 800
    assert 0.12 < len(held_all) / 800 < 0.28
    assert held_all == {p.id for p in load_source(a) + load_source(b) if is_holdout(p.id, 0.2, 3)}
    # Held-out membership does not depend on num_prompts, on other sources, or on order.
    small_train = {p.id for p in load_prompts(sources, 30, 0.2, 3)}
    assert small_train <= train_all
    held_small = {p.id for p in load_prompts(sources, 20, 0.2, 3, split="holdout")}
    held_big = {p.id for p in load_prompts(sources, 100, 0.2, 3, split="holdout")}
    assert held_small <= held_big <= held_all
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        held_a_alone = {p.id for p in load_prompts([Src(a)], 10_000, 0.2, 3, split="holdout")}
        held_reversed = {p.id for p in load_prompts([Src(b), Src(a)], 10_000, 0.2, 3, split="holdout")}
    assert held_a_alone == {i for i in held_all if i.startswith("a:")}
    assert held_reversed == held_all


def test_split_hash_is_stable_across_runs():
    # Golden values: membership must not change between processes or versions (no salted hash()).
    ids = ["a:0", "a:1", "a:2", "a:3", "a:4", "a:5", "sharegpt:QWJhYvA_0", "humaneval:HumanEval/0"]
    assert [is_holdout(i, 0.5, 0) for i in ids] == [True, False, True, False, True, True, False, False]
    assert [is_holdout(i, 0.5, 1) for i in ids] == [False, True, True, False, True, True, True, True]
    assert not any(is_holdout(i, 0.0, 0) for i in ids) and all(is_holdout(i, 1.0, 0) for i in ids)


def test_sharegpt_split_does_not_depend_on_read_limit():
    small = load_prompts([Src("sharegpt")], 10, 0.05, 0, split="holdout")
    big = load_prompts([Src("sharegpt")], 60, 0.05, 0, split="holdout")
    assert len(small) == 10 and len(big) == 60
    assert {p.id for p in small} <= {p.id for p in big}
    assert all(is_holdout(p.id, 0.05, 0) for p in big)
    train = load_prompts([Src("sharegpt")], 200, 0.05, 0)
    assert not {p.id for p in train} & {p.id for p in big}
    assert eval_prompts("sharegpt", 10, 0, holdout_fraction=0.05) == small


def test_mix_named_sources():
    got = load_prompts([Src("humaneval", weight=1), Src("mtbench", weight=1), Src("sharegpt", weight=2)], 40, 0.1, 1)
    assert Counter(p.source for p in got) == {"humaneval": 10, "mtbench": 10, "sharegpt": 20}
    assert all(isinstance(p, Prompt) for p in got)


def test_eval_prompts_benchmarks():
    picked = eval_prompts("mtbench", 12, seed=5)
    assert len(picked) == 12 and picked == eval_prompts("mtbench", 12, seed=5)
    assert picked != eval_prompts("mtbench", 12, seed=6)
    assert len(eval_prompts("humaneval", None, 0)) == 164


def test_eval_prompts_trained_on_are_found_by_what_they_say_left_out_and_counted(tmp_path, drill):
    """Round 5, bug 2: the check compared names and paths. Now each eval prompt's first turn (what the eval decodes)
    is held against every conversation training answers under the loader's dedup key, whatever file it came from."""
    from eval.run import EvalDecode, TrainedPromptsError, eval_set

    drill("bad-input", "an eval file whose prompts training answered, under another name and spacing")
    trained = [Prompt(f"t:{i}", (f"Question {i}: what is {i} + {i}?", f"And {i} times {i}?")) for i in range(3)]
    rows = [{"turns": [f"Question  {i}:  what is {i} + {i}?"]} for i in range(6)]  # other spacing, another file
    rows.append({"turns": ["And 0 times 0?"]})  # a second turn alone: training never answered it first
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = trained_keys(trained, max_turns=2)
    decode = EvalDecode(draft="", target_name="", dataset=str(path), num_samples=0, max_new_tokens=0, trained=keys)
    prompts, overlap = eval_set(decode)
    assert overlap == {"found": 3, "of": 7, "kept": False, "ids": ["eval:0", "eval:1", "eval:2"]}
    assert [p.turns[0] for p in prompts] == [r["turns"][0] for r in rows[3:]]
    kept, overlap = eval_set(dataclasses.replace(decode, keep_trained=True))
    assert len(kept) == 7 and overlap["found"] == 3 and overlap["kept"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    with pytest.raises(TrainedPromptsError, match="all 3 eval prompts are training prompts"):
        eval_set(decode)
    assert split_trained(load_source(str(path)), frozenset())[1] == []


def test_the_default_recipes_eval_holds_no_training_prompt():
    """The default's eval set against the 1,280 prompts it trains on, by content (issue 56's must-show): none."""
    from core.recipe import load_recipe
    from eval.run import EvalDecode, eval_set, recipe_trained_keys

    recipe = load_recipe("dspark_smollm2_135m")
    prompts, overlap = eval_set(EvalDecode(
        draft="", target_name="", dataset=recipe.eval.dataset, num_samples=recipe.eval.num_samples,
        max_new_tokens=0, seed=recipe.seed, trained=recipe_trained_keys(recipe)))
    assert overlap["found"] == 0 and overlap["of"] == len(prompts) == recipe.eval.num_samples
