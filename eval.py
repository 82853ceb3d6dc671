r"""Evaluate a drafter with a lossless speculative-decoding loop and write report.json / report.md / accept_rate.png.

    python eval.py --draft runs/dspark_smollm2_135m/train/final --target smollm2-135m-instruct --dataset mtbench
    python eval.py --draft ngram --target smollm2-135m-instruct --dataset humaneval --num-samples 8

--draft is a trained draft folder (DSpark, DFlash or Eagle3: config.json + model.safetensors), `ngram` (prompt
lookup) or `lm:<path or id>` (a small causal LM with the target's tokenizer), so every tau is comparable.

Live check against a serving engine (exports the draft, starts the server, compares live and offline tau, stops it):
    python eval.py --live --engine vllm --draft runs/dflash_smollm2_135m/train/final --target smollm2-135m-instruct \
        --dataset mtbench --num-samples 8 --max-new-tokens 64
vLLM runs from its own venv (`make venv-vllm` builds .venv-vllm; or --engine-python). `--engine sglang` needs a GPU
for DFLASH/DSPARK. Exit code 1 when the two taus differ by more than --tolerance.
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from core import stage  # noqa: E402
from core.io import (DamagedFileError, LinkedPathError, LockedError, is_temporary, link_problem,  # noqa: E402
                     lock_for_process, own_root)
from core.malloc import keep_freed_memory  # noqa: E402
from core.server import (ENGINES, FLOAT32_TOLERANCE, HALF_PRECISION_TOLERANCE, LiveEvalError,  # noqa: E402
                         ServerStartError)
from data.sources.registry import source_problem  # noqa: E402
from eval import LOOKUP_MAX_N, SCHEDULES  # noqa: E402
from modeling.draft_folder import is_draft_dir, max_drafts  # noqa: E402

# eval/, modeling/ (torch, transformers: ~12 s to import on a small machine) are imported where they run, so that
# --help and a bad argument answer at once.


def eval_decode(args):
    """What the flags ask to decode (eval/run.py EvalDecode), offline and --live alike."""
    from eval.run import EvalDecode

    return EvalDecode(
        draft=args.draft, target_name=args.target, dataset=args.dataset, num_samples=args.num_samples,
        temperature=args.temperature, block_size=args.block_size, max_new_tokens=args.max_new_tokens, seed=args.seed,
        system_prompt=args.system_prompt, dataset_path=args.dataset_path, any_target=args.any_target,
        full_vocab=args.full_vocab, verify_schedule=args.schedule, sts_path=args.sts, lookup_first=args.lookup_first)


def _live(args) -> int:
    from eval.live import LiveServing, print_live_summary, run_live_eval

    try:  # what no engine serves (sampling among it) is refused inside, before any work: eval/live.py live_problem
        report = run_live_eval(eval_decode(args), LiveServing(
            engine=args.engine, engine_python=args.engine_python, dtype=args.dtype,
            startup_timeout=args.startup_timeout, server_args=tuple(args.server_arg)), Path(args.out), args.tolerance)
    except (ServerStartError, LiveEvalError, ValueError, stage.DamagedOutputError) as exc:
        print(f"[live] failed: {exc}", file=sys.stderr)
        return 2
    print_live_summary(report)
    print(f"[live] report: {Path(args.out) / 'report.md'}")
    return 0 if report["within_tolerance"] else 1


def default_out(draft: str, dataset: str) -> Path:
    """runs/eval/<draft>_<dataset>, each named by its path with anything but letters, digits, '.', '_' and '-' as
    '-' (runs/demo/train/final on mtbench: runs/eval/runs-demo-train-final_mtbench)."""
    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "x"

    return Path("runs") / "eval" / f"{slug(draft)}_{slug(Path(dataset).name)}"


# What eval.py writes into --out (eval/report.py, eval/run.py, eval/live.py and its served export; sts.json and
# sps_table.json are export/serving.py's names, which imports torch): a folder holding nothing else is an earlier
# eval.py report, which a rerun replaces; one holding anything else is not eval.py's.
EVAL_OUTPUTS = frozenset({"report.json", "report.md", "accept_rate.png", "ngram", "sts.json", "sps_table.json",
                          "loop_sps_table.json", ".draftsmith.lock", "served-draft", ".served-draft.lock",
                          *(f"{engine}-server.log" for engine in ENGINES)})
# config.json + model.safetensors: a draft or a serving export (export/convert.py), whatever else it holds
DRAFT_FILES = ("config.json", "model.safetensors")


def out_problem(out: Path) -> str | None:
    """eval.py writes report.json (and sts.json) into --out: a pipeline run's folder would have them taken for the
    run's own (its next call printed the other eval's tau as the run's and exported its calibration), and an export
    would ship another block size's sts.json. Decided on the folder --out resolves to (`..` and links followed), by
    what it and the folders above it hold, never by their names."""
    if out.is_symlink() and not out.is_dir():
        return f"--out {link_problem(out)}"
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file: give a folder (it is made when missing)"
    real = out.resolve()
    shown = f"--out {out}" + (f" (that is {real})" if real != Path(out).absolute() else "")
    run = stage.enclosing_run(real)
    if run is not None:
        return (f"{shown} is, or lies in, the run {run}: eval.py does not write into a run's folders (its stages would take "
                f"the report for their own). Give a folder outside it, or leave --out out for "
                f"runs/eval/<draft>_<dataset>")
    held = sorted(p.name for p in real.iterdir()) if real.is_dir() else []
    if all((real / name).is_file() for name in DRAFT_FILES):
        return (f"{shown} holds a draft or a serving export ({' + '.join(DRAFT_FILES)}): eval.py does not write its "
                f"report and calibration into one. Give another folder")
    foreign = [name for name in held if name not in EVAL_OUTPUTS and not is_temporary(name)]
    if foreign:
        return (f"{shown} holds files eval.py did not write ({', '.join(foreign[:5])}"
                f"{f' and {len(foreign) - 5} more' if len(foreign) > 5 else ''}): it writes only into a new or empty "
                f"folder or an earlier eval.py report's. Give another folder")
    return None


def argument_problems(args) -> list[str]:
    """What would otherwise fail only after the target is loaded, or silently evaluate nothing: checked first."""
    problems = [f"{flag} must be > 0, got {value}" for flag, value in
                (("--num-samples", args.num_samples), ("--max-new-tokens", args.max_new_tokens),
                 ("--block-size", args.block_size)) if value is not None and value <= 0]
    if not args.temperature >= 0:  # nan too
        problems.append(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 <= args.seed < 2**32:  # numpy's range: the scheduler simulation seeds with it
        problems.append(f"--seed must be in [0, 2**32), got {args.seed}")
    if not 0 <= args.lookup_first <= LOOKUP_MAX_N:
        problems.append(f"--lookup-first must be in 0..{LOOKUP_MAX_N} (the shortest context suffix prompt lookup "
                        f"must match, of the {LOOKUP_MAX_N} it tries; 0 = off), got {args.lookup_first}")
    if args.draft != "ngram" and not args.draft.startswith("lm:") and not is_draft_dir(args.draft):
        problems.append(f"--draft {args.draft}: not a draft folder (config.json + model.safetensors of a DSpark, "
                        f"DFlash or Eagle3 draft, e.g. runs/<recipe>/train/final), nor `ngram` or `lm:<model>`")
    elif args.block_size and is_draft_dir(args.draft):
        most = max_drafts(args.draft)  # a block draft predicts its block, no further (an Eagle3 chain has no limit)
        if most is not None and args.block_size > most:
            problems.append(f"--block-size {args.block_size}: {args.draft} is a block draft of {most} positions "
                            f"(its config.json's block_size), so a round proposes at most {most} drafts; use "
                            f"--block-size {most} or less")
    if args.sts is not None and args.schedule != "confidence":
        problems.append("--sts calibrates the confidence schedule: add --schedule confidence, or drop --sts")
    if args.schedule == "confidence" and (args.draft == "ngram" or args.draft.startswith("lm:") or args.live):
        problems.append("--schedule confidence needs a DSpark draft folder with a confidence head, evaluated offline "
                        f"(not --draft {args.draft}{' with --live' if args.live else ''})")
    if args.lookup_first and args.live:  # no serving engine runs lookup-first
        problems.append(f"--lookup-first {args.lookup_first} is measured offline (no serving engine runs it): drop "
                        f"--live or --lookup-first")
    if args.sts is not None:
        from export.serving import load_sts

        try:
            load_sts(args.sts)
        except (OSError, ValueError) as exc:
            problems.append(f"--sts {args.sts}: {exc}")
    dataset_problem = source_problem(args.dataset, args.dataset_path) or prompt_file_problem(args)
    if dataset_problem:
        problems.append(f"--dataset: {dataset_problem}")
    if problems:
        return problems  # before the target's check imports torch: a bad argument answers at once
    from modeling.target import target_path_problem

    target_problem = target_path_problem(args.target)
    return [f"--target: {target_problem}"] if target_problem else []


def prompt_file_problem(args) -> str | None:
    """A local prompt file is read before the target loads (a few prompts; the file named in any error): one that is
    not prompts (`null`, rows without a prompt) is refused here, not after the target loaded."""
    if not Path(args.dataset).is_file():
        return None
    from core.io import DamagedFileError
    from data.sources.prompts import eval_prompts

    try:
        eval_prompts(args.dataset, args.num_samples, args.seed, path=args.dataset_path)
    except (DamagedFileError, ValueError) as exc:
        return str(exc)
    return None


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--draft", required=True, help="draft folder, `ngram`, or `lm:<path or id>`")
    parser.add_argument("--target", required=True, help="HF id or path, or smollm2-135m-instruct")
    parser.add_argument("--dataset", required=True,
                        help="humaneval, mtbench, gsm8k, sharegpt, or a JSON/JSONL file of prompts")
    parser.add_argument("--dataset-path", help="local file for a named dataset (e.g. gsm8k test.jsonl)")
    parser.add_argument("--num-samples", type=int, default=16, help="prompts to evaluate (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 = rejection sampling")
    parser.add_argument("--block-size", type=int, help="gamma, tokens proposed per round (default: the draft's)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt (default 256)")
    parser.add_argument("--system-prompt", help="system prompt (default: the chat template's own, as in training)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="report folder (default runs/eval/<draft>_<dataset>: one folder per draft and "
                                      "prompt set, so evals of different drafts never share one)")
    parser.add_argument("--no-scheduler", action="store_true", help="skip the SPS profile and scheduler simulation")
    parser.add_argument("--schedule", choices=SCHEDULES, default="fixed",
                        help="fixed: verify every draft, gamma a round (default); confidence: verify only the drafts "
                             "DSpark's scheduler admits each round from the confidence head and this machine's "
                             "verify cost (profiled first), as SGLang's DSPARK does (a DSpark draft with a "
                             "confidence head only)")
    parser.add_argument("--sts", metavar="STS_JSON",
                        help="with --schedule confidence: the sts.json of an eval of this draft on other prompts, to "
                             "calibrate its confidences (default: none, uncalibrated)")
    parser.add_argument("--hf-generate", action="store_true",
                        help="also time plain HF generate (greedy, batch 1) on the same prompts and report the ratio")
    parser.add_argument("--ngram-baseline", action="store_true",
                        help="also decode the same prompts with the n-gram drafter (each prompt by every drafter back "
                             "to back between two plain decodes of it) and report tau and speed as ratios of its")
    parser.add_argument("--any-target", action="store_true",
                        help="evaluate even when --target's weights are not the ones the draft was trained on "
                             "(measuring transfer); refused by default")
    parser.add_argument("--full-vocab", action="store_true",
                        help="skip the pass with the draft folder's token map (token_map.pt, the tokens it was trained "
                             "over). A draft with a map is reported as SGLang and vLLM serve it, over the whole "
                             "vocabulary, with the map's figure beside it; this flag keeps the first only")
    parser.add_argument("--lookup-first", type=int, default=0, metavar="N",
                        help=f"propose prompt lookup's continuation whenever the context's last N (or more, up to "
                             f"{LOOKUP_MAX_N}) tokens occurred before, the draft's otherwise (a copy path measured "
                             f"here; no serving engine runs it). 0 = off (default)")
    live = parser.add_argument_group("live serving check (--live)")
    live.add_argument("--live", action="store_true", help="serve the draft in --engine and compare with offline tau")
    live.add_argument("--engine", choices=ENGINES, default="vllm", help="serving engine (default vllm)")
    live.add_argument("--engine-python", help="python that runs the engine (default: .venv-vllm for vLLM, this one "
                                              "for SGLang; $DRAFTSMITH_VLLM_PYTHON overrides for vLLM)")
    live.add_argument("--dtype", help="the dtype the draft is exported and served in (default: float32 for vLLM on a "
                                      "CPU, so its numerics are the offline loop's; otherwise the export's declared "
                                      "dtype, the target's. SGLang serves a float32 export in bfloat16: its GPU "
                                      "kernels run no float32)")
    live.add_argument("--tolerance", type=float, default=None,
                      help=f"allowed |tau_live - tau_offline| (default: {FLOAT32_TOLERANCE} for a float32 server on a "
                           f"CPU, {HALF_PRECISION_TOLERANCE} otherwise, e.g. bfloat16 on a GPU, whose kernels round "
                           f"unlike the offline loop's; the value used is printed; see report.md)")
    live.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the server (900)")
    live.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                      help="extra argument for the server command line (repeatable), e.g. --server-arg=--enforce-eager")
    args = parser.parse_args(argv)
    problems = argument_problems(args)
    if problems:
        parser.error("\n  ".join(problems))  # usage, the problems, exit code 2: before anything is loaded or written
    args.out = args.out or str(default_out(args.draft, args.dataset_path or args.dataset))
    problem = out_problem(Path(args.out))
    if problem:
        parser.error(problem)
    try:  # two evals writing one folder would mix their reports
        own_root(args.out)  # no write below --out passes through a link
        lock_for_process(Path(args.out) / ".draftsmith.lock", f"--out {args.out}")
    except (LockedError, LinkedPathError) as exc:
        print(f"[eval] refused: {exc}", file=sys.stderr)
        return 2
    keep_freed_memory()  # torch's CPU tensors come from malloc (core/malloc.py)
    if args.live:
        return _live(args)
    from eval.report import ReportSettings, print_summary
    from eval.run import ScheduleError, run_eval
    from modeling.registry import TargetMismatchError

    try:
        report = run_eval(eval_decode(args), ReportSettings(
            out_dir=Path(args.out), ngram_baseline=args.ngram_baseline, hf_generate=args.hf_generate,
            scheduler=not args.no_scheduler))
    # a damaged draft folder (a file changed, its checksums.json gone): named, the user's to mend
    except (TargetMismatchError, ScheduleError, LinkedPathError, DamagedFileError,
            stage.DamagedOutputError) as exc:
        print(f"[eval] refused: {exc}", file=sys.stderr)
        return 2
    print_summary(report)
    print(f"[eval] report: {Path(args.out) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
