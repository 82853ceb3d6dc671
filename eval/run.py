"""Evaluate a drafter on a prompt set: accept length, per-position acceptance, exactness, speed, calibration.

    python eval.py --draft runs/dspark_smollm2_135m/train/final --target smollm2-135m-instruct --dataset mtbench

For every prompt (first user turn, rendered with the same chat-template handling as training) the target generates
in the same process plain greedy/sampled decoding (the reference and the speed baseline) and speculative decoding
with the drafter (eval/arms.py). What it decodes: EvalDecode; what it measures beside and writes (report.json,
report.md, accept_rate.png; the report's keys): eval/report.py ReportSettings.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from core import stage
from core.io import make_dir, read_json
from data.chat import build_messages, render_prompt_ids
from data.sources.prompts import (DEFAULT_HOLDOUT_FRACTION, eval_prompts, load_prompts, local_source,
                                  split_trained, trained_keys, training_overlap)
from data.sources.registry import resolve_source
from eval import SCHEDULES
from eval.arms import Arm, PlainLoop, decode_interleaved, speed_by_source
from eval.calibration import MIN_ROUNDS, calibrate_sts, calibration_report, logits_from_probs, prefix_labels
from eval.report import ReportSettings, against_ngram, arm_metrics, drafter_report, write_report
from eval.scheduler import VerifySchedule, format_table, profile_sps, simulate
from eval.lookup import LookupFirstDrafter, NgramDrafter
from eval.spec_decode import (Decoding, DraftLMDrafter, DSparkDrafter, GenerationResult, is_greedy, load_draft,
                              sync_clock)
from export.serving import SPS_FILENAME, STS_FILENAME, SpsTable, load_sts, save_sts
from modeling.registry import draft_digest
from modeling.target import TargetRunner, chat_template_pin, load_target, load_tokenizer


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


def served_drafters(s: "EvalDecode", target):
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




@dataclass(frozen=True, kw_only=True)
class EvalDecode:
    """What an eval decodes: which drafter, on which target and prompts, and how the loop decodes them (eval/report.py
    ReportSettings says what is measured beside it and written).

    draft: a trained draft folder, `ngram`, or `lm:<path or id>` (`make_drafter`). dataset, dataset_path: the prompts
    (a benchmark name, a prompt file, or a source's held-out rows; data/sources/prompts.py eval_prompts), num_samples of
    them drawn with `seed`; prompt i decodes with seed + i. block_size: gamma, None for the draft's own. device: where the
    target loads when the caller holds none (default: cuda if any).
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
    trained: the dedup keys of the conversations the draft trained on (eval_set's); eval prompts among them, found by
    what they say, are dropped (kept with keep_trained, an overfit check) and counted in report `training_prompts`.
    """

    draft: str
    target_name: str
    dataset: str
    num_samples: int
    max_new_tokens: int
    temperature: float = 0.0
    block_size: int | None = None
    seed: int = 0
    system_prompt: str | None = None
    enable_thinking: bool = False
    dataset_path: str | None = None
    device: str | None = None
    any_target: bool = False
    full_vocab: bool = False
    verify_schedule: str = "fixed"
    sts_path: str | None = None
    lookup_first: int = 0
    holdout_fraction: float = DEFAULT_HOLDOUT_FRACTION
    #: a Jinja chat template file instead of the tokenizer's own (the recipe's target.chat_template)
    chat_template: str | None = None
    trained: frozenset | None = None
    keep_trained: bool = False

    def decoding(self, gamma: int, eos_token_id, index: int) -> Decoding:
        """How prompt `index` is decoded, by every drafter and by the plain loop beside them."""
        return Decoding(max_new_tokens=self.max_new_tokens, gamma=gamma, temperature=self.temperature,
                        eos_token_id=eos_token_id, seed=self.seed + index)


def run_eval(decode: EvalDecode, reporting: ReportSettings, *, target=None, baselines: dict | None = None) -> dict:
    """Speculative decoding with `decode.draft` on the prompts, against the target's own decoding; the report, also
    written to DIR/report.json, report.md and accept_rate.png (DIR = reporting.out_dir).

    The headline is the draft as SGLang and vLLM serve it: a block draft with a token map (token_map.pt) drafts over
    the whole vocabulary there, so its tau, speed and calibration are measured so, and its figures with the map go
    beside them (report `token_map`; skipped with full_vocab). With reporting.ngram_baseline the n-gram drafter
    decodes the prompts too. Every prompt is decoded by each of them back to back between two plain decodes of it
    (eval/arms.py), the same way (EvalDecode.decoding): each speed is a ratio over the plain loop's in the same minutes.

    target: the target model `decode.target_name` names, when the caller already holds it (the eval stage does).
    baselines: a dict shared by several calls in one process (same target and prompts): HF generate's decodes
    (hf_generate) are run once, by the first call, and reused."""
    s = decode
    if s.verify_schedule not in SCHEDULES:
        raise ScheduleError(f"unknown verify schedule {s.verify_schedule!r}; known: {', '.join(SCHEDULES)}")
    if s.lookup_first and (s.verify_schedule != "fixed" or s.draft == "ngram"):
        raise ScheduleError(f"lookup-first {s.lookup_first} pairs prompt lookup with a trained draft under the fixed "
                            f"verify schedule (lookup's rounds have no confidences): got draft {s.draft!r}, schedule "
                            f"{s.verify_schedule!r}")
    prompts, overlap = eval_set(s)
    out_dir = Path(reporting.out_dir)
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
    if reporting.ngram_baseline and s.draft != "ngram":
        # the same prompts and decoding, gamma included, with the free n-gram drafter and nothing else
        arms.append(Arm("ngram", NgramDrafter(gamma=gamma)))
    greedy = is_greedy(s.temperature)

    hf_generate = reporting.hf_generate and greedy
    baselines = {} if baselines is None else baselines
    plain = PlainLoop()
    hf_time = hf_tokens = 0.0
    for i, prompt in enumerate(tqdm(prompts, desc=f"eval {s.dataset}", unit="prompt")):
        ids = first_turn_ids(tokenizer, prompt, s.system_prompt, s.enable_thinking)
        reference = decode_interleaved(target, arms, prompt, ids, i, s.decoding(gamma, tokenizer.eos_token_id, i),
                                       plain=plain)
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
    report = drafter_report(base, served, plain, greedy, draft_vocab_size=vocab_size(drafter), **(
        {"lookup_first": s.lookup_first, "copied_round_share": served.copied_rounds / max(len(rounds), 1)}
        if s.lookup_first else {}))
    if overlap is not None:
        report["training_prompts"] = overlap
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
        # the n-gram drafter's report is built as the draft's: the same base, its own drafter keys
        ngram = drafter_report(base, by_name["ngram"], plain, greedy, draft="ngram", draft_vocab_size=None)
        write_report(ngram, out_dir / "ngram", plot=False)  # eval.compare reads its copy-heavy prompts
        against_ngram(report, ngram, s.temperature)
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
            if reporting.scheduler:
                report["scheduler"] = _schedule(target, drafter.layer_ids, rounds, gamma, out_dir, s.seed)
    write_report(report, out_dir)
    return report


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


class TrainedPromptsError(ValueError):
    """Every eval prompt is one the draft trained on: nothing left to measure drafting with."""


def eval_set(s: EvalDecode) -> tuple[list, dict | None]:
    """(the prompts to decode, report `training_prompts` or None when s.trained is None)."""
    prompts = eval_prompts(s.dataset, s.num_samples, s.seed, path=s.dataset_path, holdout_fraction=s.holdout_fraction)
    if s.trained is None:
        return prompts, None
    unseen, trained = split_trained(prompts, s.trained)
    if trained and not unseen and not s.keep_trained:
        raise TrainedPromptsError(f"eval.dataset {s.dataset}: all {len(prompts)} eval prompts are training prompts "
                                  f"(by what they say: the loader's dedup key); evaluate on other prompts")
    return (prompts if s.keep_trained else unseen), {
        "found": len(trained), "of": len(prompts), "kept": s.keep_trained, "ids": [p.id for p in trained][:20]}


def recipe_trained_keys(recipe, local_only: bool = False) -> frozenset:
    """The conversations a recipe's draft trains on, as the regenerate stage loads them (local_only: without the hub
    sources, which only that stage reaches)."""
    d = recipe.data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a short source is the regenerate stage's to report
        return trained_keys(load_prompts(d.sources, d.num_prompts, d.holdout_fraction, recipe.seed,
                                         local_only=local_only), d.max_turns)


def _stage_trained_keys(recipe) -> frozenset | None:
    try:
        return recipe_trained_keys(recipe)
    except (ValueError, OSError) as exc:  # a source gone since its regeneration: measured, and said so
        print(f"[eval] the eval prompts are not held against the training prompts: data.sources: {exc}", flush=True)
        return None


def eval_set_problem(recipe, sources_read: bool) -> list[str]:
    """The eval set read before any work (a damaged or null file is found now, not after training) and held
    against the training prompts: refused when a source is shared by what it reads (any name or path) and nothing is
    held out, or when every eval prompt is a training prompt by what it says (as far as the local sources tell; the
    eval stage drops the ones it finds). sources_read: the sources can still be read (not yet regenerated)."""
    e, d = recipe.eval, recipe.data
    why = None if e.allow_training_prompts else training_overlap(e.dataset, d.sources, d.holdout_fraction)
    if why is not None:
        return [f"eval.dataset {e.dataset}: its prompts would be training prompts: {why}; or set "
                f"eval.allow_training_prompts=true to measure how the drafter fits the prompts it trained on"]
    if not local_source(resolve_source(e.dataset, None)):
        return []  # the hub's: read, and held against the training prompts, by the eval stage
    trained = None
    if not e.allow_training_prompts and sources_read:
        try:
            trained = recipe_trained_keys(recipe, local_only=True)
        except (ValueError, OSError):
            pass  # the data.sources check names what is wrong with them
    try:
        eval_set(EvalDecode(draft="", target_name="", dataset=e.dataset, num_samples=e.num_samples, max_new_tokens=0,
                            seed=recipe.seed, holdout_fraction=d.holdout_fraction or DEFAULT_HOLDOUT_FRACTION,
                            trained=trained))
    except TrainedPromptsError as exc:
        return [f"{exc}, or set eval.allow_training_prompts=true to measure how the drafter fits them"]
    except (ValueError, OSError) as exc:
        return [f"eval.dataset {e.dataset}: {exc}"]
    return []


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
    report = run_eval(EvalDecode(
        draft=str(draft_dir), target_name=recipe.target.name_or_path, dataset=recipe.eval.dataset,
        num_samples=recipe.eval.num_samples, temperature=recipe.eval.temperature, block_size=None,
        max_new_tokens=recipe.eval.max_new_tokens, seed=recipe.seed, system_prompt=recipe.data.system_prompt,
        enable_thinking=recipe.regen.enable_thinking,
        # training's split; at 0 nothing is held out and check_inputs refused a training source as the eval set
        holdout_fraction=recipe.data.holdout_fraction or DEFAULT_HOLDOUT_FRACTION,
        chat_template=recipe.target.chat_template, trained=_stage_trained_keys(recipe),
        keep_trained=recipe.eval.allow_training_prompts),
        ReportSettings(out_dir=eval_dir, ngram_baseline=recipe.eval.ngram_baseline), target=target)
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
