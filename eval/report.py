"""What an eval computes and writes about its decodes: the figures of each drafter's arm (eval/arms.py), the
comparisons with the n-gram drafter, report.json, report.md and accept_rate.png (eval/run.py decodes; this writes).

The report holds:
  * accept_len (tau): mean over rounds of accepted drafts + 1 (bonus/correction token included);
  * accept_rate_at_k: prefix survival, #rounds with >= k accepted / #rounds with >= k proposed;
  * cond_accept_rate_at_k: #rounds with >= k accepted / #rounds with >= k-1 accepted and >= k proposed;
  * mean_verified_drafts: drafts verified a round (gamma, fewer when the drafter proposes fewer or a verify
    schedule admits fewer);
  * verify_rate: sum of accept lengths / sum of (proposal length + 1);
  * exact_match: at T=0 the fraction of samples whose output equals the target's own greedy output (must be 1.0);
  * samples: per prompt its id and source (eval/compare.py record_source), tau, and the tokens and rounds behind it;
  * with the n-gram baseline, `vs_ngram`: tau and tau / n-gram with a paired 90% bootstrap interval per source,
    for the copy-heavy prompts (n-gram tau > 2.5 on the prompt) and the rest, and overall (eval/compare.py), at the
    eval's temperature;
  * spec_tokens_per_s, target_tokens_per_s and their ratio `speedup`;
  * DSpark with a confidence head: ECE/AUROC/Brier per position, STS temperatures fitted on a held-out half of the
    rounds (sts.json, SGLang's format) with ECE before/after, an SPS(B) table of the target (sps_table.json) and the
    confidence scheduler against fixed gamma at several batch sizes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from core.io import atomic_open, atomic_write_json, atomic_write_text, make_dir
from eval.arms import Arm, PlainLoop
from eval.compare import source_rows, source_table, speed_tally, tally


@dataclass(frozen=True, kw_only=True)
class ReportSettings:
    """What an eval measures beside its drafter and writes (eval/run.py EvalDecode says what it decodes).

    out_dir: the report's folder: report.json, report.md, accept_rate.png; ngram/ (the n-gram drafter's report),
    sts.json, sps_table.json and loop_sps_table.json where they are made.
    ngram_baseline: also decode the prompts with the free n-gram drafter, the same way (gamma included), and report
    `ngram_baseline`, `tau_vs_ngram`, `speed_vs_ngram` and `vs_ngram` (per source, copy-heavy / rest and overall,
    each ratio with its paired 90% bootstrap interval): a trained drafter that accepts less is not worth serving.
    hf_generate: also time plain HF `generate` (greedy, batch size 1) on every prompt, the speed users compare with:
    `hf_generate_tokens_per_s`, `speedup_vs_generate` and `hf_generate_match` (its output equals ours).
    scheduler: with a DSpark confidence head, also time the target's SPS table (sps_table.json) and simulate SGLang's
    confidence scheduler against fixed gamma (`scheduler`)."""

    out_dir: Path
    ngram_baseline: bool = False
    hf_generate: bool = False
    scheduler: bool = True


#: what a report keeps of the n-gram drafter's own (its whole report is ngram/report.json)
NGRAM_BASELINE_KEYS = ("accept_len", "accept_rate_at_k", "verify_rate", "exact_match", "spec_tokens_per_s",
                       "target_tokens_per_s", "speedup", "timing")


def acceptance_metrics(rounds, gamma: int) -> dict:
    """tau, prefix-survival and conditional acceptance per position, verify rate, from RoundRecords."""
    survived, proposed, reached = [0] * gamma, [0] * gamma, [0] * gamma
    for r in rounds:
        for k in range(1, gamma + 1):
            if r.proposed >= k:
                proposed[k - 1] += 1
                survived[k - 1] += r.accepted >= k
                reached[k - 1] += r.accepted >= k - 1
    tau = sum(r.accepted + 1 for r in rounds) / max(len(rounds), 1)
    return {
        "accept_len": tau,
        "accept_rate_at_k": [s / p if p else 0.0 for s, p in zip(survived, proposed)],
        "cond_accept_rate_at_k": [s / n if n else 0.0 for s, n in zip(survived, reached)],
        "mean_verified_drafts": sum(r.proposed for r in rounds) / max(len(rounds), 1),
        "verify_rate": sum(r.accepted + 1 for r in rounds) / max(sum(r.proposed + 1 for r in rounds), 1),
        "num_rounds": len(rounds),
    }


def round_timing(rounds, gamma: int, *, spec_decode_s: float, spec_tokens: float, target_decode_s: float,
                 target_tokens: float) -> dict:
    """Where a round's time goes, and how close the loop comes to its limit (prefill excluded on both sides).

    A round is one draft (all of the drafter's work: the context it reads from the newly verified tokens, the
    proposal), one verify of the pending token + the drafts (rollback included), and the rest (bookkeeping). With
    drafting and the rest free, a round would cost one verify and emit tau tokens, so the best this acceptance allows
    is tau * step / verify (`tau_limit_speedup`); a perfect drafter (tau = gamma + 1) gives `limit_speedup`.
    `loop_efficiency` = the measured decode speedup / tau_limit_speedup, i.e. the share of a round spent verifying.
    step: one plain decode step of the same target, measured in the same run."""
    n = len(rounds)
    if not n or not spec_tokens or not target_tokens:
        return {}
    draft_ms = 1e3 * sum(r.draft_s for r in rounds) / n
    verify_ms = 1e3 * sum(r.verify_s for r in rounds) / n
    round_ms = 1e3 * spec_decode_s / n
    step_ms = 1e3 * target_decode_s / target_tokens
    tau = sum(r.accepted + 1 for r in rounds) / n
    decode_speedup = (spec_tokens / spec_decode_s) * step_ms / 1e3
    return {
        "draft_ms": draft_ms, "verify_ms": verify_ms, "other_ms": max(round_ms - draft_ms - verify_ms, 0.0),
        "round_ms": round_ms, "target_step_ms": step_ms, "verify_tokens": gamma + 1,
        "verify_vs_step": verify_ms / step_ms, "draft_vs_verify": draft_ms / verify_ms,
        "decode_speedup": decode_speedup,
        "limit_speedup": (gamma + 1) * step_ms / verify_ms,
        "tau_limit_speedup": tau * step_ms / verify_ms,
        "loop_efficiency": decode_speedup / (tau * step_ms / verify_ms),
    }


def arm_metrics(arm: Arm, gamma: int, plain: PlainLoop, greedy: bool) -> dict:
    """One arm's tau and acceptance, exactness, speed over the plain loop's beside it (eval/arms.py), the time of
    its rounds, and its samples."""
    tokens = sum(x["tokens"] for x in arm.samples)
    spec_rate = tokens / arm.decode_s if arm.decode_s else 0.0
    return {
        **acceptance_metrics(arm.rounds, gamma),
        "exact_match": (sum(x["exact"] for x in arm.samples) / max(len(arm.samples), 1)) if greedy else None,
        "spec_tokens_per_s": spec_rate, "target_tokens_per_s": plain.tokens_per_s,
        # = speed_ratio(samples): the plain loop's totals are those of the arm's own samples
        "speedup": spec_rate / plain.tokens_per_s if plain.tokens_per_s else 0.0,
        "timing": round_timing(arm.rounds, gamma, spec_decode_s=arm.decode_s - arm.prefill_s, spec_tokens=tokens,
                               target_decode_s=plain.decode_s - plain.prefill_s, target_tokens=plain.tokens),
        "samples": arm.samples,
    }


def vs_ngram(samples: list[dict], ngram_samples: list[dict], temperature: float) -> dict:
    """The draft against the n-gram drafter on the same prompts, per source, copy-heavy / rest and overall
    (eval/compare.py source_rows): tau (`rows`) and decode speed (`speed_rows`, both timed beside the same plain
    decodes), keyed by the temperature both ran at."""
    if [s["id"] for s in samples] != [s["id"] for s in ngram_samples]:
        raise ValueError("the n-gram baseline ran other prompts than the draft: nothing to pair")
    sources, lookup = [s["source"] for s in samples], tally(ngram_samples)
    return {"temperature": temperature, "rows": source_rows(tally(samples), lookup, sources),
            "speed_rows": source_rows(speed_tally(samples), speed_tally(ngram_samples), sources, lookup=lookup)}

def drafter_report(base: dict, arm: Arm, plain: PlainLoop, greedy: bool, **about) -> dict:
    """One drafter's report: what ran (`base`: draft, target, prompts, gamma as `block_size`, ...; `about`: this
    drafter's own keys, over base's), its arm's figures and how far a prompt's two plain decodes differ (median)."""
    return {**base, **about, **arm_metrics(arm, base["block_size"], plain, greedy),
            "plain_repeat_spread": statistics.median(plain.spreads) if plain.spreads else 0.0}


def against_ngram(report: dict, ngram: dict, temperature: float) -> None:
    """Adds to `report` (and to its token map's figures) the comparison with the n-gram drafter's report on the same
    prompts: the figures kept of it, tau and speed as ratios of its, per source with intervals (vs_ngram)."""
    report["ngram_baseline"] = {key: ngram[key] for key in NGRAM_BASELINE_KEYS}
    report["tau_vs_ngram"] = report["accept_len"] / ngram["accept_len"]
    report["speed_vs_ngram"] = report["speedup"] / ngram["speedup"] if ngram["speedup"] else 0.0
    report["vs_ngram"] = vs_ngram(report["samples"], ngram["samples"], temperature)
    if "token_map" in report:
        report["token_map"]["tau_vs_ngram"] = report["token_map"]["accept_len"] / ngram["accept_len"]
        report["token_map"]["vs_ngram"] = vs_ngram(report["token_map"]["samples"], ngram["samples"], temperature)


def write_report(report: dict, folder: Path, plot: bool = True) -> None:
    """report.json and report.md (and accept_rate.png with `plot`) in `folder`, made when missing."""
    make_dir(folder)
    atomic_write_json(folder / "report.json", report)
    atomic_write_text(folder / "report.md", report_markdown(report))
    if plot:
        plot_acceptance(report, folder / "accept_rate.png")


def trained_prompts_note(report: dict) -> str:
    """What report_markdown says of the eval prompts found among the training prompts (report `training_prompts`)."""
    t = report.get("training_prompts")
    if t is None:
        return " (not held against the training prompts)"
    if t["kept"]:
        return f"; {t['found']} of the {t['of']} are training prompts, kept (eval.allow_training_prompts)"
    return f"; {t['found']} of the {t['of']} drawn were training prompts (by what they say), left out"


def report_markdown(report: dict) -> str:
    k = len(report["accept_rate_at_k"])
    lines = [f"# Speculative decoding: {report['dataset']}", "",
             f"draft `{report['draft']}`, target `{report['target']}`, T={report['temperature']}, "
             f"gamma={report['block_size']}, {report['num_samples']} prompts{trained_prompts_note(report)}", "",
             "| drafter | tau | exact match | spec tok/s | target tok/s | speedup | verify rate |",
             "|---|---|---|---|---|---|---|",
             *[f"| {name} | {arm['accept_len']:.3f} | {arm['exact_match']} | {arm['spec_tokens_per_s']:.1f} | "
               f"{arm['target_tokens_per_s']:.1f} | {arm['speedup']:.2f}x | {arm['verify_rate']:.3f} |"
               for name, arm in drafter_rows(report)], "",
             "Each prompt was decoded by every drafter above back to back between two plain decodes of it: each "
             "speedup is over the plain loop's tokens/s in the same minutes (a prompt's two plain decodes differ by "
             f"{report.get('plain_repeat_spread', 0.0):.1%}, median).", "",
             "| position | " + " | ".join(str(i + 1) for i in range(k)) + " |",
             "|---|" + "---|" * k,
             "| accept rate (prefix) | " + " | ".join(f"{v:.3f}" for v in report["accept_rate_at_k"]) + " |",
             "| accept rate (conditional) | " + " | ".join(f"{v:.3f}" for v in report["cond_accept_rate_at_k"]) + " |"]
    if report.get("timing"):
        t = report["timing"]
        lines += ["", "## Where a round's time goes (decode only, prefill excluded)", "",
                  "| draft ms | verify ms | other ms | round ms | target step ms | verify / step | draft / verify |",
                  "|---|---|---|---|---|---|---|",
                  f"| {t['draft_ms']:.1f} | {t['verify_ms']:.1f} | {t['other_ms']:.1f} | {t['round_ms']:.1f} | "
                  f"{t['target_step_ms']:.1f} | {t['verify_vs_step']:.2f} | {t['draft_vs_verify']:.2f} |", "",
                  f"Decode speedup {t['decode_speedup']:.2f}x; with free drafting this tau allows "
                  f"{t['tau_limit_speedup']:.2f}x (loop efficiency {t['loop_efficiency']:.0%}); a perfect drafter "
                  f"(tau = {t['verify_tokens']}) {t['limit_speedup']:.2f}x."]
    if "verify_schedule" in report:
        vs = report["verify_schedule"]
        lines += ["", f"Verify schedule `{vs['policy']}`: {report['mean_verified_drafts']:.2f} of up to "
                      f"{report['block_size']} drafts verified a round (STS: {vs['sts'] or 'none, uncalibrated'}); "
                      f"tau and accept rates count the verified drafts only."]
    if "hf_generate_tokens_per_s" in report:
        lines += ["", f"Plain HF `generate` (greedy, batch 1) on the same prompts: {report['hf_generate_tokens_per_s']:.1f} "
                      f"tok/s; speculative decoding is {report['speedup_vs_generate']:.2f}x of it; its output equals the "
                      f"target loop's on {report['hf_generate_match']:.0%} of prompts."]
    if "token_map" in report:
        mapped = report["token_map"]
        lines += ["", f"Served as SGLang and vLLM serve it, over the whole vocabulary: tau {report['accept_len']:.3f}, "
                      f"speedup {report['speedup']:.2f}x (the headline). With its {mapped['draft_vocab_size']}-token "
                      f"map (token_map.pt, which no engine reads): tau {mapped['accept_len']:.3f} "
                      f"({mapped['tau_vs_served']:.3f}x), speedup {mapped['speedup']:.2f}x."]
    if "ngram_baseline" in report:
        ngram = report["ngram_baseline"]
        lines += ["", f"The n-gram drafter on the same prompts: tau {ngram['accept_len']:.3f}, speedup "
                      f"{ngram['speedup']:.2f}x; this draft's tau is {report['tau_vs_ngram']:.2f}x of it, its speed "
                      f"{report['speed_vs_ngram']:.2f}x."]
    if "vs_ngram" in report:
        lines += ["", f"## Against the n-gram drafter per source (T={report['vs_ngram']['temperature']})", "",
                  *source_table(report["vs_ngram"]["rows"])]
        if "speed_rows" in report["vs_ngram"]:
            lines += ["", "Decode speed against the n-gram drafter's, per source (both beside the same plain decodes):",
                      "", *source_table(report["vs_ngram"]["speed_rows"], quantity="tok/s")]
        if "vs_ngram" in report.get("token_map", {}):
            lines += ["", "With its token map (not served) against the n-gram drafter, per source:", "",
                      *source_table(report["token_map"]["vs_ngram"]["rows"])]
    if "speed_by_source" in report:
        names = [name for name, _ in drafter_rows(report)]
        lines += ["", "## Decode speed over the plain loop per source (each beside the plain decodes of its prompts)",
                  "", "| prompts | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
                  *[f"| {group} | " + " | ".join(f"{v:.2f}x" for v in speeds) + " |"
                    for group, speeds in report["speed_by_source"].items()]]
    if "calibration" in report:
        cal = report["calibration"]
        lines += ["", "## Calibration (cumulative confidence vs prefix acceptance)", "",
                  "| position | " + " | ".join(str(i + 1) for i in range(k)) + " |", "|---|" + "---|" * k,
                  "| ECE before STS (held out) | " + " | ".join(_fmt(v) for v in cal["ece_before"]) + " |",
                  "| ECE after STS (held out) | " + " | ".join(_fmt(v) for v in cal["ece_after"]) + " |",
                  "| AUROC | " + " | ".join(_fmt(v) for v in cal["before"]["auroc"]) + " |",
                  "| Brier | " + " | ".join(_fmt(v) for v in cal["before"]["brier"]) + " |",
                  "| STS temperature | " + " | ".join(_fmt(v) for v in cal["sts_temperatures"]) + " |"]
    if "calibration_skipped" in report:
        lines += ["", "## Calibration and scheduler simulation: skipped", "", report["calibration_skipped"]]
    if "scheduler" in report:
        lines += ["", "## Confidence scheduler vs fixed gamma (Theta = tau x SPS(B))", "", report["scheduler"]["table"]]
    return "\n".join(lines) + "\n"


def drafter_rows(report: dict) -> list[tuple[str, dict]]:
    """(name, figures) of each drafter a report measured, the headline first."""
    served = "served (full vocabulary)" if "token_map" in report else "draft"
    rows = [(served, report)]
    if "token_map" in report:
        rows.append((f"with its {report['token_map']['draft_vocab_size']}-token map", report["token_map"]))
    if "ngram_baseline" in report:
        rows.append(("n-gram", report["ngram_baseline"]))
    return rows


def _fmt(value) -> str:
    return "nan" if value is None or value != value else f"{value:.3f}"


def new_plot(size: tuple[float, float]):
    """A figure on the non-interactive backend (servers have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)


def save_plot(fig, ax, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_open(path) as handle:  # a link at `path` is replaced, never written through
        fig.savefig(handle, dpi=120, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)


def plot_acceptance(report: dict, path: Path) -> None:
    positions = list(range(1, len(report["accept_rate_at_k"]) + 1))
    fig, ax = new_plot((6, 3.5))
    ax.plot(positions, report["accept_rate_at_k"], marker="o", label="prefix survival")
    ax.plot(positions, report["cond_accept_rate_at_k"], marker="s", label="conditional")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{report['dataset']}: tau = {report['accept_len']:.2f} (T={report['temperature']})")
    save_plot(fig, ax, path)


def print_summary(report: dict) -> None:
    served = " (served: full vocabulary)" if "token_map" in report else ""
    print(f"[eval] {report['dataset']}: tau {report['accept_len']:.3f}{served}, exact_match {report['exact_match']}, "
          f"speedup {report['speedup']:.2f}x ({report['spec_tokens_per_s']:.1f} vs "
          f"{report['target_tokens_per_s']:.1f} tok/s"
          + (f"; {report['speedup_vs_generate']:.2f}x of HF generate's {report['hf_generate_tokens_per_s']:.1f}"
             if "hf_generate_tokens_per_s" in report else "") + "), accept@k "
          + ", ".join(f"{v:.2f}" for v in report["accept_rate_at_k"])
          + (f"; {report['mean_verified_drafts']:.2f} drafts verified a round "
             f"({report['verify_schedule']['policy']} schedule)" if "verify_schedule" in report else "")
          + (f"; with its {m['draft_vocab_size']}-token map (not served) tau {m['accept_len']:.3f}, speedup "
             f"{m['speedup']:.2f}x" if (m := report.get("token_map")) else "")
          + (f"; n-gram drafter tau {report['ngram_baseline']['accept_len']:.3f} ({report['tau_vs_ngram']:.2f}x), "
             f"speedup {report['ngram_baseline']['speedup']:.2f}x" if "ngram_baseline" in report else "")
          + (f"; a round: draft {t['draft_ms']:.1f} + verify {t['verify_ms']:.1f} + other {t['other_ms']:.1f} ms, "
             f"{t['loop_efficiency']:.0%} of this tau's limit {t['tau_limit_speedup']:.2f}x"
             if (t := report.get("timing")) else ""), flush=True)
    if "calibration_skipped" in report:
        print(f"[eval] calibration and scheduler simulation skipped: {report['calibration_skipped']}", flush=True)
