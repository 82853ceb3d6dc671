"""Copy-task training prompts from ShareGPT's own answers, for the copying lever of benchmarks/quality.py
(benchmarks/README.md, "Copying from the context"):

    python benchmarks/copy_prompts.py runs/copy_prompts.jsonl --count 160
    python benchmarks/quality.py --train-prompts 320 --add-source runs/copy_prompts.jsonl=0.5 ...

Each prompt asks the target to restate a ShareGPT answer of 30-90 words (repeat it, fix its spelling, copy it out,
or comment code), so the regenerated answers hold long verbatim copies of their prompt. ShareGPT is a training
source; the held-out sources (MT-bench, HumanEval, GSM8K test) are never read.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data.sources import load_source  # noqa: E402

PROSE = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Fix any spelling mistakes in this text and return the full corrected text:\n\n{text}",
    "Here is some text:\n\n{text}\n\nCopy it out again, unchanged.",
]
CODE = "Rewrite the following code, keeping it exactly the same but adding a short comment on the first line:\n\n{text}"


def copy_prompts(count: int, seed: int = 0) -> list[dict]:
    """`count` prompts {"id", "turns"}: the first answer of 30-90 words (700 characters at most) of shuffled ShareGPT
    conversations, wrapped in a code template when it looks like code, else in the prose ones in turn."""
    conversations = load_source("sharegpt", limit=6000)
    random.Random(seed).shuffle(conversations)
    rows = []
    for prompt in conversations:
        answer = next((a for a in prompt.answers if 30 <= len(a.split()) <= 90 and len(a) <= 700), None)
        if answer is None:
            continue
        template = CODE if "```" in answer or "def " in answer or "{" in answer else PROSE[len(rows) % len(PROSE)]
        rows.append({"id": f"copy:{prompt.id}", "turns": [template.format(text=answer.strip())]})
        if len(rows) == count:
            break
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("out", type=Path, help="the prompt file to write (.jsonl)")
    parser.add_argument("--count", type=int, default=160, help="prompts to write (160)")
    args = parser.parse_args()
    rows = copy_prompts(args.count)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} copy prompts ({sum(r['turns'][0].startswith(CODE[:20]) for r in rows)} with code) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
