"""Two drafters on the same prompts: the ratio of their taus with a paired 90% bootstrap interval, overall, per prompt
source and for a copy-heavy / rest split. One home for the eval report's (eval/report.py: the draft against the
n-gram drafter in the real loop) and the benchmarks' (benchmarks/quality.py: replayed drafts against replayed prompt
lookup).

A tally is one drafter's {"per_record_tokens": [...], "per_record_rounds": [...]}, record by record in the same order
for every drafter compared: the tokens its rounds gave (accepted drafts + 1 each) and its rounds, so that tau over any
subset of the records is a sum over a sum, and a resample of the records gives both drafters' taus on the same
prompts. A curve point of quality.py is a tally with its `replayed_tau`.

    rows = source_rows(draft, ngram, [record_source(i) for i in ids], oracle=chooser)  # -> source_table(rows)

Two eval reports of the same prompts (eval.py --out A, --out B; e.g. two recipes' drafts), the first over the second,
made with the same target, temperature, token limit and gamma (PAIRED_SETTINGS; others are refused); the headlines
(as served, over the whole vocabulary), then, where both drafts have a token map, their figures with it:

    python -m eval.compare runs/eval-a runs/eval-b
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

from data.sources.registry import BUILTIN_SOURCES

#: a record is copy-heavy where prompt lookup's own tau on it is above this (issue 39: six of the 36 held-out
#: prompts, 30% of lookup's accepted drafts)
COPY_HEAVY_TAU = 2.5
RESAMPLES = 2000


def record_source(prompt_id: str) -> str:
    """The prompt source an eval record came from, read from its prompt id (`f"{source}:{raw id}"`,
    data/sources/registry.py).
    A prompt file whose rows carry such ids (quality.py's eval_prompts.jsonl) prefixes its own name: the built-in
    source inside it wins, so "eval_prompts:mtbench:81" is MT-bench's, "prompts:7" the file `prompts`'s."""
    prefixes = prompt_id.split(":")[:-1]
    return next((p for p in prefixes if p in BUILTIN_SOURCES), prefixes[0] if prefixes else "")


def tally(samples: list[dict]) -> dict:
    """The tally of eval/arms.py's per-prompt samples (each with its `round_tokens` and `rounds`)."""
    return {"per_record_tokens": [s["round_tokens"] for s in samples],
            "per_record_rounds": [s["rounds"] for s in samples]}


def speed_tally(samples: list[dict]) -> dict:
    """The same shape for decode speed (eval/arms.py samples: each prompt's tokens and decode seconds): subset_tau is
    then tokens per second over the records picked, so paired_ratio and source_rows pair two drafters' speeds on the
    same prompts (both timed beside the same plain decodes, eval/arms.py)."""
    return {"per_record_tokens": [s["tokens"] for s in samples], "per_record_rounds": [s["decode_s"] for s in samples]}


def subset_tau(point: dict, picks) -> float:
    """tau over the records `picks` (indices, repeats allowed): their tokens over their rounds."""
    rounds = sum(point["per_record_rounds"][i] for i in picks)
    return sum(point["per_record_tokens"][i] for i in picks) / rounds if rounds else float("nan")


def record_taus(point: dict) -> list[float]:
    return [subset_tau(point, [i]) for i in range(len(point["per_record_rounds"]))]


def paired_ratio(a: dict, b: dict, picks=None, resamples: int = RESAMPLES) -> tuple[float, float | None, float | None]:
    """tau of `a` over tau of `b` on the records `picks` (None: all), and a 90% interval from a paired bootstrap over
    those records (both taus recomputed on each resample of the same records): an interval that holds 1 is a
    difference the prompts do not resolve. Points without per-record tallies (results saved before they were kept)
    give the ratio of their `replayed_tau` and no interval."""
    if "per_record_rounds" not in a or "per_record_rounds" not in b:
        return a["replayed_tau"] / b["replayed_tau"], None, None
    picks = list(range(len(a["per_record_rounds"]))) if picks is None else list(picks)
    rng, count = random.Random(0), len(picks)
    draws = sorted(subset_tau(a, sample) / subset_tau(b, sample) for sample in (
        [picks[rng.randrange(count)] for _ in range(count)] for _ in range(resamples)))
    return subset_tau(a, picks) / subset_tau(b, picks), draws[int(0.05 * resamples)], draws[int(0.95 * resamples) - 1]


def format_ratio(value: float, low: float | None, high: float | None) -> str:
    """paired_ratio's result as printed: the ratio, and its interval where there is one."""
    return f"{value:.3f}" + (f" [{low:.3f}, {high:.3f}]" if low is not None else "")


def record_groups(sources: list[str], lookup: dict) -> dict[str, list[int]]:
    """The record indices of each source (sorted by name), of the copy-heavy records (prompt lookup's tau on the
    record > COPY_HEAVY_TAU), of the rest, and of all."""
    groups = {name: [i for i, s in enumerate(sources) if s == name] for name in sorted(set(sources))}
    heavy = [tau > COPY_HEAVY_TAU for tau in record_taus(lookup)]
    groups[f"copy-heavy (n-gram tau > {COPY_HEAVY_TAU})"] = [i for i, h in enumerate(heavy) if h]
    groups["rest"] = [i for i, h in enumerate(heavy) if not h]
    groups["all"] = list(range(len(sources)))
    return groups


def source_rows(draft: dict, ngram: dict, sources: list[str], oracle: dict | None = None,
                lookup: dict | None = None) -> list[dict]:
    """One row per record_groups group with records: the draft's and n-gram's tau there, the ratio with its paired
    interval, how many records the draft wins (higher tau than n-gram's on the record), and the tau of a per-round
    oracle chooser between the two (eval/replay.py) where its tally is given. `ngram` may be another drafter's tally;
    the copy-heavy split then reads prompt lookup's own (`lookup`)."""
    if not len(sources) == len(draft["per_record_rounds"]) == len(ngram["per_record_rounds"]):
        raise ValueError(f"{len(sources)} sources for {len(draft['per_record_rounds'])} and "
                         f"{len(ngram['per_record_rounds'])} records: the tallies are not of the same records")
    rows = []
    mine, theirs = record_taus(draft), record_taus(ngram)
    for group, picks in record_groups(sources, ngram if lookup is None else lookup).items():
        if not picks:
            continue
        ratio, low, high = paired_ratio(draft, ngram, picks)
        rows.append({"group": group, "records": len(picks), "tau": subset_tau(draft, picks),
                     "ngram_tau": subset_tau(ngram, picks), "ratio": ratio, "low": low, "high": high,
                     "wins": sum(mine[i] > theirs[i] for i in picks)}
                    | ({"oracle_tau": subset_tau(oracle, picks)} if oracle is not None else {}))
    return rows


def source_table(rows: list[dict], other: str = "n-gram", quantity: str = "tau") -> list[str]:
    """source_rows as a markdown table (the oracle chooser's column where the rows have it); `other` names the
    drafter the ratios are against, `quantity` what the tallies sum to (tau; "tok/s" for speed_tally's)."""
    oracle = all("oracle_tau" in r for r in rows)
    q, digits = quantity, 3 if quantity == "tau" else 1
    lines = [f"| prompts | n | {q} | {other} {q} | {q} / {other} (90% paired bootstrap) | wins |"
             + (" oracle chooser tau |" if oracle else ""), "|---|---|---|---|---|---|" + ("---|" if oracle else "")]
    for r in rows:
        lines.append(f"| {r['group']} | {r['records']} | {r['tau']:.{digits}f} | {r['ngram_tau']:.{digits}f} | "
                     f"{format_ratio(r['ratio'], r['low'], r['high'])} | {r['wins']} |"
                     + (f" {r['oracle_tau']:.3f} |" if oracle else ""))
    return lines


#: what a report's tau depends on besides the drafter and the prompts: a pair differing in one compares the settings,
#: not the drafters (a longer answer or another temperature moves tau; so does gamma, its ceiling)
PAIRED_SETTINGS = {"target": "--target", "temperature": "--temperature", "max_new_tokens": "--max-new-tokens",
                   "block_size": "--block-size"}


#: what eval.py writes for the numeric settings a pair shares (a NaN never equals itself; gamma bounds each round)
SETTING_CHECKS = {"temperature": lambda v: type(v) in (int, float) and math.isfinite(v) and v >= 0,
                  "max_new_tokens": lambda v: type(v) is int and v > 0,
                  "block_size": lambda v: type(v) is int and v > 0}


class CompareError(ValueError):
    """Two reports that cannot be paired, or a file that is not an eval report (main answers with exit code 2)."""


def read_report(folder: Path) -> dict:
    """An eval report (eval.py's --out folder or its report.json) whose samples carry what a paired comparison
    reads; CompareError naming the file otherwise."""
    path = folder / "report.json" if folder.is_dir() else folder
    if not path.is_file():
        raise CompareError(f"no eval report at {path} (eval.py --out FOLDER writes FOLDER/report.json)")
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CompareError(f"{path} is not an eval report (unreadable JSON: {err})") from None
    if not isinstance(report, dict) or any(key not in report for key in PAIRED_SETTINGS):
        raise CompareError(f"{path} is not an eval report (it lacks some of {', '.join(PAIRED_SETTINGS)}); "
                           f"rerun eval.py")
    settings = [key for key, valid in SETTING_CHECKS.items() if not valid(report[key])]
    if settings:
        raise CompareError(f"{path}: {', '.join(f'{key} {report[key]!r}' for key in settings)}: not what eval.py "
                           f"writes (a finite temperature >= 0, a positive whole max_new_tokens and block_size); "
                           f"rerun eval.py")
    samples = report.get("samples")
    if not isinstance(samples, list) or not samples:
        raise CompareError(f"{path} holds no samples to pair (an eval report lists one per prompt under "
                           f"'samples'); rerun eval.py")
    _check_samples(path, "samples", samples, report["block_size"])
    if len({s["id"] for s in samples}) < len(samples):
        raise CompareError(f"{path}: samples name a prompt twice (eval.py writes one sample a prompt): rerun eval.py")
    if "token_map" in report:  # its samples are paired as the headline's are: the same prompts, checked the same way
        mapped = report["token_map"]
        if not isinstance(mapped, dict) or not isinstance(mapped.get("samples"), list):
            raise CompareError(f"{path}: token_map is {type(mapped).__name__}, not eval.py's figures with the draft's "
                               f"token map (a section holding 'samples'): rerun eval.py")
        _check_samples(path, "token_map.samples", mapped["samples"], report["block_size"])
        if [s["id"] for s in mapped["samples"]] != [s["id"] for s in samples]:
            raise CompareError(f"{path}: token_map.samples are not the prompts of samples (other ids, another order "
                               f"or count): rerun eval.py")
    return report


def _check_samples(path: Path, field: str, samples: list, gamma: int) -> None:
    """CompareError naming the file and the sample where one lacks its prompt id, source or round counts, or where its
    counts are impossible: a round gives at least the target's own token and at most gamma drafts + 1, so
    rounds <= round_tokens <= rounds * (gamma + 1)."""
    for i, sample in enumerate(samples):
        if not (isinstance(sample, dict) and isinstance(sample.get("id"), str)
                and isinstance(sample.get("source"), str)
                and all(type(sample.get(key)) is int and sample[key] > 0 for key in ("round_tokens", "rounds"))):
            raise CompareError(f"{path}: {field}[{i}] lacks its prompt id, source or round counts (round_tokens, "
                               f"rounds > 0; reports written before eval.py kept them have none): rerun eval.py")
        if not sample["rounds"] <= sample["round_tokens"] <= sample["rounds"] * (gamma + 1):
            raise CompareError(f"{path}: {field}[{i}] has round_tokens {sample['round_tokens']} over rounds "
                               f"{sample['rounds']}, outside [rounds, rounds x (block_size {gamma} + 1)]: no decode "
                               f"gives that (a round yields its target token and at most block_size drafts); "
                               f"rerun eval.py")


def unpaired_setting(first: dict, second: dict, names: tuple[Path, Path]) -> str | None:
    """What makes two reports' taus incomparable prompt by prompt, naming both files and values; None if nothing."""
    if [s["id"] for s in first["samples"]] != [s["id"] for s in second["samples"]]:
        return (f"{names[0]} and {names[1]} ran other prompts (or another order): nothing to pair; run both with the "
                f"same --dataset and --num-samples")
    sources = [[s["source"] for s in report["samples"]] for report in (first, second)]
    if sources[0] != sources[1]:
        i = next(i for i, (a, b) in enumerate(zip(*sources)) if a != b)
        return (f"{names[0]}'s samples[{i}] has source {sources[0][i]!r} and {names[1]}'s samples[{i}] has source "
                f"{sources[1][i]!r}, for the same prompt: one report was edited; rerun eval.py for it")
    for key, flag in PAIRED_SETTINGS.items():
        if first[key] != second[key]:
            return (f"{names[0]} has {key} {first[key]!r} and {names[1]} {second[key]!r}: tau depends on it, so the "
                    f"pair would compare the settings, not the drafters; rerun one with the other's {flag}")
    vocab = [report.get("draft_vocab_size") for report in (first, second)]
    if vocab[0] != vocab[1]:  # an eval from before the served number headlined a draft with its token map
        return (f"{names[0]}'s headline drafted among {vocab[0] or 'all'} tokens and {names[1]}'s among "
                f"{vocab[1] or 'all'}: rerun the eval whose headline used a token map (eval.py now headlines the "
                f"whole vocabulary, as the engines serve it, with the map's figure beside it)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval.compare", description="Two eval reports of the same prompts side by side: tau of the "
        "first over the second with a paired 90%% bootstrap interval, per source, copy-heavy / rest and overall.")
    parser.add_argument("first", type=Path, help="eval.py's --out folder (or its report.json), run with "
                        "--ngram-baseline: its n-gram run names the copy-heavy prompts")
    parser.add_argument("second", type=Path, help="the other eval's folder or report.json, on the same prompts and "
                        "settings (" + ", ".join(PAIRED_SETTINGS.values()) + ")")
    args = parser.parse_args(argv)
    try:
        first, second = read_report(args.first), read_report(args.second)
        lookup_dir = (args.first if args.first.is_dir() else args.first.parent) / "ngram"
        if not (lookup_dir / "report.json").is_file():
            raise CompareError(f"no n-gram run at {lookup_dir}: rerun the first eval with --ngram-baseline (it names "
                               "the copy-heavy prompts)")
        lookup = read_report(lookup_dir)
        problem = (unpaired_setting(first, second, (args.first, args.second))
                   or unpaired_setting(first, lookup, (args.first, lookup_dir)))
        if problem:
            raise CompareError(problem)
    except CompareError as err:
        parser.error(str(err))  # exit code 2
    rows = source_rows(tally(first["samples"]), tally(second["samples"]), [s["source"] for s in first["samples"]],
                       lookup=tally(lookup["samples"]))
    print(f"{args.first} against {args.second}:\n")
    print("\n".join(source_table(rows, other=args.second.name)))
    if all("token_map" in report for report in (first, second)):
        rows = source_rows(tally(first["token_map"]["samples"]), tally(second["token_map"]["samples"]),
                           [s["source"] for s in first["samples"]], lookup=tally(lookup["samples"]))
        print("\nWith their token maps (not served; the table above is the whole vocabulary, as served):\n")
        print("\n".join(source_table(rows, other=args.second.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
