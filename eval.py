"""Evaluate a drafter with a lossless speculative-decoding loop and write report.json / report.md / accept_rate.png.

    python eval.py --draft runs/dspark_smollm2_135m/train/final --target smollm2-135m-instruct --dataset mtbench
    python eval.py --draft ngram --target smollm2-135m-instruct --dataset humaneval --num-samples 8

--draft is a trained draft folder (DSpark, DFlash or Eagle3: config.json + model.safetensors), `ngram` (prompt
lookup) or `lm:<path or id>` (a small causal LM with the target's tokenizer), so every tau is comparable.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval.run import print_summary, run_eval  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
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
    parser.add_argument("--out", default="runs/eval", help="report folder (default runs/eval)")
    parser.add_argument("--no-scheduler", action="store_true", help="skip the SPS profile and scheduler simulation")
    args = parser.parse_args(argv)
    report = run_eval(draft=args.draft, target_name=args.target, dataset=args.dataset, out_dir=Path(args.out),
                      num_samples=args.num_samples, temperature=args.temperature, block_size=args.block_size,
                      max_new_tokens=args.max_new_tokens, seed=args.seed, system_prompt=args.system_prompt,
                      dataset_path=args.dataset_path, scheduler=not args.no_scheduler)
    print_summary(report)
    print(f"[eval] report: {Path(args.out) / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
