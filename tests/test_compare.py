"""eval/compare.py and the oracle chooser of eval/replay.py, on records whose taus are known by hand: where each
record comes from, the per-source and copy-heavy / rest tables against the n-gram drafter with their paired
intervals, and the per-round choice between prompt lookup's proposal and the drafter's."""

import random

import pytest
import torch

from eval.compare import (COPY_HEAVY_TAU, format_ratio, paired_ratio, record_groups, record_source, source_rows,
                          source_table, subset_tau)
from eval.lookup import lookup_matches
from eval.replay import accepted_prefix, oracle_matches, replay_records
from train.rollout import replay_rounds


def test_record_source_reads_the_source_inside_a_prompt_files_ids():
    assert record_source("mtbench:81") == "mtbench"
    assert record_source("humaneval:HumanEval/107") == "humaneval"
    # quality.py's eval_prompts.jsonl rows carry the benchmarks' ids; the file source prefixes its own name
    assert record_source("eval_prompts:gsm8k:447") == "gsm8k"
    assert record_source("eval_prompts:humaneval:HumanEval/107") == "humaneval"
    assert record_source("prompts:7") == "prompts"  # a plain prompt file is its own source
    assert record_source("prompts:a:b") == "prompts"  # a raw id with a colon does not make a source
    assert record_source("7") == ""


# Five records: draft and n-gram tallies (tokens, rounds) chosen so every tau is a round number.
SOURCES = ["mtbench", "humaneval", "mtbench", "humaneval", "gsm8k"]
DRAFT = {"per_record_tokens": [30, 20, 15, 40, 12], "per_record_rounds": [20, 10, 10, 20, 6]}  # 1.5 2 1.5 2 2
NGRAM = {"per_record_tokens": [20, 30, 15, 80, 12], "per_record_rounds": [20, 10, 10, 20, 8]}  # 1 3 1.5 4 1.5


def test_groups_split_by_source_and_by_lookups_own_tau():
    groups = record_groups(SOURCES, NGRAM)
    assert COPY_HEAVY_TAU == 2.5
    assert groups == {"gsm8k": [4], "humaneval": [1, 3], "mtbench": [0, 2],
                      "copy-heavy (n-gram tau > 2.5)": [1, 3], "rest": [0, 2, 4], "all": [0, 1, 2, 3, 4]}


def test_source_rows_by_hand():
    rows = {r["group"]: r for r in source_rows(DRAFT, NGRAM, SOURCES)}
    mt, he, heavy, rest, everything = (rows[k] for k in ("mtbench", "humaneval", "copy-heavy (n-gram tau > 2.5)",
                                                         "rest", "all"))
    assert (mt["records"], mt["tau"], mt["ngram_tau"]) == (2, pytest.approx(45 / 30), pytest.approx(35 / 30))
    assert mt["ratio"] == pytest.approx(45 / 35) and mt["wins"] == 1  # record 0 wins, record 2 ties
    assert he["tau"] == pytest.approx(60 / 30) and he["ngram_tau"] == pytest.approx(110 / 30) and he["wins"] == 0
    assert heavy["records"] == 2 and heavy["ratio"] == pytest.approx(60 / 110)
    assert rest["tau"] == pytest.approx(57 / 36) and rest["ngram_tau"] == pytest.approx(47 / 38)
    assert everything["tau"] == pytest.approx(117 / 66) and everything["ngram_tau"] == pytest.approx(157 / 68)
    assert everything["wins"] == 2 and "oracle_tau" not in everything
    # the paired interval comes from resampling the group's own records: inside it the group's ratio
    assert mt["low"] <= mt["ratio"] <= mt["high"] and heavy["high"] < 1.0 < rest["low"]
    assert rows["gsm8k"]["low"] == rows["gsm8k"]["high"] == pytest.approx(4 / 3)  # one record: nothing to resample
    # the overall row's interval is the plain paired bootstrap of all records
    assert (everything["ratio"], everything["low"], everything["high"]) == pytest.approx(paired_ratio(DRAFT, NGRAM))


def test_whole_set_bootstrap_is_the_one_quality_py_printed():
    """The interval over all records draws exactly the resamples the former benchmarks/quality.paired_ratio drew
    (random.Random(0), one randrange a record a resample), so saved figures reprint unchanged."""
    rng, count, draws = random.Random(0), 5, []
    for _ in range(2000):
        picks = [rng.randrange(count) for _ in range(count)]
        draws.append(subset_tau(DRAFT, picks) / subset_tau(NGRAM, picks))
    draws.sort()
    assert paired_ratio(DRAFT, NGRAM)[1:] == (draws[100], draws[1899])


def test_source_table_prints_the_oracle_column_where_there_is_one():
    oracle = {"per_record_tokens": [40, 30, 20, 80, 14], "per_record_rounds": [20, 10, 10, 20, 6]}
    rows = source_rows(DRAFT, NGRAM, SOURCES, oracle)
    table = source_table(rows)
    assert table[0].endswith("| wins | oracle chooser tau |")
    everything = rows[-1]
    assert everything["oracle_tau"] == pytest.approx(184 / 66)
    assert table[-1] == (f"| all | 5 | {117 / 66:.3f} | {157 / 68:.3f} | "
                         f"{format_ratio(everything['ratio'], everything['low'], everything['high'])} | 2 | "
                         f"{184 / 66:.3f} |")
    assert "oracle" not in source_table(source_rows(DRAFT, NGRAM, SOURCES))[0]
    with pytest.raises(ValueError, match="not of the same records"):
        source_rows(DRAFT, NGRAM, SOURCES[:4])


def _rows(*prefixes, width=3):
    """A match matrix from one string a position: 'TFT' -> [True, False, True]; '' -> all False."""
    out = torch.zeros(len(prefixes), width, dtype=torch.bool)
    for a, text in enumerate(prefixes):
        for j, c in enumerate(text):
            out[a, j] = c == "T"
    return out


def test_oracle_chooser_by_hand():
    """gamma 3, answer positions 1..12 (first pending 0, end 13). Each round the chooser verifies the proposal with
    the longer accepted prefix, and the round advances by it:
      a=0: draft TFT (prefix 1, two matches), lookup TTF (2) -> lookup, 2 accepted, a=3
      a=3: draft TTT (3), lookup FTT (0)                      -> draft, 3 accepted, a=7
      a=7: draft FFF (0), lookup TFF (1)                      -> lookup, 1 accepted, a=9
      a=9: both TTF (2)                                        -> 2 accepted, a=12: done
    rounds 2 / 3 / 1 / 2: tau (3 + 4 + 2 + 3) / 4 = 3.0, against the draft's 2.0 and lookup's 12 / 7 alone."""
    draft = _rows("TFT", "", "", "TTT", "", "", "", "FFF", "", "TTF", "", "", "")
    lookup = _rows("TTF", "", "", "FTT", "", "", "", "TFF", "", "TTF", "", "", "")
    assert accepted_prefix(draft).tolist()[:4] == [1, 0, 0, 3]  # the leading run, not the count of matches
    chosen = replay_rounds(oracle_matches(draft, lookup), 0, 13, 3)
    assert [(r.pending, r.accepted) for r in chosen] == [(0, 2), (3, 3), (7, 1), (9, 2)]
    tau = lambda rounds: sum(r.accepted + 1 for r in rounds) / len(rounds)  # noqa: E731
    assert tau(chosen) == 3.0
    assert tau(replay_rounds(draft, 0, 13, 3)) == 2.0
    assert tau(replay_rounds(lookup, 0, 13, 3)) == pytest.approx(12 / 7)


def test_replay_records_reports_the_oracle_chooser(monkeypatch):
    """replay_records pairs the drafter's matches with prompt lookup's on the same record: a drafter that never
    matches leaves the chooser lookup's rounds, one that always matches its own; prompt lookup itself has none."""
    import eval.replay as replay
    from eval.lookup import NgramDrafter

    ids = torch.tensor([5, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 9, 1, 2])
    record = {"input_ids": ids, "loss_mask": torch.tensor([0] * 4 + [1] * 10)}
    lookup = replay_records(NgramDrafter(), [record], 3)
    assert "oracle" not in lookup and lookup["accept_len"] > 1.0
    assert lookup_matches(ids.tolist(), 3)[3:].any()  # lookup has something to offer here
    for fill, expected in ((False, lookup), (True, None)):
        monkeypatch.setattr(replay, "draft_matches", lambda model, rec, gamma: torch.full((len(ids), gamma), fill))
        report = replay_records(None, [record], 3)
        oracle = report["oracle"]
        expected = expected or report
        assert oracle["per_record_tokens"] == expected["per_record_tokens"]
        assert oracle["per_record_rounds"] == expected["per_record_rounds"]
        assert oracle["replayed_tau"] == pytest.approx(expected["accept_len"])
        assert oracle["replayed_tau"] >= max(report["accept_len"], lookup["accept_len"])


SETTINGS = {"target": "smollm2-135m-instruct", "temperature": 0.0, "max_new_tokens": 64, "block_size": 7}


def _report(folder, tallied: dict, ids=None, **settings):
    """An eval.py report folder holding `tallied`'s records as samples (ids and sources as SOURCES), made with
    SETTINGS but for `settings`."""
    import json

    folder.mkdir(parents=True)
    ids = ids or [f"heldout:{s}:{i}" for i, s in enumerate(SOURCES)]
    samples = [{"id": pid, "source": s, "round_tokens": t, "rounds": r} for pid, s, t, r in
               zip(ids, SOURCES, tallied["per_record_tokens"], tallied["per_record_rounds"])]
    (folder / "report.json").write_text(json.dumps({**SETTINGS, **settings, "samples": samples}))
    return folder


def _refusal(capsys, *argv) -> str:
    """`python -m eval.compare argv`'s refusal: exit code 2, and the message."""
    from eval.compare import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main([str(a) for a in argv])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_two_eval_reports_compare_per_source_with_the_first_ones_lookup_naming_the_copy_heavy(tmp_path, capsys):
    """`python -m eval.compare A B`: A's draft over B's on the same prompts; the copy-heavy rows are those where A's
    own n-gram run (A/ngram) is above 2.5, not where B's draft is."""
    from eval.compare import main

    first = _report(tmp_path / "a", DRAFT)
    _report(first / "ngram", NGRAM)
    second = _report(tmp_path / "b", {"per_record_tokens": [20, 20, 15, 40, 12], "per_record_rounds": [10] * 5})
    assert main([str(first), str(second)]) == 0
    table = capsys.readouterr().out
    assert "| tau | b tau | tau / b (90% paired bootstrap) |" in table
    assert "| copy-heavy (n-gram tau > 2.5) | 2 | 2.000 | 3.000 | 0.667" in table  # records 1 and 3: 60/30 vs 60/20
    assert "| mtbench | 2 | 1.500 | 1.750 | 0.857" in table
    other = _report(tmp_path / "c", DRAFT, ids=[f"x:{i}" for i in range(5)])
    assert "ran other prompts" in _refusal(capsys, first, other)
    assert "--ngram-baseline" in _refusal(capsys, second, first)


@pytest.mark.parametrize("key,value,flag", [("temperature", 1.0, "--temperature"),
                                            ("max_new_tokens", 256, "--max-new-tokens"),
                                            ("block_size", 15, "--block-size"),
                                            ("target", "HuggingFaceTB/SmolLM2-360M-Instruct", "--target")])
def test_reports_of_other_settings_are_not_paired(tmp_path, capsys, drill, key, value, flag):
    """Same prompts, another temperature, token limit, gamma or target: tau moves with each, so the ratio would
    measure the setting, not the drafters. Refused naming both files, the setting, both values and the flag."""
    drill("bad-input", f"eval.compare of reports with other {key}")
    first = _report(tmp_path / "a", DRAFT)
    _report(first / "ngram", NGRAM)
    second = _report(tmp_path / "b", DRAFT, **{key: value})
    err = _refusal(capsys, first, second)
    assert f"{first} has {key} {SETTINGS[key]!r} and {second} {value!r}" in err and flag in err, err
    # the first report's own n-gram run is checked too (a planted or stale one)
    (first / "ngram" / "report.json").unlink()
    (first / "ngram").rmdir()
    _report(first / "ngram", NGRAM, **{key: value})
    assert f"{first} has {key} {SETTINGS[key]!r} and {first / 'ngram'} {value!r}" in _refusal(capsys, first, first)


@pytest.mark.parametrize("content,fragment", [
    ("{not json", "is not an eval report (unreadable JSON"),
    ("[1, 2]", "is not an eval report (it lacks some of target, temperature"),
    ('{"samples": []}', "is not an eval report (it lacks some of"),
    ({**SETTINGS, "samples": []}, "holds no samples to pair"),
    ({**SETTINGS, "samples": {"a": 1}}, "holds no samples to pair"),
    ({**SETTINGS, "samples": [{"id": "mtbench:1", "source": "mtbench", "accept_len": 2.0}]},
     "samples[0] lacks its prompt id, source or round counts"),
    ({**SETTINGS, "samples": [{"id": "mtbench:1", "source": "mtbench", "round_tokens": "9", "rounds": 3}]},
     "samples[0] lacks"),
], ids=["not-json", "a-list", "no-settings", "no-samples", "samples-not-a-list", "no-round-counts", "string-count"])
def test_malformed_or_sample_less_report_is_refused_naming_the_file(tmp_path, capsys, drill, content, fragment):
    import json

    drill("bad-input", f"eval.compare of a malformed report.json ({fragment})")
    first = _report(tmp_path / "a", DRAFT)
    _report(first / "ngram", NGRAM)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "report.json").write_text(content if isinstance(content, str) else json.dumps(content))
    for argv in ((first, bad), (bad, first)):
        err = _refusal(capsys, *argv)
        assert f"{bad / 'report.json'}" in err and fragment in err, err


def test_headlines_pair_as_served_and_token_maps_beside_them(tmp_path, capsys, drill):
    """Reports of drafts with token maps headline the whole vocabulary (as served) and carry the map's samples: the
    headlines are paired, then the maps. A report from before, whose headline drafted with its map, is refused
    beside one that drafted over the whole vocabulary."""
    from eval.compare import main

    drill("bad-input", "eval.compare of a token-map headline against a served one")
    mapped = {"samples": [{"id": f"heldout:{s}:{i}", "source": s, "round_tokens": 10, "rounds": 10}
                          for i, s in enumerate(SOURCES)]}
    first = _report(tmp_path / "a", DRAFT, draft_vocab_size=None, token_map=mapped)
    _report(first / "ngram", NGRAM)
    second = _report(tmp_path / "b", NGRAM, draft_vocab_size=None, token_map=mapped)
    assert main([str(first), str(second)]) == 0
    out = capsys.readouterr().out
    served, maps = out.split("With their token maps")
    assert "| all | 5 | 1.773 | 2.309 |" in served and "| all | 5 | 1.000 | 1.000 | 1.000" in maps
    old = _report(tmp_path / "old", DRAFT, draft_vocab_size=8192)
    err = _refusal(capsys, first, old)
    assert "headline drafted among all tokens" in err and "among 8192" in err and "rerun" in err


def _mapped_report(edit) -> dict:
    """A well-formed report of DRAFT with a token map (its samples the headline's prompts, tau 1), edited by `edit`."""
    samples = [{"id": f"heldout:{s}:{i}", "source": s, "round_tokens": t, "rounds": r} for i, (s, t, r) in
               enumerate(zip(SOURCES, DRAFT["per_record_tokens"], DRAFT["per_record_rounds"]))]
    report = {**SETTINGS, "samples": samples, "token_map": {"samples": [{**s, "round_tokens": 10, "rounds": 10}
                                                                        for s in samples]}}
    edit(report)
    return report


@pytest.mark.parametrize("edit,fragment", [
    (lambda r: r.update(token_map=None), "token_map is NoneType"),
    (lambda r: r.update(token_map="x"), "token_map is str"),
    (lambda r: r["token_map"].update(samples=[{"x": 1}]), "token_map.samples[0] lacks"),
    (lambda r: [s.update(rounds=0) for s in r["token_map"]["samples"]], "token_map.samples[0] lacks"),
    (lambda r: [s.update(round_tokens=1, rounds=50) for s in r["samples"]],
     "samples[0] has round_tokens 1 over rounds 50, outside"),  # tau 0.02: a round gives at least one token
    (lambda r: r["token_map"]["samples"][0].update(round_tokens=1e30), "token_map.samples[0] lacks"),
    (lambda r: r["token_map"]["samples"][0].update(round_tokens=10 ** 30), "token_map.samples[0] has round_tokens"),
    (lambda r: r["samples"][0].update(round_tokens=161), "(block_size 7 + 1)"),  # 20 rounds give at most 160
    (lambda r: r["token_map"]["samples"].append(r["token_map"]["samples"][0]), "token_map.samples are not the prompts"),
    (lambda r: r["samples"].append(r["samples"][0]), "samples name a prompt twice"),
    (lambda r: r.update(temperature=float("nan")), "temperature nan"),
    (lambda r: r.update(block_size=0), "block_size 0"),
    (lambda r: r["samples"][0].update(source="zzz"), "samples[0] has source 'zzz'"),
], ids=["null-map", "string-map", "malformed-map", "rounds-0", "tau-below-1", "float-1e30", "int-1e30",
        "tau-above-gamma", "more-map-samples", "duplicated-samples", "nan-temperature", "block-size-0",
        "other-source"])
def test_impossible_reports_are_refused_naming_the_file(tmp_path, capsys, drill, edit, fragment):
    """Reports no eval.py run writes (round 5, M1-M10, M16): a null, string or malformed token map, rounds 0, tau
    below 1 or above gamma + 1, counts of 1e30, a NaN temperature, another source for the same prompt. Each is
    refused with exit code 2 naming the edited file, in either position, never a traceback or a table of them."""
    import json

    drill("bad-input", f"eval.compare of an impossible report ({fragment})")
    first = _report(tmp_path / "a", DRAFT)
    _report(first / "ngram", NGRAM)
    bad = tmp_path / "bad"
    _report(bad / "ngram", NGRAM)
    (bad / "report.json").write_text(json.dumps(_mapped_report(edit)))
    for argv in ((first, bad), (bad, first)):
        err = _refusal(capsys, *argv)
        assert str(bad) in err and fragment in err, err
    good = tmp_path / "good"
    good.mkdir()
    (good / "report.json").write_text(json.dumps(_mapped_report(lambda r: None)))
    from eval.compare import main
    assert main([str(first), str(good)]) == 0  # the unedited report pairs
