"""Peak CPU memory of train.loss.block_loss forward + backward at the Qwen3 vocabulary: chunked vs naive.

    .venv/bin/python benchmarks/loss_memory.py                 # defaults: V=151936, gamma 7, 512 anchors, H=64
    .venv/bin/python benchmarks/loss_memory.py --naive-full    # also measure the naive form at full size if it fits
    .venv/bin/python benchmarks/loss_memory.py --weights dflash --anchors 256

Variants:
  naive    block_loss(chunk_size=N, use_checkpoint=False): every anchor in one piece, nothing recomputed; the
           [N, gamma, V] tensors of the forward stay alive for the backward.
  chunked  block_loss with the default chunk size (largest chunk whose fp32 [chunk, gamma, V] tensor is <= 256 MiB)
           and per-chunk activation checkpointing (the default).

Measurement: every (variant, anchors) runs in a fresh subprocess. The worker builds a small stand-in drafter
(H=64 projection, frozen lm_head H->V, rank-16 Markov bias, confidence head; the vocabulary axis is what costs
memory) and its inputs, warms the kernels up on a tiny problem, then resets the kernel's peak-RSS mark
(`echo 5 > /proc/self/clear_refs`) and records its RSS. After forward + backward it reads the peak (VmHWM) and reports
peak minus that baseline. Where clear_refs is not writable it falls back to getrusage(ru_maxrss) minus the baseline
(an upper bound). RSS is honest here because PyTorch's CPU allocator does not cache, and glibc serves and returns
blocks this large with mmap/munmap, so RSS follows the live tensor bytes. The figure includes everything the step
allocates (gradients of the stand-in's parameters, about 20 MB of them, are the same in both variants). tracemalloc
would see none of it: tensor storage is not allocated through Python's allocator.

The naive form at 512 anchors needs tens of GB, so by default it is measured at fewer anchors (--naive-anchors) and
extrapolated linearly in N to the full size; the table labels that row as extrapolated. --naive-full measures it
too when the extrapolated peak fits in MemAvailable with margin.

Example output (2 CPU cores; an example of the format, not a claim about your machine):

    vocab 151936, gamma 7, hidden 64, weights ce=0.1 l1=0.9 conf=1.0, torch threads 2
    one fp32 [N, gamma, V] tensor at N=512: 2.18 GB (theoretical)
    variant                    anchors  chunk  peak delta     time  note
    naive (1 chunk, no ckpt)        64     64     1.38 GB     5.8s  measured
    naive (1 chunk, no ckpt)       128    128     2.74 GB    13.1s  measured
    naive (1 chunk, no ckpt)       512    512    10.91 GB           EXTRAPOLATED linearly from N=[64, 128] (...)
    chunked (auto, ckpt)           128     63     1.42 GB    11.0s  measured
    chunked (auto, ckpt)           512     63     1.43 GB    57.4s  measured
    chunk tensor: fp32 [63, 7, 151936] = 0.27 GB; chunked peak = 5.3 such tensors
    ratio naive/chunked at N=512: 7.6x (naive extrapolated)
    method: peak RSS (VmHWM reset via /proc/self/clear_refs) minus RSS just before the loss, fresh process per variant
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = {"dspark": (0.1, 0.9, 1.0), "dflash": (1.0, 0.0, 0.0)}
GB = 1e9


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(cfg: dict) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from train.loss import block_loss

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    n, gamma, hidden, vocab, rank = cfg["anchors"], cfg["gamma"], cfg["hidden"], cfg["vocab"], 16

    class Drafter(nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.proj = nn.Linear(hidden, hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
            self.markov_w1 = nn.Embedding(vocab, rank)
            self.markov_w2 = nn.Linear(rank, vocab, bias=False)
            self.conf_head = nn.Linear(hidden + rank, 1)

        def draft_logits(self, h, prev_ids, vocab_ids=None):  # block_loss passes its vocab_ids (None here)
            return F.linear(self.proj(h), self.lm_head.weight) + self.markov_w2(self.markov_w1(prev_ids))

        def confidence_logits(self, h, prev_ids):
            return self.conf_head(torch.cat([h, self.markov_w1(prev_ids)], -1)).squeeze(-1)

    def inputs(n, vocab):
        return dict(
            draft_hidden=torch.randn(n, gamma, hidden, requires_grad=True),
            target_hidden=torch.randn(n, gamma, hidden),
            labels=torch.randint(0, vocab, (n, gamma)),
            prev_ids=torch.randint(0, vocab, (n, gamma)),
            valid=torch.ones(n, gamma, dtype=torch.bool),
        )

    ce, l1, conf = cfg["weights"]
    kw = dict(ce_alpha=ce, l1_alpha=l1, conf_alpha=conf, gamma_decay=4.0)
    if cfg["variant"] == "naive":
        kw.update(chunk_size=n, use_checkpoint=False)

    # Warm-up on a tiny problem: loads kernels and thread pools so they are not charged to the loss.
    block_loss(Drafter(97), **inputs(4, 97), **{**kw, "chunk_size": 2}).loss_sum.backward()
    model, batch = Drafter(vocab), inputs(n, vocab)

    exact = _reset_peak()
    base = _rss_bytes()
    t0 = time.perf_counter()
    out = block_loss(model, **batch, **kw)
    out.loss_sum.backward()
    seconds = time.perf_counter() - t0
    peak = _hwm_bytes() if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from train.loss import DEFAULT_CHUNK_BYTES, auto_chunk_size

    chunk = n if cfg["variant"] == "naive" else min(n, auto_chunk_size(gamma * vocab * 4, DEFAULT_CHUNK_BYTES))
    return dict(peak_delta=peak - base, seconds=seconds, chunk=chunk, exact=exact,
                loss=float(out.loss_sum) / float(out.weight_sum))


def run_variant(variant: str, anchors: int, args) -> dict:
    cfg = dict(variant=variant, anchors=anchors, gamma=args.gamma, hidden=args.hidden, vocab=args.vocab,
               weights=WEIGHTS[args.weights], threads=args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        return dict(error=f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the measurement method.")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size (default: Qwen3's 151936)")
    ap.add_argument("--gamma", type=int, default=7, help="block size (predictions per anchor)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the stand-in drafter")
    ap.add_argument("--anchors", type=int, default=512, help="anchors N for the chunked run and the extrapolation")
    ap.add_argument("--naive-anchors", type=int, nargs="+", default=[64, 128],
                    help="anchor counts at which the naive form is measured (two or more give a linear fit)")
    ap.add_argument("--naive-full", action="store_true",
                    help="also measure the naive form at --anchors when the extrapolation says it fits in RAM")
    ap.add_argument("--chunked-anchors", type=int, nargs="*", default=[128],
                    help="extra anchor counts for the chunked form, to show its peak does not grow with N")
    ap.add_argument("--weights", choices=sorted(WEIGHTS), default="dspark",
                    help="loss weights: dspark = ce 0.1, l1 0.9, conf 1.0; dflash = ce 1.0 only")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    n, v, g = args.anchors, args.vocab, args.gamma
    ce, l1, conf = WEIGHTS[args.weights]
    print(f"vocab {v}, gamma {g}, hidden {args.hidden}, weights ce={ce} l1={l1} conf={conf}, "
          f"torch threads {args.threads}")
    print(f"one fp32 [N, gamma, V] tensor at N={n}: {n * g * v * 4 / GB:.2f} GB (theoretical)")
    rows = []

    def show(name, anchors, res, note):
        if "error" in res:
            line = f"{name:<26}{anchors:>8}  {'-':>5}  {'-':>10}  {'-':>7}  FAILED {res['error']}"
        else:
            line = (f"{name:<26}{anchors:>8}  {res['chunk']:>5}  {res['peak_delta'] / GB:>7.2f} GB  "
                    f"{res['seconds']:>6.1f}s  {note}")
        rows.append(line)
        print(line, flush=True)

    print(f"{'variant':<26}{'anchors':>8}  {'chunk':>5}  {'peak delta':>10}  {'time':>7}  note")
    naive = {}
    for a in args.naive_anchors:
        res = run_variant("naive", a, args)
        show("naive (1 chunk, no ckpt)", a, res, "measured")
        if "error" not in res:
            naive[a] = res["peak_delta"]

    extrap = None
    if len(naive) >= 2:
        xs, ys = list(naive), [naive[a] for a in naive]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        extrap = my + slope * (n - mx)
        line = (f"{'naive (1 chunk, no ckpt)':<26}{n:>8}  {n:>5}  {extrap / GB:>7.2f} GB  {'':>7}  "
                f"EXTRAPOLATED linearly from N={xs} (slope = {slope / (g * v * 4):.1f} live fp32 "
                f"[N, gamma, V] tensors), not measured")
        print(line, flush=True)

    naive_full = None
    if args.naive_full:
        avail = mem_available()
        if extrap is not None and extrap * 1.25 < avail:
            naive_full = run_variant("naive", n, args)
            show("naive (1 chunk, no ckpt)", n, naive_full, "measured")
        else:
            print(f"naive at N={n} skipped: needs ~{(extrap or 0) / GB:.1f} GB, MemAvailable {avail / GB:.1f} GB")

    chunked = None
    for a in [*args.chunked_anchors, n]:
        res = run_variant("chunked", a, args)
        show("chunked (auto, ckpt)", a, res, "measured")
        if a == n:
            chunked = res

    if chunked and "error" not in chunked:
        c = chunked["peak_delta"]
        print(f"chunk tensor: fp32 [{chunked['chunk']}, {g}, {v}] = {chunked['chunk'] * g * v * 4 / GB:.2f} GB; "
              f"chunked peak = {c / (chunked['chunk'] * g * v * 4):.1f} such tensors")
        if naive_full and "error" not in naive_full:
            print(f"ratio naive/chunked at N={n}: {naive_full['peak_delta'] / c:.1f}x (both measured)")
        if extrap is not None:
            print(f"ratio naive/chunked at N={n}: {extrap / c:.1f}x (naive extrapolated)")
    method = "VmHWM reset via /proc/self/clear_refs" if (chunked or {}).get("exact", True) else "getrusage ru_maxrss"
    print(f"method: peak RSS ({method}) minus RSS just before the loss, fresh process per variant")


if __name__ == "__main__":
    main()
