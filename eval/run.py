"""Evaluate a drafter on a prompt set: accept length, per-position acceptance, exactness, speed, calibration.

    python eval.py --draft runs/dspark_smollm2_135m/train/final --target smollm2-135m-instruct --dataset mtbench

For every prompt (first user turn, rendered with the same chat-template handling as training) the target generates
twice in the same process: plain greedy/sampled decoding (the reference and the speed baseline) and speculative
decoding with the drafter. The report holds:
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
Written to DIR/report.json, DIR/report.md and DIR/accept_rate.png.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from core import stage
from core.io import atomic_open, atomic_write_json, atomic_write_text, make_dir, read_json
from data.chat import build_messages, render_prompt_ids
from data.prompts import DEFAULT_HOLDOUT_FRACTION, eval_prompts
from eval import SCHEDULES
from eval.arms import Arm, Decoding, PlainLoop, decode_interleaved, speed_by_source
from eval.compare import source_rows, source_table, tally
from eval.calibration import MIN_ROUNDS, calibrate_sts, calibration_report, logits_from_probs, prefix_labels
from eval.scheduler import VerifySchedule, format_table, profile_sps, simulate
from eval.lookup import LookupFirstDrafter, NgramDrafter
from eval.spec_decode import DraftLMDrafter, DSparkDrafter, GenerationResult, is_greedy, load_draft, sync_clock
from export.serving import SPS_FILENAME, STS_FILENAME, SpsTable, load_sts, save_sts
from modeling.registry import draft_digest
from modeling.target import TargetRunner, chat_template_pin, load_target, load_tokenizer


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


def first_turn_ids(tokenizer, prompt, system_prompt: str | None, enable_thinking: bool) -> list[int]:
    """The prompt ids an eval sends: the first user turn, rendered with the training chat-template handling."""
    return render_prompt_ids(tokenizer, build_messages([prompt.turns[0]], [], system_prompt),
                             enable_thinking=enable_thinking)


def make_drafter(draft: str, target, gamma: int, any_target: bool = False, full_vocab: bool = False):
    """A trained draft folder, `ngram`, or `lm:<path or id>` (a small causal LM with the target's tokenizer).
    any_target: accept a target whose weights differ from the draft's own (see modeling.registry); full_vocab: ignore
    a draft folder's token map (eval/spec_decode.load_draft)."""
    if draft == "ngram":
        return NgramDrafter(gamma=gamma)
    if draft.startswith("lm:"):
        model = load_target(draft[3:], target.device, dtype=str(target.dtype).removeprefix("torch."))
        return DraftLMDrafter(model, gamma=gamma, vocab_size=target.config.vocab_size)
    return load_draft(draft, target, any_target=any_target, full_vocab=full_vocab)


def served_drafters(s: "EvalSettings", target):
    """(the drafter as SGLang and vLLM serve it, the same draft with its token map or None): a block draft with a
    token map (token_map.pt) drafts over the whole vocabulary in the engines, so that is the headline, and its map's
    figure is measured beside it unless s.full_vocab. The two share the weights. Both wrapped in lookup-first when
    s.lookup_first."""
    drafter = make_drafter(s.draft, target, s.block_size or 7, s.any_target)
    mapped = None
    if isinstance(drafter, DSparkDrafter) and drafter.model.draft_vocab is not None:
        mapped = None if s.full_vocab else drafter
        drafter = DSparkDrafter(drafter.model, full_vocab=True)
    if s.lookup_first:
        drafter = LookupFirstDrafter(drafter, min_n=s.lookup_first)
        mapped = None if mapped is None else LookupFirstDrafter(mapped, min_n=s.lookup_first)
    return drafter, mapped


def vocab_size(drafter) -> int | None:
    """How many tokens `drafter` drafts among when that is a token map's (None: the whole vocabulary)."""
    inner = getattr(drafter, "drafter", drafter)  # lookup-first wraps the draft
    if not isinstance(inner, DSparkDrafter) or inner.full_vocab or inner.model.draft_vocab is None:
        return None
    return len(inner.model.draft_vocab)


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


@dataclass(frozen=True)
class EvalSettings:
    """One eval: which drafter, on which target and prompts, how it decodes and what it adds to the report.

    draft: a trained draft folder, `ngram`, or `lm:<path or id>` (`make_drafter`). dataset, dataset_path: the prompts
    (a benchmark name, a prompt file, or a source's held-out rows; data/prompts.py eval_prompts). block_size: gamma,
    None for the draft's own. device: where the target loads when the caller holds none (default: cuda if any).
    scheduler: with a DSpark confidence head, also time the target's SPS table and simulate SGLang's scheduler.
    hf_generate: also time plain HF `generate` (greedy, batch size 1) on every prompt, the speed users compare with:
    `hf_generate_tokens_per_s`, `speedup_vs_generate` and `hf_generate_match` (its output equals ours).
    ngram_baseline: also run the free n-gram drafter on the same prompts (report `ngram_baseline`, `tau_vs_ngram`): a
    trained drafter that accepts less than it is not worth serving.
    any_target: accept a target whose weights differ from the draft's own (see modeling.registry).
    full_vocab: skip the pass with a draft folder's token map (token_map.pt): the headline drafts over the whole
    vocabulary either way, as the engines serve it (report `draft_vocab_size`: the tokens the headline drafted among,
    None for all; `token_map`: the pass with the map, when run).
    verify_schedule: `fixed` verifies every draft (gamma a round); `confidence` verifies the drafts DSpark's scheduler
    admits each round (eval/scheduler.py VerifySchedule), from the confidence head calibrated with `sts_path` (an
    sts.json written by an eval on other prompts; None: uncalibrated) and this machine's verify cost, profiled
    through the loop's own cache (`loop_sps_table.json`). Report `verify_schedule`.
    lookup_first: n > 0 proposes prompt lookup's continuation whenever the context's last n or more tokens occurred
    before, the draft's otherwise (eval/spec_decode.py LookupFirstDrafter; no serving engine runs it). Report
    `lookup_first` and `copied_round_share`.
    holdout_fraction: a source's held-out split (not a benchmark's or a file's rows) is drawn with it and `seed`; the
    training recipe's data.holdout_fraction and seed keep it apart from the prompts the draft trained on.
    """

    draft: str
    target_name: str
    dataset: str
    out_dir: Path
    num_samples: int
    temperature: float
    block_size: int | None
    max_new_tokens: int
    seed: int = 0
    system_prompt: str | None = None
    enable_thinking: bool = False
    dataset_path: str | None = None
    device: str | None = None
    scheduler: bool = True
    hf_generate: bool = False
    ngram_baseline: bool = False
    any_target: bool = False
    full_vocab: bool = False
    verify_schedule: str = "fixed"
    sts_path: str | None = None
    lookup_first: int = 0
    holdout_fraction: float = DEFAULT_HOLDOUT_FRACTION
    #: a Jinja chat template file instead of the tokenizer's own (the recipe's target.chat_template)
    chat_template: str | None = None


def run_eval(settings: EvalSettings, *, target=None, baselines: dict | None = None) -> dict:
    """Speculative decoding with `settings.draft` on the prompts, against the target's own decoding; the report, also
    written to DIR/report.json, report.md and accept_rate.png (DIR = settings.out_dir).

    The headline is the draft as SGLang and vLLM serve it: a block draft with a token map (token_map.pt) drafts over
    the whole vocabulary there, so its tau, speed and calibration are measured so, and its figures with the map go
    beside them (report `token_map`; skipped with full_vocab). With ngram_baseline the n-gram drafter decodes the
    prompts too. Every prompt is decoded by each of them back to back between two plain decodes of it (eval/arms.py):
    each speed is a ratio over the plain loop's in the same minutes.

    target: the target model `settings.target_name` names, when the caller already holds it (the eval stage does).
    baselines: a dict shared by several calls in one process (same target and prompts): HF generate's decodes
    (hf_generate) are run once, by the first call, and reused."""
    s = settings
    if s.verify_schedule not in SCHEDULES:
        raise ScheduleError(f"unknown verify schedule {s.verify_schedule!r}; known: {', '.join(SCHEDULES)}")
    if s.lookup_first and (s.verify_schedule != "fixed" or s.draft == "ngram"):
        raise ScheduleError(f"lookup-first {s.lookup_first} pairs prompt lookup with a trained draft under the fixed "
                            f"verify schedule (lookup's rounds have no confidences): got draft {s.draft!r}, schedule "
                            f"{s.verify_schedule!r}")
    out_dir = Path(s.out_dir)
    make_dir(out_dir)
    if target is None:
        target = load_target(s.target_name, s.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = load_tokenizer(s.target_name, s.chat_template)
    drafter, mapped = served_drafters(s, target)
    gamma = s.block_size or drafter.default_gamma
    schedule = None
    if s.verify_schedule == "confidence":
        schedule, schedule_report = loop_schedule(target, drafter, gamma, s.sts_path, out_dir)
    arms = [Arm("served", drafter, schedule)]
    if mapped is not None:
        arms.append(Arm("token_map", mapped, schedule))
    if s.ngram_baseline and s.draft != "ngram":
        # the same prompts and decoding, gamma included, with the free n-gram drafter and nothing else
        arms.append(Arm("ngram", NgramDrafter(gamma=gamma)))
    prompts = eval_prompts(s.dataset, s.num_samples, s.seed, path=s.dataset_path, holdout_fraction=s.holdout_fraction)
    greedy = is_greedy(s.temperature)

    hf_generate = s.hf_generate and greedy
    baselines = {} if baselines is None else baselines
    plain = PlainLoop()
    hf_time = hf_tokens = 0.0
    for i, prompt in enumerate(tqdm(prompts, desc=f"eval {s.dataset}", unit="prompt")):
        ids = first_turn_ids(tokenizer, prompt, s.system_prompt, s.enable_thinking)
        how = Decoding(gamma, s.max_new_tokens, s.temperature, tokenizer.eos_token_id, seed=s.seed + i)
        reference = decode_interleaved(target, arms, prompt, ids, i, how, plain=plain)
        if hf_generate:
            key = (prompt.id, s.max_new_tokens)
            if key not in baselines:
                baselines[key] = hf_generate_result(target, tokenizer, ids, s.max_new_tokens)
            hf_time += baselines[key].wall_s
            hf_tokens += len(baselines[key].ids)
            arms[0].samples[-1]["hf_generate_exact"] = baselines[key].ids == reference.ids

    served = arms[0]
    rounds, samples = served.rounds, served.samples
    base = {"draft": s.draft, "target": s.target_name, "dataset": s.dataset, "temperature": s.temperature,
            "num_samples": len(samples), "block_size": gamma, "max_new_tokens": s.max_new_tokens}
    report = {
        **base, "draft_vocab_size": vocab_size(drafter),
        **({"lookup_first": s.lookup_first, "copied_round_share": served.copied_rounds / max(len(rounds), 1)}
           if s.lookup_first else {}),
        **arm_metrics(served, gamma, plain, greedy),
        "plain_repeat_spread": statistics.median(plain.spreads) if plain.spreads else 0.0,
    }
    if schedule is not None:
        report["verify_schedule"] = schedule_report
    if hf_generate:
        report["hf_generate_tokens_per_s"] = hf_tokens / hf_time if hf_time else 0.0
        report["speedup_vs_generate"] = (report["spec_tokens_per_s"] / report["hf_generate_tokens_per_s"]
                                         if report["hf_generate_tokens_per_s"] else 0.0)
        report["hf_generate_match"] = sum(x["hf_generate_exact"] for x in samples) / max(len(samples), 1)
    by_name = {arm.name: arm for arm in arms}
    if "token_map" in by_name:
        report["token_map"] = {"draft_vocab_size": vocab_size(mapped),
                               **arm_metrics(by_name["token_map"], gamma, plain, greedy)}
        report["token_map"]["tau_vs_served"] = report["token_map"]["accept_len"] / report["accept_len"]
    if "ngram" in by_name:
        ngram = {**base, "draft": "ngram", "draft_vocab_size": None,
                 **arm_metrics(by_name["ngram"], gamma, plain, greedy),
                 "plain_repeat_spread": report["plain_repeat_spread"]}
        make_dir(out_dir / "ngram")
        atomic_write_json(out_dir / "ngram" / "report.json", ngram)  # eval.compare reads its copy-heavy prompts
        atomic_write_text(out_dir / "ngram" / "report.md", report_markdown(ngram))
        report["ngram_baseline"] = {key: ngram[key] for key in ("accept_len", "accept_rate_at_k", "verify_rate",
                                                                  "exact_match", "spec_tokens_per_s",
                                                                  "target_tokens_per_s", "speedup", "timing")}
        report["tau_vs_ngram"] = report["accept_len"] / ngram["accept_len"]
        report["speed_vs_ngram"] = report["speedup"] / ngram["speedup"] if ngram["speedup"] else 0.0
        report["vs_ngram"] = vs_ngram(samples, ngram["samples"], s.temperature)
        if "token_map" in report:
            report["token_map"]["tau_vs_ngram"] = report["token_map"]["accept_len"] / ngram["accept_len"]
            report["token_map"]["vs_ngram"] = vs_ngram(report["token_map"]["samples"], ngram["samples"],
                                                       s.temperature)
    # in drafter_rows' order: served, token map, n-gram
    report["speed_by_source"] = speed_by_source([arm.samples for arm in arms])
    # Calibration reads every position's confidences: a scheduled run verified only the drafts it was confident in.
    if rounds and rounds[0].confidences is not None and schedule is None and not s.lookup_first:
        if len(rounds) < MIN_ROUNDS:  # a short eval still gets its report, with what it could not measure
            report["calibration_skipped"] = (
                f"{len(rounds)} round, too few: STS fits on one part of the rounds and measures on the other (at "
                f"least {MIN_ROUNDS}), and the scheduler simulation replays them; evaluate more prompts or tokens "
                f"(--num-samples, --max-new-tokens)")
        else:
            report["calibration"] = _calibrate(rounds, gamma, out_dir, s.dataset)
            if s.scheduler:
                report["scheduler"] = _schedule(target, drafter.layer_ids, rounds, gamma, out_dir, s.seed)
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", report_markdown(report))
    plot_acceptance(report, out_dir / "accept_rate.png")
    return report


def vs_ngram(samples: list[dict], ngram_samples: list[dict], temperature: float) -> dict:
    """The draft against the n-gram drafter on the same prompts, per source, copy-heavy / rest and overall
    (eval/compare.py source_rows), keyed by the temperature both ran at."""
    if [s["id"] for s in samples] != [s["id"] for s in ngram_samples]:
        raise ValueError("the n-gram baseline ran other prompts than the draft: nothing to pair")
    return {"temperature": temperature,
            "rows": source_rows(tally(samples), tally(ngram_samples), [s["source"] for s in samples])}


@torch.inference_mode()
def hf_generate_result(target, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> GenerationResult:
    """Plain HF `generate`, greedy, batch size 1: the output and wall time users compare speculative decoding with."""
    device = next(target.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    start = sync_clock(device)
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                          else tokenizer.eos_token_id)
    result = GenerationResult(out[0, len(prompt_ids):].tolist())
    result.wall_s = sync_clock(device) - start
    return result


def run_eval_stage(recipe, draft_dir: Path, eval_dir: Path, target) -> dict:
    """The pipeline's `eval` stage (rank 0): speculative decoding with the trained draft on recipe.eval's prompts,
    with the target the run already holds. Pinned to the eval settings and the draft's digest, so a changed `eval.*`
    key or a retrained draft runs the stage again instead of silently reusing the old report (and sts.json)."""
    settings = {"eval": vars(recipe.eval), "seed": recipe.seed, "target": recipe.target.name_or_path,
                "system_prompt": recipe.data.system_prompt, "enable_thinking": recipe.regen.enable_thinking,
                "draft_sha256": draft_digest(draft_dir), **chat_template_pin(recipe.target.chat_template)}
    if stage.start(eval_dir, settings, "eval", on_change="rerun") is not None:
        stage.verify_outputs(eval_dir)  # a report rewritten since (another eval's) is refused, not printed as ours
        return read_json(Path(eval_dir) / "report.json")
    report = run_eval(EvalSettings(
        draft=str(draft_dir), target_name=recipe.target.name_or_path, dataset=recipe.eval.dataset, out_dir=eval_dir,
        num_samples=recipe.eval.num_samples, temperature=recipe.eval.temperature, block_size=None,
        max_new_tokens=recipe.eval.max_new_tokens, seed=recipe.seed, system_prompt=recipe.data.system_prompt,
        enable_thinking=recipe.regen.enable_thinking, ngram_baseline=recipe.eval.ngram_baseline,
        # training's split; at 0 nothing is held out and check_inputs refused a training source as the eval set
        holdout_fraction=recipe.data.holdout_fraction or DEFAULT_HOLDOUT_FRACTION,
        chat_template=recipe.target.chat_template), target=target)
    # written last, after report.md and the plot: a crash before it reruns the stage
    # recorded: export ships sts.json and sps_table.json, and the skipped stage prints report.json's tau
    outputs = [name for name in ("report.json", STS_FILENAME, SPS_FILENAME) if (Path(eval_dir) / name).is_file()]
    stage.mark_done(eval_dir, {"accept_len": report["accept_len"]}, outputs=outputs)
    return report


def _confidence_arrays(rounds, gamma: int):
    import numpy as np

    labels, mask = prefix_labels([r.accepted for r in rounds], [r.proposed for r in rounds], gamma)
    probs = np.full((len(rounds), gamma), np.nan)
    for i, r in enumerate(rounds):
        probs[i, : len(r.confidences)] = r.confidences
    return logits_from_probs(probs, eps=1e-6), labels, mask


def _calibrate(rounds, gamma: int, out_dir: Path, dataset: str) -> dict:
    logits, labels, mask = _confidence_arrays(rounds, gamma)
    before = calibration_report(logits, labels, mask)
    result = calibrate_sts(logits, labels, mask)
    save_sts(out_dir / STS_FILENAME, dataset=dataset, **result)
    return {"before": before, "sts_temperatures": result["temperatures"], "ece_before": result["ece_before"],
            "ece_after": result["ece_after"], "sts_path": str(out_dir / STS_FILENAME)}


def _schedule(target, layer_ids, rounds, gamma: int, out_dir: Path, seed: int) -> dict:
    # The SPS table SGLang's scheduler reads: verify steps of up to 128 tokens (a batch of requests' drafts), timed
    # like the loop's own profile (after a context, in interleaved sweeps).
    table = profile_loop_sps(target, layer_ids, [1, 2, 4, 8, 16, 32, 64, 128])
    table.save(out_dir / SPS_FILENAME)
    by_request = [[(r.confidences, r.accept_flags) for r in rounds]]
    rows = simulate(by_request, table, gammas=list(range(1, gamma + 1)), batch_sizes=(1, 4, 16), seed=seed)
    return {"sps_table_path": str(out_dir / SPS_FILENAME), "rows": rows, "table": format_table(rows)}


class ScheduleError(ValueError):
    """A verify schedule this draft or calibration file cannot give (eval.py answers it with exit code 2)."""


def profile_loop_sps(target, layer_ids, sizes, context_tokens: int = 256, sweeps: int = 9) -> SpsTable:
    """The target's verify steps/s at each of `sizes` new tokens after a context_tokens-token prefix, through the
    loop's own KV-cached runner (a forward, then the rollback): what a round pays. The prefix tokens are fixed
    pseudo-random ids; the cost of a forward does not depend on which. The sizes are timed in interleaved sweeps
    (profile_sps): timed size by size, two runs' tables ordered the sizes differently."""
    device = next(target.parameters()).device
    ids = torch.randint(0, target.config.vocab_size, (context_tokens + max(sizes),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    with TargetRunner(target, layer_ids) as runner:
        runner.forward(ids[:context_tokens], logits="none")

        def verify_step(batch_tokens: int):
            runner.forward(ids[context_tokens: context_tokens + batch_tokens])
            runner.crop(context_tokens)

        # sync_clock waits for the GPU's queued kernels, so a step is timed when it is done, not when it is launched.
        return profile_sps(verify_step, sizes, repeats=sweeps, interleave=True, clock=lambda: sync_clock(device))


def loop_schedule(target, drafter, gamma: int, sts_path, out_dir: Path):
    """(the confidence schedule speculative_generate calls each round, what the report says about it)."""
    model = getattr(drafter, "model", None)
    if getattr(model, "confidence_head", None) is None:
        raise ScheduleError("--schedule confidence reads the draft's confidence head: only a DSpark draft trained "
                            "with draft.enable_confidence_head has one (use --schedule fixed for this drafter)")
    temperatures = None
    if sts_path is not None:
        temperatures = load_sts(sts_path).temperatures
        if len(temperatures) < gamma:
            raise ScheduleError(f"--sts {sts_path}: {len(temperatures)} temperatures for {gamma} draft positions; "
                                f"calibrate with an eval at --block-size {gamma} or more")
    table = profile_loop_sps(target, drafter.layer_ids, range(1, gamma + 2))
    table.save(out_dir / "loop_sps_table.json")
    return VerifySchedule(table, temperatures), {"policy": "confidence", "sts": None if sts_path is None else str(sts_path),
                                                 "temperatures": temperatures, "loop_sps_table": table.to_json()}


def report_markdown(report: dict) -> str:
    k = len(report["accept_rate_at_k"])
    lines = [f"# Speculative decoding: {report['dataset']}", "",
             f"draft `{report['draft']}`, target `{report['target']}`, T={report['temperature']}, "
             f"gamma={report['block_size']}, {report['num_samples']} prompts", "",
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
