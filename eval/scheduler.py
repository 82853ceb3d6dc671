"""DSpark's throughput-aware verify scheduler (paper section 3.2, Algorithm 1), the SPS cost table it reads, and an
offline simulator that compares it with fixed draft lengths.

Notation. A verify batch holds R requests; request r verifies its anchor plus its first l_r drafts, so the batch
has B = sum_r (1 + l_r) tokens. With survival a_{r,j} = prod_{i<=j} c_{r,i} (calibrated confidences, see
eval/calibration.py) the expected accepted tokens, bonus included, are tau = sum_r (1 + sum_{j<=l_r} a_{r,j}), and
the scheduler maximises the expected throughput Theta = tau * SPS(B), where SPS(B) is the target's verify steps per
second at B tokens, profiled once (``profile_sps``) and stored in SGLang's ``SpsCostTable`` JSON
(``--speculative-dspark-sps-table-path``):

    {"sample_batch_tokens": [1, 8, 64, ...], "sample_steps_per_sec": [...], "max_batch_tokens": 512}

``SpsTable.sps(B)`` reads the table the way SGLang's planner does (``SpsCostTable.lookup``): the value of the
largest sample <= B, the first sample's value below the first, the last sample's value past the last (no
interpolation), so the simulated decisions are the ones SGLang makes from the same file. ``schedule_batch`` still
treats ``max_batch_tokens`` as a hard capacity: the profile says nothing about larger batches.

Lossless property. Speculative sampling stays exact only if the decision to verify draft x_{r,k} does not depend on
x_{r,k} itself. c_{r,k} is computed from W1[x_{r,k-1}] (the Markov head sees the previous draft), so a_{r,k}
depends on x_{r,1..k-1} only, while a_{r,k+1} already depends on x_{r,k}. Algorithm 1 is causal: pairs are visited
by decreasing survival with ties going to the lower position, so every pair (r, j > k) comes after (r, k), and the
admission of (r, k) is decided from the pairs before it alone; the early stop ends the scan at the first admission
that does not raise Theta and never looks past it. A global search for the best prefix of the order (the
production variant without the break) would let a_{r,k+1}, hence x_{r,k}, decide whether x_{r,k} is verified;
the paper's Appendix A shows the output distribution then drifts ((0.85, 0.15) instead of (0.7, 0.3)).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from eval.calibration import cumulative_confidence, logits_from_probs
from export.serving import SpsTable



def profile_sps(step_fn: Callable[[int], object], batch_tokens: Sequence[int], repeats: int = 3, warmup: int = 1,
                max_batch_tokens: int | None = None, clock: Callable[[], float] = time.perf_counter,
                interleave: bool = False) -> SpsTable:
    """Time ``step_fn(B)`` (one target verify step over B tokens) at each B; steps/sec = 1 / median wall time.

    ``step_fn`` must block until the step is done (call ``torch.cuda.synchronize()`` inside it on a GPU). Each B
    gets ``warmup`` untimed calls first (CUDA graphs, allocator, autotuning). ``max_batch_tokens`` defaults to the
    largest B. ``clock`` is injectable for tests.

    interleave: time the sizes in ``repeats`` sweeps (every B once a sweep) instead of B after B. Where the sizes
    differ by a few percent and the machine's speed drifts by as much over a second (a shared CPU), drift then moves
    all sizes alike instead of whichever was timed last.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats} warmup={warmup}")
    sizes = sorted(set(int(b) for b in batch_tokens))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_tokens must be a non-empty list of ints >= 1, got {list(batch_tokens)}")
    times = {b: [] for b in sizes}

    def timed(b: int) -> None:
        t0 = clock()
        step_fn(b)
        times[b].append(clock() - t0)

    if interleave:
        for b in sizes:
            for _ in range(warmup):
                step_fn(b)
        for _ in range(repeats):
            for b in sizes:
                timed(b)
    else:
        for b in sizes:
            for _ in range(warmup):
                step_fn(b)
            for _ in range(repeats):
                timed(b)
    rates = []
    for b in sizes:
        med = statistics.median(times[b])
        if not med > 0:
            raise RuntimeError(f"step_fn({b}) took {med} s by the clock; cannot turn that into steps/second")
        rates.append(1.0 / med)
    return SpsTable(tuple(sizes), tuple(rates), sizes[-1] if max_batch_tokens is None else int(max_batch_tokens))


# --- Algorithm 1 --------------------------------------------------------------------------------------------------

@dataclass
class Allocation:
    """Draft lengths l_r per request, verify tokens B, expected tau (sum over requests, bonus included), Theta."""

    lengths: list[int]
    batch_tokens: int
    tau: float
    theta: float
    admitted: list[tuple[int, int]] = field(default_factory=list)  # (r, j) in admission order
    stop: str = "exhausted"  # early_stop | capacity | exhausted | fixed


def _check_survival(survival) -> list[np.ndarray]:
    out = []
    for r, a in enumerate(survival):
        if hasattr(a, "detach"):
            a = a.detach().cpu().double().numpy()
        a = np.asarray(a, dtype=np.float64).reshape(-1)
        if not (np.isfinite(a).all() and ((a >= 0) & (a <= 1)).all()):
            raise ValueError(f"survival[{r}] must hold probabilities in [0, 1], got {a.tolist()}")
        if (np.diff(a) > 0).any():
            raise ValueError(f"survival[{r}] must be non-increasing (a cumulative product of confidences), got "
                             f"{a.tolist()}; np.cumprod of the per-position confidences gives that")
        out.append(a)
    return out


def schedule_batch(survival, sps: SpsTable) -> Allocation:
    """Algorithm 1: greedy, causal choice of per-request draft lengths maximising Theta = tau * SPS(B).

    Start with l_r = 0 (B = R, tau = R, Theta_best = R * SPS(R)); visit every (r, j) by a_{r,j} descending (ties:
    lower j, then lower r); admitting one sets B += 1, tau += a_{r,j}. Stop at the first pair whose Theta <=
    Theta_best (the causal early stop; that pair is not admitted) or that would exceed ``sps.max_batch_tokens``;
    otherwise admit it and set Theta_best = Theta. Non-increasing survival (checked) makes every visited pair extend
    its request's prefix (j == l_r + 1). See the module docstring for why this keeps speculative sampling lossless.

    ``survival``: one array a_{r,1..n_r} per request (n_r may differ, 0 included).
    """
    a = _check_survival(survival)
    n_req = len(a)
    if n_req == 0:
        return Allocation([], 0, 0.0, 0.0)
    if n_req > sps.max_batch_tokens:
        raise ValueError(f"{n_req} requests need {n_req} verify tokens, more than max_batch_tokens="
                         f"{sps.max_batch_tokens}")
    lengths = [0] * n_req
    b, tau = n_req, float(n_req)
    best = tau * sps.sps(b)
    admitted: list[tuple[int, int]] = []
    order = sorted((-float(a[r][j - 1]), j, r) for r in range(n_req) for j in range(1, a[r].size + 1))
    stop = "exhausted"
    for neg_a, j, r in order:
        assert j == lengths[r] + 1, f"pair ({r}, {j}) does not extend request {r}'s prefix of {lengths[r]}"
        if b + 1 > sps.max_batch_tokens:
            stop = "capacity"
            break
        theta = (tau - neg_a) * sps.sps(b + 1)
        if theta <= best:
            stop = "early_stop"
            break
        b, tau, best = b + 1, tau - neg_a, theta
        lengths[r] = j
        admitted.append((r, j))
    return Allocation(lengths, b, tau, best, admitted, stop)


def fixed_gamma(survival, sps: SpsTable, gamma: int) -> Allocation:
    """Every request verifies min(gamma, n_r) drafts; tau and Theta as in ``schedule_batch`` (B must fit the table)."""
    if int(gamma) < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    a = _check_survival(survival)
    lengths = [min(int(gamma), x.size) for x in a]
    b = sum(1 + n for n in lengths)
    if b > sps.max_batch_tokens:  # the same capacity schedule_batch respects (sps(B) itself clamps, like SGLang)
        raise ValueError(f"fixed gamma={gamma} needs {b} verify tokens, more than max_batch_tokens="
                         f"{sps.max_batch_tokens}")
    tau = float(sum(1.0 + float(x[:n].sum()) for x, n in zip(a, lengths)))
    theta = tau * sps.sps(b) if a else 0.0
    admitted = [(r, j) for r, n in enumerate(lengths) for j in range(1, n + 1)]
    return Allocation(lengths, b, tau, theta, admitted, "fixed")


class VerifySchedule:
    """Algorithm 1 inside the batch-size-1 decode loop (``eval.py --schedule confidence``): each round verifies the
    prefix of the drafts that ``schedule_batch`` admits for one request, from the drafter's confidences calibrated
    with the STS temperatures (sts.json; None: as the head gives them) and the target's verify cost (an SpsTable).

    At one request the scan visits the positions in order and stops at the first draft whose expected tokens do not
    pay for the longer verify, so draft k is verified or not from c_1..c_k alone, which depend on drafts < k only: the
    loop stays lossless (module docstring), at T=0 and under rejection sampling alike."""

    def __init__(self, sps: SpsTable, temperatures: Sequence[float] | None = None):
        self.sps = sps
        self.temperatures = None if temperatures is None else np.asarray(temperatures, dtype=np.float64)

    def __call__(self, confidences: Sequence[float]) -> int:
        """How many of the drafts (one confidence each) to verify this round."""
        if len(confidences) == 0:
            return 0
        logits = logits_from_probs(np.asarray(confidences, dtype=np.float64)[None, :], eps=1e-6)
        temperatures = None if self.temperatures is None else self.temperatures[: logits.shape[1]]
        return schedule_batch([cumulative_confidence(logits, temperatures)[0]], self.sps).lengths[0]


# --- offline simulation -------------------------------------------------------------------------------------------

def _leading_ones(accept: np.ndarray) -> int:
    """Accepted drafts of a round = the length of the leading run of accepted positions."""
    rejected = np.flatnonzero(accept == 0)
    return int(rejected[0]) if rejected.size else int(accept.size)


def _parse_rounds(rounds_by_request) -> list[list[tuple[np.ndarray, int]]]:
    parsed = []
    for q, rounds in enumerate(rounds_by_request):
        rows = []
        for i, rnd in enumerate(rounds):
            conf, accept = rnd
            c = np.asarray(conf, dtype=np.float64).reshape(-1)
            y = np.asarray(accept, dtype=np.float64).reshape(-1)
            if c.shape != y.shape:
                raise ValueError(f"request {q} round {i}: {c.size} confidences but {y.size} acceptance flags")
            if not (np.isfinite(c).all() and ((c >= 0) & (c <= 1)).all()):
                raise ValueError(f"request {q} round {i}: confidences must be in [0, 1]")
            if not np.isin(y, (0.0, 1.0)).all():
                raise ValueError(f"request {q} round {i}: acceptance flags must be 0/1")
            rows.append((np.cumprod(c), _leading_ones(y)))
        if not rows:
            raise ValueError(f"request {q} has no rounds")
        parsed.append(rows)
    if not parsed:
        raise ValueError("rounds_by_request is empty")
    return parsed


def simulate(rounds_by_request, sps: SpsTable, gammas: Sequence[int] | None = None,
             batch_sizes: Sequence[int] = (1, 4, 16, 64), seed: int = 0, num_batches: int = 256) -> list[dict]:
    """Replay recorded rounds through the scheduler and through fixed draft lengths.

    ``rounds_by_request[q]`` lists request q's rounds as ``(conf, accept)`` pairs: the per-position confidences
    c_1..c_n (calibrated: sigmoid(z_k / T_k)) and the realised acceptance of every position (0/1; per-position or
    prefix flags alike, only the leading run of ones counts). Chain rejection sampling decides position k alone, so
    a round verified with l drafts yields min(l, accepted) + 1 tokens (the +1 is the bonus or the residual sample).

    For each batch size R, ``num_batches`` batches are drawn (R distinct requests when there are that many, else
    with replacement; one random round each, seeded by (seed, R)), and every policy sees the same batches. Rows, one
    per (R, policy): ``batch_size``, ``policy`` ("scheduler" or "fixed_gamma=g"), ``mean_verify_tokens`` (mean B),
    ``mean_tau_per_request`` (realised tokens per request per round), ``expected_tau_per_request``, ``theta``
    (realised tokens/second: total tokens / total verify time, where a batch takes 1 / SPS(B) s; for a single batch
    this is tokens * SPS(B)) and ``expected_theta`` (the same with expected tau).
    """
    requests = _parse_rounds(rounds_by_request)
    if gammas is None:
        gammas = range(1, max(s.size for rows in requests for s, _ in rows) + 1)
    gammas = [int(g) for g in gammas]
    policies = ["scheduler"] + [f"fixed_gamma={g}" for g in gammas]
    rows = []
    for n_req in batch_sizes:
        n_req = int(n_req)
        rng = np.random.default_rng((int(seed), n_req))
        sums = {p: np.zeros(4) for p in policies}  # verify tokens, realised tokens, expected tau, seconds
        for _ in range(int(num_batches)):
            if n_req <= len(requests):
                picked = rng.choice(len(requests), size=n_req, replace=False)
            else:
                picked = rng.integers(0, len(requests), size=n_req)
            batch = [requests[q][int(rng.integers(len(requests[q])))] for q in picked]
            survival = [s for s, _ in batch]
            for p, g in zip(policies, [None] + gammas):
                try:
                    alloc = schedule_batch(survival, sps) if g is None else fixed_gamma(survival, sps, g)
                    step_time = 1.0 / sps.sps(alloc.batch_tokens)
                except ValueError as err:
                    raise ValueError(f"batch_size={n_req}, policy {p}: {err}") from err
                tokens = sum(min(n, acc) + 1 for n, (_, acc) in zip(alloc.lengths, batch))
                sums[p] += (alloc.batch_tokens, tokens, alloc.tau, step_time)
        for p in policies:
            b_sum, tok_sum, exp_sum, time_sum = sums[p]
            rows.append({"batch_size": n_req, "policy": p,
                         "mean_verify_tokens": float(b_sum / num_batches),
                         "mean_tau_per_request": float(tok_sum / (num_batches * n_req)),
                         "expected_tau_per_request": float(exp_sum / (num_batches * n_req)),
                         "theta": float(tok_sum / time_sum),
                         "expected_theta": float(exp_sum / time_sum)})
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table of ``simulate`` rows; ``vs best fixed`` = theta / the best fixed-gamma theta at that R."""
    best_fixed = {}
    for row in rows:
        if row["policy"] != "scheduler":
            best_fixed[row["batch_size"]] = max(best_fixed.get(row["batch_size"], 0.0), row["theta"])
    lines = ["| batch size | policy | verify tokens | tau/req (real) | tau/req (exp) | theta (real) | theta (exp) "
             "| vs best fixed |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ref = best_fixed.get(row["batch_size"])
        ratio = f"{row['theta'] / ref:.3f}" if ref else "-"
        lines.append(f"| {row['batch_size']} | {row['policy']} | {row['mean_verify_tokens']:.2f} "
                     f"| {row['mean_tau_per_request']:.3f} | {row['expected_tau_per_request']:.3f} "
                     f"| {row['theta']:.1f} | {row['expected_theta']:.1f} | {ratio} |")
    return "\n".join(lines)
