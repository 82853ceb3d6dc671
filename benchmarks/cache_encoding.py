"""What cache.encoding=fp8 costs in accuracy and saves in bytes, on real SmolLM2 hidden states (about 1 min on a CPU).

    python benchmarks/cache_encoding.py                    # 8 ShareGPT conversations, dspark_smollm2_135m's layers
    python benchmarks/cache_encoding.py --conversations 32 --max-length 1024

The target (the embedded SmolLM2-135M-Instruct) runs over ShareGPT conversations with their own answers, tokenized as
the cache stage tokenizes them, and captures the recipe's 5 layers and the final-norm state in fp32. Printed per
stored row (5 layers + final norm), against the bf16 states a raw cache stores:
  rel err   ||x_hat - x|| / ||x|| over every token;
  dim err   RMS of (x_hat - x) / RMS of each dimension (position 0 left out of the RMS, as draft.init_fc=normalized
            does): the error as the drafter's fc sees the dimensions that are not outliers.
for fp8 (the cache's encoding: data/cache.py's as_stored), for symmetric int8 with an absmax/127 fp16 scale per row
(the same bytes, H + 2 a row against fp8's H + 1; measured here only), and for bf16 itself against fp32 (what the raw
cache already loses). Then the bytes a token takes in each encoding.

Held-out tau at equal steps on each encoding: benchmarks/levers.py --encoding fp8.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.recipe import load_recipe  # noqa: E402
from data.cache import as_stored, bytes_per_token  # noqa: E402
from data.capture import cache_spec, capture_rows  # noqa: E402
from data.chat import tokenize_conversation  # noqa: E402
from data.prompts import load_prompts  # noqa: E402
from modeling.target import load_target, load_tokenizer  # noqa: E402


def int8_round_trip(rows: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one absmax/127 scale per row, stored as fp16: the alternative fp8 was chosen over."""
    scale = (rows.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    return ((rows / scale).round().clamp(-127, 127) * scale).nan_to_num()  # an all-zero row: 0/0


def errors(approx: torch.Tensor, exact: torch.Tensor, dim_rms: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per stored row ([N, rows, H] tensors): relative Frobenius error, and RMS error in units of each dimension's
    RMS."""
    diff = approx.float() - exact.float()
    rel = torch.linalg.vector_norm(diff, dim=(0, 2)) / torch.linalg.vector_norm(exact.float(), dim=(0, 2))
    dim = (diff / dim_rms).pow(2).mean((0, 2)).sqrt()
    return rel.tolist(), dim.tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--recipe", default="dspark_smollm2_135m", help="its target, layers and tokenization")
    parser.add_argument("--conversations", type=int, default=8, help="ShareGPT conversations (first turn) (8)")
    parser.add_argument("--max-length", type=int, default=512, help="tokens a conversation is cut to (512)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    recipe = load_recipe(args.recipe)
    name = recipe.target.name_or_path
    model, tokenizer = load_target(name), load_tokenizer(name)
    rows = []
    for prompt in load_prompts(["sharegpt"], args.conversations, 0.0, seed=0):
        messages = [{"role": "user", "content": prompt.turns[0]}, {"role": "assistant", "content": prompt.answers[0]}]
        ids, mask = tokenize_conversation(tokenizer, messages, enable_thinking=recipe.regen.enable_thinking,
                                          thinking=recipe.data.thinking, max_length=args.max_length)
        rows.append({"input_ids": ids, "loss_mask": mask})
    H = model.config.hidden_size
    exact = []
    with torch.no_grad():
        for row in rows:  # one at a time: no padding in the forward
            hidden, last = capture_rows(model, [row], recipe.target.layer_ids, torch.float32)[0]
            exact.append(torch.cat([hidden, last], 1).view(len(row["input_ids"]), -1, H))
    positions_0 = torch.tensor([i == 0 for x in exact for i in range(x.shape[0])])
    fp32 = torch.cat(exact)  # [N, 6, H]: the 5 layers and the final norm
    raw = cache_spec(recipe, H, tokenizer)
    fp8 = cache_spec(load_recipe(args.recipe, ["cache.encoding=fp8"]), H, tokenizer)
    bf16 = as_stored(fp32, raw)
    dim_rms = bf16[~positions_0].float().pow(2).mean(0, keepdim=True).sqrt().clamp(min=1e-3)

    labels = [f"layer {i}" for i in recipe.target.layer_ids] + ["final norm"]
    print(f"{fp32.shape[0]} tokens of {len(rows)} conversations, hidden {H}; errors against the bf16 raw cache")
    print(f"{'':26}" + "".join(f"{label:>12}" for label in labels))
    for title, approx, exact_states in (("fp8 (cache.encoding=fp8)", as_stored(bf16, fp8), bf16),
                                        ("int8 absmax/127", int8_round_trip(bf16.float()), bf16),
                                        ("bf16 vs fp32 (raw cache)", bf16, fp32)):
        rel, dim = errors(approx, exact_states, dim_rms)
        print(f"{title:<26}" + "".join(f"{v:>12.4f}" for v in rel) + "   rel err")
        print(f"{'':<26}" + "".join(f"{v:>12.4f}" for v in dim) + "   dim err")
    raw_hidden, fp8_hidden = bytes_per_token(raw) - 5, bytes_per_token(fp8) - 5  # less the int32 id and uint8 mask
    print(f"bytes/token: raw bf16 {bytes_per_token(raw)}, fp8 {bytes_per_token(fp8)} "
          f"({bytes_per_token(fp8) / bytes_per_token(raw):.4f}x); hidden states alone {raw_hidden} vs {fp8_hidden} "
          f"({fp8_hidden / raw_hidden:.4f}x; int8 + fp16 scales: {(len(labels) * (H + 2)) / raw_hidden:.4f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
