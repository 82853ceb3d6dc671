"""Export a trained DraftSmith draft folder to a serving checkpoint: the command line (export/convert.py does it).

    python export/main.py --checkpoint runs/dspark_smollm2_135m/train/final --to sglang --out exports/dspark
    python export/main.py --checkpoint runs/eagle3_smollm2_135m/train/final --to vllm --out exports/eagle3-vllm
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# `python export/main.py` puts export/ first on sys.path; the project root must come first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.io import LinkedPathError, LockedError, is_temporary, lock_for_process, own_root  # noqa: E402
from core.stage import DamagedOutputError  # noqa: E402
from core.server import ENGINES, SERVING_ALGORITHMS  # noqa: E402


def main(argv: list[str] | None = None, prog: str = "export/main.py") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Export a trained DraftSmith draft (config.json + model.safetensors) to a serving checkpoint. "
                    "SGLang 0.5.23: Eagle3 -> EAGLE3 (LlamaForCausalLMEagle3); DFlash with the 1+N layout -> DFLASH "
                    "(DFlashDraftModel, block_size = gamma+1); DFlash2 (a candidate selector) -> DFlash2DraftModel "
                    "(SGLang's DFLASH worker); other block drafts -> DSPARK (Qwen3DSparkModel, "
                    "block_size = gamma). vLLM: a speculators-format folder (speculators_config). Every tensor is "
                    "checked by name, shape and dtype; on any error nothing is written to --out.")
    parser.add_argument("--checkpoint", required=True, type=Path, help="trained draft folder (config.json + "
                        "model.safetensors), e.g. runs/<name>/train/final")
    parser.add_argument("--to", required=True, choices=ENGINES, help="serving engine format")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist unless --overwrite)")
    parser.add_argument("--algorithm", choices=SERVING_ALGORITHMS, default=None,
                        help="force the serving algorithm (default: from the config; DFLASH only for 1+N drafts)")
    parser.add_argument("--sts", type=Path, default=None, help="DSpark confidence calibration JSON to ship as "
                        "sts.json, one temperature per draft position (default: <checkpoint>/sts.json, else the "
                        "run's eval/sts.json when that eval measured this draft, e.g. runs/<name>/eval for "
                        "runs/<name>/train/final)")
    parser.add_argument("--sps", type=Path, default=None, help="an SPS cost table for SGLang's DSpark verify "
                        "scheduler, profiled on the serving GPU up to SGLang's largest verify batch (48 running "
                        "requests x (gamma+1) tokens); a shorter one is refused. Default: the checkpoint's or the "
                        "run eval's sps_table.json when it covers that range, else none, and the commands that "
                        "profile one with SGLang's own profiler are printed")
    parser.add_argument("--verifier", default=None, help="the target model id/path: recorded in vLLM's "
                        "speculators_config, named in the printed serve command, and its config's dtype is the "
                        "export's (default: the run's target, from runs/<name>/recipe.yaml)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32: the dtype the export declares "
                        "and stores its weights in, named in the printed serve command (default: the target's, from "
                        "its config; the draft's own when no target config can be read)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    # torch and the models: after --help and argument errors
    from export.convert import ExportJob, export_draft, run_target, target_config_dtype
    from export.serving import declared_dtype, serve_command, serve_notes
    from modeling.registry import read_config
    from modeling.target import resolve_target

    try:
        own_root(args.out)
        # beside --out, not in it: the export replaces the whole folder
        lock_for_process(args.out.parent / f".{args.out.name}.lock", f"--out {args.out}")
        for stale in args.out.parent.glob(f".{args.out.name}.*"):  # an earlier export killed mid-write left these
            if is_temporary(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
        target = args.verifier or run_target(args.checkpoint)
        target = resolve_target(target) if target else None  # the embedded SmolLM2's name -> its local folder
        out = export_draft(ExportJob(args.checkpoint, args.to, args.out, algorithm=args.algorithm, sts_path=args.sts,
                                     sps_path=args.sps, verifier=target, dtype=args.dtype, overwrite=args.overwrite))
    # DamagedOutputError: a run's train/final whose checksums.json (or another file it recorded) is gone or changed
    except (ValueError, FileNotFoundError, FileExistsError, LockedError, LinkedPathError,
            DamagedOutputError) as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 2
    print(out.resolve())
    dtype = declared_dtype(read_config(out))
    if args.dtype is None and (target is None or target_config_dtype(target) is None):
        why = "no --verifier and no run recipe.yaml" if target is None else f"{target}'s config is not readable here"
        print(f"note: {why}: the export is in the draft's own dtype, {dtype}, and the command runs the target in it "
              f"too (bfloat16 for float32 on SGLang's GPU kernels). Re-export with --verifier <target> or --dtype to "
              f"serve in the target's dtype", file=sys.stderr)
    print(f"serve it with:\n  {serve_command(args.checkpoint, args.to, out, target, args.algorithm)}", file=sys.stderr)
    for note in serve_notes(args.checkpoint, args.to, out, target, args.algorithm):
        print(f"note: {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
