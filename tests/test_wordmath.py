"""The grade-school word-problem source (data/sources/wordmath.py, source `wordmath`): thousands of distinct problems of
every template, the same on every run, whole numbers, and a clear error for a `path` it would ignore. That no
held-out prompt is among a recipe's training prompts is tests/test_code_source.py's no-leak test."""

from __future__ import annotations

import re

import pytest

from data.sources import wordmath
from data.sources.registry import load_source, source_problem


@pytest.fixture(scope="module")
def problems():
    return load_source("wordmath")


def test_wordmath_gives_thousands_of_distinct_problems_of_every_kind(problems, record_property):
    texts = [p.turns[0] for p in problems]
    record_property("figure", f"wordmath: {len(set(texts))} distinct problems of {len(texts)}")
    assert len(problems) == wordmath.COUNT and len(set(texts)) > 0.85 * len(texts)
    assert [p.id for p in problems[:3]] == ["wordmath:0", "wordmath:1", "wordmath:2"]
    assert all(p.source == "wordmath" and len(p.turns) == 1 and p.turns[0].endswith("?") for p in problems)
    # every template is drawn (each one's question is its own), none more than twice its share
    asks = {"change", "pages are left", "have now", "this week", "travel in all", "legs", "earn in", "How old",
            "weeks will it take", "cups of flour", "by bus", "money did", "are left?", "on tickets", "in total",
            "litres"}
    counts = {ask: sum(ask in t for t in texts) for ask in asks}
    assert all(0 < n < 2 * len(texts) / len(wordmath._TEMPLATES) for n in counts.values()), counts


def test_wordmath_is_deterministic_and_a_limit_is_a_prefix(problems):
    assert wordmath.word_problems() == problems
    assert load_source("wordmath", limit=7) == problems[:7]


def test_wordmath_numbers_are_whole_and_plural_where_more_than_one(problems):
    for p in problems:
        assert not re.search(r"\d\.\d", p.turns[0]), p
        assert not re.search(r"\b1 (adults|children|more hours|hours)\b", p.turns[0]), p


def test_wordmath_says_it_reads_no_path():
    assert source_problem("wordmath") is None
    assert "reads no `path`" in source_problem("wordmath", "problems.jsonl")
    with pytest.raises(ValueError, match="reads no `path`"):
        load_source("wordmath", path="problems.jsonl")
