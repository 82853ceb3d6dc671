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

from core.io import LockedError, is_temporary, lock_for_process  # noqa: E402
from core.server import ALGORITHMS, ENGINES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="export/main.py",
        description="Export a trained DraftSmith draft (config.json + model.safetensors) to a serving checkpoint. "
                    "SGLang 0.5.23: Eagle3 -> EAGLE3 (LlamaForCausalLMEagle3); DFlash with the 1+N layout -> DFLASH "
                    "(DFlashDraftModel, block_size = gamma+1); other block drafts -> DSPARK (Qwen3DSparkModel, "
                    "block_size = gamma). vLLM: a speculators-format folder (speculators_config). Every tensor is "
                    "checked by name, shape and dtype; on any error nothing is written to --out.")
    parser.add_argument("--checkpoint", required=True, type=Path, help="trained draft folder (config.json + "
                        "model.safetensors), e.g. runs/<name>/draft")
    parser.add_argument("--to", required=True, choices=ENGINES, help="serving engine format")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist unless --overwrite)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default=None,
                        help="force the serving algorithm (default: from the config; DFLASH only for 1+N drafts)")
    parser.add_argument("--sts", type=Path, default=None, help="DSpark confidence calibration JSON to ship as "
                        "sts.json (default: <checkpoint>/sts.json when present)")
    parser.add_argument("--sps", type=Path, default=None, help="the target's SPS cost table (eval's "
                        "sps_table.json) to ship for SGLang's DSpark verify scheduler (default: "
                        "<checkpoint>/sps_table.json when present)")
    parser.add_argument("--verifier", default=None, help="target model id/path recorded in vLLM's speculators_config")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    from export.convert import export_draft  # torch and the models: after --help and argument errors
    from export.serving import serve_command

    try:
        # beside --out, not in it: the export replaces the whole folder
        lock_for_process(args.out.parent / f".{args.out.name}.lock", f"--out {args.out}")
        for stale in args.out.parent.glob(f".{args.out.name}.*"):  # an earlier export killed mid-write left these
            if is_temporary(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
        out = export_draft(args.checkpoint, args.to, args.out, algorithm=args.algorithm, sts_path=args.sts,
                           sps_path=args.sps, verifier=args.verifier, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError, LockedError) as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 2
    print(out)
    print(f"serve it with:\n  {serve_command(args.checkpoint, args.to, out, args.verifier, args.algorithm)}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
