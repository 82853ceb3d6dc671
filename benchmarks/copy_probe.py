"""Which captured layer names the previous token: a probe for the copy start (train/copy_init.py).

Prompt lookup proposes the token that *followed* an earlier occurrence of the pending token. An attention head does
the same when the key at position j names token j-1 (the previous token) and the value names token j: the match then
lands one position after the earlier occurrence, and what it copies is the text, not the target's prediction there.
That needs a captured layer whose state at j carries token j-1. This script fits, for each captured layer (and for
all of them together, as the drafter's fc reads them), a ridge read from the state at j to the embedding of token j
(the current token, which the copy start's key reads from the first layer) and to that of token j-1, on a run's
training cache, and reports on held-out records how often the read's nearest embedding is the right token: over all
of the hidden size and over the copy start's 24 match dimensions (its leading directions). Then both copy starts
(draft.copy_follows: prediction, the recipes' till now, and text), fitted and untrained, replayed on the held-out
records over the whole vocabulary: their first draft where prompt lookup's is right and elsewhere, and their tau.

    python benchmarks/copy_probe.py --run runs/default --heldout runs/quality/eval-data   # ~1 min, 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.harness import open_eval_cache  # noqa: E402
from core.recipe import load_recipe  # noqa: E402
from data.states.capture import open_cache  # noqa: E402
from modeling.target import load_target_parts, load_tokenizer, target_hidden_size  # noqa: E402
from train.copy_init import MATCH_DIMS, _leading_directions, _ridge  # noqa: E402


def positions(cache, count: int, layers: int, hidden: int):
    """(states [N, layers, H], current token [N], previous token [N]) of positions 1.. of the first `count` records."""
    states, current, previous = [], [], []
    for start in range(0, min(count, len(cache)), 8):
        for record in cache.with_hidden([cache[i] for i in range(start, min(start + 8, count, len(cache)))]):
            ids = record["input_ids"].long().cpu()
            states.append(record["hidden_states"][1:].cpu().double().view(-1, layers, hidden))
            current.append(ids[1:])
            previous.append(ids[:-1])
    return torch.cat(states), torch.cat(current), torch.cat(previous)


def accuracy(x: torch.Tensor, read: torch.Tensor, embed: torch.Tensor, truth: torch.Tensor,
             dirs: torch.Tensor | None) -> float:
    """Share of positions whose read (x @ read) is nearest, by dot product, to the true token's embedding; in the
    `dirs` subspace where given (the copy start matches there)."""
    table = embed if dirs is None else embed @ dirs.T
    right = 0
    for start in range(0, x.shape[0], 1024):
        guess = x[start:start + 1024] @ read
        if dirs is not None:
            guess = guess @ dirs.T
        right += int(((guess @ table.T).argmax(-1) == truth[start:start + 1024]).sum())
    return right / x.shape[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--run", type=Path, required=True, help="a run with a finished cache stage (its recipe.yaml)")
    parser.add_argument("--heldout", type=Path, required=True,
                        help="a held-out run's folder (quality.py's OUT/eval-data: the held-out prompts, cached raw)")
    parser.add_argument("--fit-records", type=int, default=256, help="training records the reads are fitted on")
    parser.add_argument("--eval-records", type=int, default=36, help="held-out records they are scored on")
    args = parser.parse_args()
    torch.manual_seed(0)
    recipe = load_recipe(str(args.run / "recipe.yaml"))
    name = recipe.target.name_or_path
    hidden, layer_ids = target_hidden_size(name), list(recipe.target.layer_ids)
    tokenizer = load_tokenizer(name)
    embed = load_target_parts(name, "cpu").get_input_embeddings().weight.detach().double()
    fit_cache = open_cache(recipe, args.run / "cache", hidden, tokenizer)
    held_cache = open_eval_cache(str(args.run / "recipe.yaml"), args.heldout)
    fit = positions(fit_cache, args.fit_records, len(layer_ids), hidden)
    held = positions(held_cache, args.eval_records, len(layer_ids), hidden)
    print(f"fitted on {fit[0].shape[0]} positions of {args.fit_records} training records, scored on "
          f"{held[0].shape[0]} of {args.eval_records} held-out records; nearest embedding of {embed.shape[0]}")
    print(f"\n| captured layer | token j, all {hidden} dims | token j, {MATCH_DIMS} match dims | "
          f"token j-1, all dims | token j-1, {MATCH_DIMS} match dims |\n|---|---|---|---|---|")
    reads = [(f"{layer_ids[k]}", slice(k, k + 1)) for k in range(len(layer_ids))] + [("all together", slice(None))]
    for label, which in reads:
        x_fit, x_held = (x[:, which].flatten(1) for x in (fit[0], held[0]))
        gram = x_fit.T @ x_fit
        cells = []
        for column in (1, 2):  # current token, previous token
            read = _ridge(gram, x_fit.T @ embed[fit[column]], 1e-2)
            dirs = _leading_directions(gram, read, MATCH_DIMS)
            cells += [accuracy(x_held, read, embed, held[column], None),
                      accuracy(x_held, read, embed, held[column], dirs)]
        print(f"| {label} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)
    print_copy_starts(args.run, recipe, fit_cache, held_cache, tokenizer.eos_token_id)
    return 0


def print_copy_starts(run: Path, recipe, fit_cache, held_cache, eos_token_id) -> None:
    """Both copy starts (draft.copy_follows prediction and text), fitted on the run's cache and untrained, replayed
    on the held-out records over the whole vocabulary: how often the first draft is right where prompt lookup is."""
    from benchmarks.harness import replay_model
    from eval.replay import replay_records
    from modeling.target import load_target
    from train.algorithms import BlockAlgorithm

    target = load_target(recipe.target.name_or_path, "cpu")
    records = [held_cache[i] for i in range(len(held_cache))]
    print("\n| copy start (untrained, replayed) | first draft right where lookup is | elsewhere | tau |\n"
          "|---|---|---|---|")
    for follows in ("prediction", "text"):
        copying = load_recipe(str(run / "recipe.yaml"), [f"draft.copy_follows={follows}", "draft.init_copy=trained"])
        torch.manual_seed(copying.seed)
        draft = BlockAlgorithm.build(copying, target, fit_cache).draft.eval()
        with torch.no_grad():
            replay = replay_records(replay_model(draft, True), records, 7, 128, eos_token_id)
        print(f"| {follows} | {replay['first_draft_right_at_lookup_hits']:.3f} | "
              f"{replay['first_draft_right_elsewhere']:.3f} | {replay['accept_len']:.3f} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
