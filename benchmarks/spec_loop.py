"""The speculative loop against its own limit, side by side with HF `generate` in one process.

    python benchmarks/spec_loop.py                                  # SmolLM2, 8 MT-bench prompts, oracle + n-gram
    python benchmarks/spec_loop.py --draft dspark=runs/x/train/final --draft eagle3=runs/y/train/final

For each prompt the target decodes greedily three ways: our plain loop (the reference output and the per-token step
time), HF `generate` at batch 1, and the speculative loop with each drafter:
  oracle  proposes the target's own greedy continuation, precomputed, at no draft cost: every draft is accepted, so
          its speedup over the step time is what the loop itself allows (limit = (gamma+1) x step / verify);
  ngram   prompt lookup, free, the baseline any trained drafter must beat;
  NAME=DIR  each trained draft folder given with --draft; with --full-vocab a block draft that has a token map
          (token_map.pt: it drafts among the tokens it was trained over) runs a second time as NAME/full, drafting
          over the whole vocabulary as the serving engines do.
Prints per drafter: tau, decode tok/s, speedup over our loop and over HF generate, where a round's time goes (draft /
verify / other ms), the share of the tau limit the loop reaches, and draft cost / verify cost. Writes
OUT/spec_loop.json and OUT/spec_loop.md. Every output is checked equal to the plain loop's (lossless).

`--kernels torch,onednn` times everything twice per prompt, alternating, with the frozen models' CPU products as
torch's own (MKL on x86) and as oneDNN over prepacked weights (modeling/cpu_linear.py, what every loaded target and
evaluated draft uses), and prints the ratios side by side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.io import atomic_write_json, atomic_write_text  # noqa: E402
from core.malloc import keep_freed_memory  # noqa: E402
from data.sources.prompts import eval_prompts  # noqa: E402
from eval.report import acceptance_metrics, round_timing  # noqa: E402
from eval.run import first_turn_ids, hf_generate_result  # noqa: E402
from eval.lookup import NgramDrafter  # noqa: E402
from eval.spec_decode import Decoding, OracleDrafter, load_draft, speculative_generate, target_generate  # noqa: E402
from modeling import cpu_linear  # noqa: E402
from modeling.target import SMOLLM2, load_target, load_tokenizer  # noqa: E402


def parse_drafts(items: list[str]) -> dict[str, str]:
    drafts = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--draft {item!r}: expected NAME=DIR, e.g. --draft dspark=runs/x/train/final")
        if not (Path(path) / "config.json").is_file():
            raise SystemExit(f"--draft {item!r}: {path} holds no config.json; give a trained draft folder "
                             "(a run's train/final or opd/final)")
        drafts[name] = path
    return drafts


def summarise(name: str, results: list, gamma: int, target_decode_s: float, target_tokens: int,
              hf_tokens_per_s: float) -> dict:
    rounds = [r for result in results for r in result.rounds]
    decode_s = sum(r.wall_s - r.prefill_s for r in results)
    tokens = sum(len(r.ids) for r in results)
    timing = round_timing(rounds, gamma, spec_decode_s=decode_s, spec_tokens=tokens,
                          target_decode_s=target_decode_s, target_tokens=target_tokens)
    tokens_per_s = tokens / (sum(r.wall_s for r in results) or 1.0)
    return {"drafter": name, "tau": acceptance_metrics(rounds, gamma)["accept_len"],
            "tokens_per_s": tokens_per_s, "speedup_vs_generate": tokens_per_s / hf_tokens_per_s, **timing}


def markdown(report: dict) -> str:
    lines = [f"# Speculative loop vs its limit: {report['target']}, {report['num_prompts']} {report['dataset']} "
             f"prompts, {report['max_new_tokens']} tokens, gamma {report['gamma']}, {report['threads']} threads, "
             f"{report['kernels']} products", "",
             f"Plain loop: {report['target_step_ms']:.1f} ms a token ({1e3 / report['target_step_ms']:.1f} tok/s "
             f"decode); HF generate: {report['hf_generate_tokens_per_s']:.1f} tok/s (prefill included); "
             f"a {report['gamma'] + 1}-token verify costs {report['verify_vs_step']:.2f} steps, so the limit is "
             f"{report['limit_speedup']:.2f}x.", "",
             "| drafter | tau | tok/s | decode speedup | vs HF generate | draft ms | verify ms | other ms | "
             "of tau limit | draft / verify |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["drafters"]:
        lines.append(f"| {row['drafter']} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} | "
                     f"{row['decode_speedup']:.2f}x | {row['speedup_vs_generate']:.2f}x | {row['draft_ms']:.1f} | "
                     f"{row['verify_ms']:.1f} | {row['other_ms']:.1f} | {row['loop_efficiency']:.0%} | "
                     f"{row['draft_vs_verify']:.0%} |")
    oracle = report["drafters"][0]
    lines += ["", f"Oracle: {oracle['decode_speedup']:.2f}x of the plain loop = "
                  f"{oracle['decode_speedup'] / report['limit_speedup']:.0%} of the limit "
                  f"{report['limit_speedup']:.2f}x (goal >= 85%)."]
    return "\n".join(lines) + "\n"


def use_kernels(kind: str, models: list) -> None:
    """Frozen models' CPU products: "onednn" (prepacked, as loaded) or "torch" (torch's own)."""
    for model in models:
        (cpu_linear.pack_linears if kind == "onednn" else cpu_linear.unpack_linears)(model)


def kind_report(args, kind: str, references: list, hf: list, results: dict) -> dict:
    target_decode_s = sum(r.wall_s - r.prefill_s for r in references)
    target_tokens = sum(len(r.ids) for r in references)
    hf_tokens_per_s = sum(len(r.ids) for r in hf) / sum(r.wall_s for r in hf)
    rows = [summarise(name, res, args.gamma, target_decode_s, target_tokens, hf_tokens_per_s)
            for name, res in results.items()]
    oracle = rows[0]
    return {"target": args.target, "dataset": args.dataset, "num_prompts": len(references), "gamma": args.gamma,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "kernels": kind,
            "target_step_ms": oracle["target_step_ms"], "verify_vs_step": oracle["verify_vs_step"],
            "limit_speedup": oracle["limit_speedup"], "hf_generate_tokens_per_s": hf_tokens_per_s,
            "plain_loop_tokens_per_s": target_tokens / sum(r.wall_s for r in references),
            "hf_generate_match": sum(h.ids == r.ids for h, r in zip(hf, references)) / len(references),
            "oracle_of_limit": oracle["decode_speedup"] / oracle["limit_speedup"], "drafters": rows}


def kernels_markdown(reports: dict, base: str, new: str) -> str:
    """How much faster `new` kernels run each part than `base` ones, measured alternating in the same run."""
    b, n = reports[base], reports[new]
    lines = ["", f"## {new} against {base} products (same prompts, alternating in one run; ratio = {base} time / "
             f"{new} time)", "", "| part | " + base + " | " + new + " | ratio |", "|---|---|---|---|",
             f"| plain loop, ms a token | {b['target_step_ms']:.1f} | {n['target_step_ms']:.1f} | "
             f"{b['target_step_ms'] / n['target_step_ms']:.2f}x |",
             f"| HF generate, tok/s | {b['hf_generate_tokens_per_s']:.1f} | {n['hf_generate_tokens_per_s']:.1f} | "
             f"{n['hf_generate_tokens_per_s'] / b['hf_generate_tokens_per_s']:.2f}x |"]
    for row_b, row_n in zip(b["drafters"], n["drafters"]):
        for part in ("draft_ms", "verify_ms"):
            if row_b[part] >= 0.5:  # the oracle's and n-gram's drafts cost nothing to speak of
                lines.append(f"| {row_b['drafter']} {part.replace('_ms', '')}, ms a round | {row_b[part]:.1f} | "
                             f"{row_n[part]:.1f} | {row_b[part] / row_n[part]:.2f}x |")
        lines.append(f"| {row_b['drafter']} decode tok/s | {row_b['tokens_per_s']:.1f} | {row_n['tokens_per_s']:.1f} "
                     f"| {row_n['tokens_per_s'] / row_b['tokens_per_s']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--target", default=SMOLLM2, help="HF id or path, or smollm2-135m-instruct (default)")
    parser.add_argument("--dataset", default="mtbench", help="prompt set (mtbench, humaneval, gsm8k, a .jsonl path)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=7, help="drafts per round (a verify checks gamma+1 tokens)")
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=DIR",
                        help="a trained draft folder to time beside the oracle and n-gram (repeatable)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads (default: every core torch sees)")
    parser.add_argument("--kernels", default="onednn",
                        help="the frozen models' CPU products, comma-separated to time them side by side: onednn "
                             "(prepacked, what loads use; default) and/or torch (torch's own: MKL on x86)")
    parser.add_argument("--full-vocab", action="store_true",
                        help="also time each draft with a token map over the whole vocabulary (NAME/full)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/spec_loop")
    args = parser.parse_args(argv)
    drafts = parse_drafts(args.draft)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels or set(kernels) - {"onednn", "torch"}:
        raise SystemExit(f"--kernels {args.kernels!r}: expected onednn, torch or both, e.g. --kernels torch,onednn")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as eval.py and train/main.py do (core/malloc.py)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    target = load_target(args.target, "cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(args.target)
    prompts = [first_turn_ids(tokenizer, p, None, False)
               for p in eval_prompts(args.dataset, args.num_prompts, args.seed)]
    eos = tokenizer.eos_token_id
    trained = {name: load_draft(path, target) for name, path in drafts.items()}
    if args.full_vocab:
        trained.update({f"{name}/full": load_draft(drafts[name], target, full_vocab=True)
                        for name, drafter in list(trained.items()) if getattr(drafter.model, "draft_vocab", None)
                        is not None})

    models = [target, *(drafter.model for drafter in trained.values())]
    runs = {kind: ([], [], {name: [] for name in ["oracle", "ngram", *trained]}) for kind in kernels}
    for ids in tqdm(prompts, desc="spec loop", unit="prompt"):
        for kind in kernels:  # alternating per prompt: a drift of the machine's speed hits every kind alike
            use_kernels(kind, models)
            references, hf, results = runs[kind]
            reference = target_generate(target, ids, args.max_new_tokens, eos_token_id=eos)
            references.append(reference)
            hf.append(hf_generate_result(target, tokenizer, ids, args.max_new_tokens))
            drafters = {"oracle": OracleDrafter(ids, reference.ids, args.gamma),
                        "ngram": NgramDrafter(gamma=args.gamma), **trained}
            for name, drafter in drafters.items():
                result = speculative_generate(target, drafter, ids, Decoding(
                    gamma=args.gamma, max_new_tokens=args.max_new_tokens, eos_token_id=eos))
                if result.ids != reference.ids:
                    raise SystemExit(f"{name}: speculative output differs from the plain loop's on a prompt: "
                                     "not lossless")
                results[name].append(result)
    reports = {kind: kind_report(args, kind, *runs[kind]) for kind in kernels}
    report = {**reports[kernels[-1]], "by_kernels": reports} if len(kernels) > 1 else reports[kernels[0]]
    text = "\n".join(markdown(r) for r in reports.values())
    if len(kernels) > 1:
        text += kernels_markdown(reports, kernels[0], kernels[-1])
    atomic_write_json(out / "spec_loop.json", report)
    atomic_write_text(out / "spec_loop.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
