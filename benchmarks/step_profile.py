"""A train step's host work in online mode, at a real target's widths: seconds a micro-batch, and state bytes copied
from the device to the host.

    python benchmarks/step_profile.py                         # Qwen3-8B's shapes, 1,000-token rows, 8 micro-batches
    python benchmarks/step_profile.py --tokens 4096 --micro-batches 4 --threads 2

On a GPU a rank's micro-batch runs the target, rounds its states to the cache's dtype and encoding, pads them into the
draft's batch; what the rank's CPU does on the way is serial with the GPU. Here the device is PyTorch's `meta`: its
tensors have shapes and no data, so device work costs only its dispatch, while host work takes its real time. A copy
from the device to the host, which on `meta` would raise, is let through as a zero-filled host tensor and counted, so
code that round-trips the states through the host runs too and its bytes are known (its numbers, zeros, cost the same
to round).

The target is Qwen3-8B's architecture built on `meta` (36 layers, hidden 4096, 32/8 heads, vocabulary 151,936: no
weights are allocated) with the real Qwen3 tokenizer, and dspark_qwen3_8b's recipe: layers 1, 9, 17, 25, 33 captured
plus the final norm, bf16, fp8-encoded. Eager attention: sdpa's mask check reads one flag on the host (a sync, no state).

Per micro-batch it prints, median over --micro-batches after one warm-up: the host seconds of cutting the batch
(`make_batch`), of the states (OnlineRecords.with_hidden + attach_hidden) without the target's forward, and of the
forward's dispatch alone (on a GPU that launches kernels asynchronously, beside the device's work); the bytes and
copies from device to host. Then the projection over the recipe's micro-batches a rank a step (global batch / ranks /
micro batch size). Runs against any checkout that has these functions: copy it (and benchmarks/harness.py) into
an older tree's benchmarks/ to measure before a change. Writes --out (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from core import stage  # noqa: E402
from core.recipe import load_recipe  # noqa: E402
from data.assets import make_tiny_qwen3  # noqa: E402
from benchmarks.harness import host_copy  # noqa: E402
from data.states import capture  # noqa: E402
from data.states.online import OnlineRecords  # noqa: E402
from modeling.target import capture_hidden_states, load_tokenizer  # noqa: E402
from train.algorithms import attach_hidden, get_algorithm  # noqa: E402

QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
            "max_position_embeddings": 40960}
META = torch.device("meta")


class HostCopies(TorchDispatchMode):
    """Counts copies from `meta` to the host, answering each with a zero-filled host tensor of its shape and dtype."""

    def __init__(self):
        super().__init__()
        self.bytes = self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copy = host_copy(func, args, kwargs)
        if copy is None or copy[0].device != META:
            return func(*args, **kwargs)
        source, dtype, destination = copy
        out = torch.zeros(source.shape, dtype=dtype) if destination is None else destination.zero_()
        self._count(out)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        self.bytes += tensor.numel() * tensor.element_size()
        self.copies += 1


class TimedForward:
    """modeling.target.capture_hidden_states, adding its seconds to `seconds`."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return capture_hidden_states(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def qwen3_8b_on_meta(folder: Path):
    """(the model on meta, its tokenizer's folder): the real Qwen3 tokenizer beside Qwen3-8B's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_tiny_qwen3(str(folder), num_layers=2)  # its tokenizer files and a config to widen
    config_path = folder / "config.json"
    config = {**json.loads(config_path.read_text()), **QWEN3_8B}
    config["layer_types"] = ["full_attention"] * QWEN3_8B["num_hidden_layers"]
    config_path.write_text(json.dumps(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)),
                                                 attn_implementation="eager", dtype=torch.bfloat16)
    model.draftsmith_fingerprint = "meta"  # weights_fingerprint reads no weights
    return model.eval()


def regen_folder(folder: Path, tokenizer, tokens: int, rows: int) -> Path:
    """A finished regeneration whose conversations tokenize to about `tokens` tokens each."""
    folder.mkdir(parents=True)
    words = "The quick brown fox jumps over the lazy dog while the compiler checks every branch of the proof. "
    per_copy = len(tokenizer(words)["input_ids"])
    answer = words * max(1, (tokens - 20) // per_copy)
    records = [{"id": str(i), "conversations": [{"role": "user", "content": f"Question {i}: explain this."},
                                                {"role": "assistant", "content": answer}]} for i in range(rows)]
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    stage.mark_done(folder, {})
    return folder


def profile(args) -> dict:
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="step-profile-"))
    model = qwen3_8b_on_meta(work / "target")
    tokenizer = load_tokenizer(str(work / "target"))
    recipe = load_recipe(args.recipe, [f"target.name_or_path={work / 'target'}", "data.min_loss_tokens=1",
                                       f"data.max_length={max(args.tokens + 64, 4096)}",
                                       f"train.micro_batch_size={args.micro_batch_size}"])
    online = OnlineRecords(recipe, regen_folder(work / "regen", tokenizer, args.tokens,
                                                args.micro_batch_size * (args.micro_batches + 1)), tokenizer,
                           lambda: model)
    forward = TimedForward()
    capture.capture_hidden_states = forward  # what capture_rows calls: the target's forward, timed apart
    algo = get_algorithm(recipe.family)
    input_dtype = torch.bfloat16  # DeepSpeed's bf16 weights on a GPU
    rows = []
    with torch.no_grad():
        for m in range(args.micro_batches + 1):
            records = [online[m * args.micro_batch_size + i] for i in range(args.micro_batch_size)]
            t0 = time.perf_counter()
            # cut on the host, as the current code does wherever it runs (an older one cut on the device and copied
            # the loss mask back: a token-sized copy, not a state's)
            batch = algo.make_batch(recipe, records, seeds=[(0, 0, i) for i in range(len(records))], device="cpu")
            t1 = time.perf_counter()
            batch = {k: v.to(META) if torch.is_tensor(v) else v for k, v in batch.items()}
            forward.seconds = 0.0
            with HostCopies() as copies:
                batch = attach_hidden(batch, online.with_hidden(records), META, input_dtype)
            t2 = time.perf_counter()
            del batch
            rows.append({"tokens": int(sum(len(r["input_ids"]) for r in records)), "batch_s": t1 - t0,
                         "states_s": (t2 - t1) - forward.seconds, "forward_dispatch_s": forward.seconds,
                         "states_bytes_to_host": copies.bytes, "copies_to_host": copies.copies})
    steady = rows[1:]
    median = {key: statistics.median(r[key] for r in steady) for key in rows[0]}
    micro_per_step = recipe.train.global_batch_size // (args.ranks * recipe.train.micro_batch_size)
    host_s = median["batch_s"] + median["states_s"]
    return {"recipe": args.recipe, "threads": args.threads, "micro_batch_size": args.micro_batch_size,
            "layers": list(recipe.target.layer_ids), "encoding": recipe.cache.encoding, "per_micro_batch": median,
            "host_s_per_micro_batch": host_s, "micro_batches_per_rank_step": micro_per_step,
            "host_s_per_step": host_s * micro_per_step,
            "states_bytes_to_host_per_step": median["states_bytes_to_host"] * micro_per_step}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--recipe", default="dspark_qwen3_8b", help="a Qwen3-8B recipe (its layers, encoding, batch)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens a row (default 1000)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches timed after one warm-up")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="rows a micro-batch (the recipe's: 1)")
    parser.add_argument("--ranks", type=int, default=8, help="ranks the step's global batch is split over (8 GPUs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: what torchrun gives each of 8 ranks a node, OMP_NUM_THREADS=1)")
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    result = profile(args)
    m = result["per_micro_batch"]
    print(f"[step_profile] {result['recipe']}: {m['tokens']:.0f} tokens a micro-batch, layers {result['layers']} + final "
          f"norm, {result['encoding']}, {result['threads']} thread(s)")
    print(f"  per micro-batch: cut {m['batch_s'] * 1e3:.1f} ms, states {m['states_s'] * 1e3:.1f} ms (host work), "
          f"target forward's dispatch {m['forward_dispatch_s'] * 1e3:.1f} ms (async on a GPU); "
          f"{m['states_bytes_to_host'] / 1e6:.1f} MB in {m['copies_to_host']:.0f} copies device -> host")
    print(f"  per step ({result['micro_batches_per_rank_step']} micro-batches a rank): host work "
          f"{result['host_s_per_step']:.2f} s, states to the host {result['states_bytes_to_host_per_step'] / 1e9:.2f} GB")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
