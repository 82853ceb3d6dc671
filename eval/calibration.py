"""Calibration of DSpark's confidence head: metrics, sequential temperature scaling (STS) and the SGLang STS file.

Data, one row per speculative round r and one column per draft position k = 1..gamma (column k-1):

* ``conf_logits[r, k]``: the confidence logit z_{r,k} the DSpark head produced for draft k (probabilities
  c = sigmoid(z) convert with ``logits_from_probs``);
* ``labels[r, k]``: the observed prefix-acceptance label y_{r,k} = 1 if drafts 1..k of the round were all accepted
  (the ``accept_rate@k`` event of DeepSpec's evaluator: prefix survival, not conditional acceptance), else 0;
* ``mask[r, k]``: True where draft k was proposed; positions beyond the round's proposal length are False and their
  logits/labels are ignored (they may hold anything, NaN included). ``prefix_labels`` builds labels and mask from
  per-round accepted counts and proposal lengths.

The calibrated quantity is the cumulative confidence a_{r,k} = prod_{i<=k} sigmoid(z_{r,i} / T_i), the survival the
scheduler ranks (eval/scheduler.py); the metrics compare it with y_{r,k}, position by position:

* ECE: equal-width bins on [0, 1] (bin b holds [b/n, (b+1)/n), the last bin also holds 1.0),
  sum_b n_b/N * |mean pred_b - mean label_b|, as a fraction (the paper quotes it in percent);
* AUROC: the rank (Mann-Whitney) statistic with average ranks for ties, NaN when a position has one class only;
* Brier: mean (pred - label)^2.

STS (paper section 3.2): for k = 1..gamma in order, with T_1..T_{k-1} fixed, a 1-D search picks the T_k minimising
the ECE of the cumulative product at position k. Fit it on one split of the rounds and report ECE before/after on the
other (``split_rounds``, ``calibrate_sts``), then write the SGLang file with ``save_sts``:

    result = calibrate_sts(conf_logits, labels, mask, holdout_fraction=0.5, seed=0)
    save_sts("dspark_sts.json", **result, dataset="alpaca")   # --speculative-dspark-confidence-sts-path

Inputs may be numpy arrays, torch tensors or nested lists; everything is computed in float64 numpy.
"""

from __future__ import annotations

import math

import numpy as np


DEFAULT_GRID = np.geomspace(0.05, 20.0, 61)  # ~10% steps in T; the local refinement goes finer
REFINE_POINTS = 41
MIN_ROUNDS = 2  # calibrate_sts fits on some rounds and measures on others: one each at least


# --- input helpers ------------------------------------------------------------------------------------------------

def _as_float(x, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().double().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be numeric (array, tensor or nested list): {err}") from err


def _as_mask(mask, shape: tuple, name: str = "mask") -> np.ndarray:
    if mask is None:
        return np.ones(shape, dtype=bool)
    if hasattr(mask, "detach"):
        mask = mask.detach().cpu().numpy()
    m = np.asarray(mask)
    if m.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {m.shape}")
    if m.dtype != bool:
        if not np.isin(m, (0, 1)).all():
            raise ValueError(f"{name} must be boolean (or 0/1), got values outside {{0, 1}}")
        m = m.astype(bool)
    return m


def _select(pred, label, mask) -> tuple[np.ndarray, np.ndarray]:
    """The masked-in (pred, label) pairs as flat float64 arrays, validated."""
    p = _as_float(pred, "pred")
    y = _as_float(label, "label")
    if p.shape != y.shape:
        raise ValueError(f"pred and label must have the same shape, got {p.shape} and {y.shape}")
    m = _as_mask(mask, p.shape)
    p, y = p[m], y[m]
    if not (np.isfinite(p).all() and ((p >= 0) & (p <= 1)).all()):
        raise ValueError("pred must be probabilities in [0, 1] wherever mask is True")
    if not (np.isfinite(y).all() and ((y >= 0) & (y <= 1)).all()):
        raise ValueError("label must be in [0, 1] wherever mask is True")
    return p, y


def _as_rounds(conf_logits, labels, mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = _as_float(conf_logits, "conf_logits")
    if z.ndim != 2:
        raise ValueError(f"conf_logits must be [rounds, gamma], got shape {z.shape}")
    y = _as_float(labels, "labels")
    if y.shape != z.shape:
        raise ValueError(f"labels must have the shape of conf_logits {z.shape}, got {y.shape}")
    m = _as_mask(mask, z.shape)
    if not np.isin(y[m], (0.0, 1.0)).all():
        raise ValueError("labels must be 0/1 prefix-acceptance labels wherever mask is True")
    if not np.isfinite(z[m]).all():
        raise ValueError("conf_logits must be finite wherever mask is True")
    return z, y, m


def _as_temperatures(temperatures, gamma: int) -> np.ndarray:
    if temperatures is None:
        return np.ones(gamma)
    t = _as_float(temperatures, "temperatures").reshape(-1)
    if t.shape != (gamma,):
        raise ValueError(f"need one temperature per draft position ({gamma}), got {t.shape[0]}")
    if not (np.isfinite(t).all() and (t > 0).all()):
        raise ValueError(f"temperatures must be finite and > 0, got {t.tolist()}")
    return t


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))  # no overflow for large |x|


def logits_from_probs(probs, eps: float = 1e-7) -> np.ndarray:
    """Confidence probabilities c -> logits z = log(c / (1 - c)), with c clipped to [eps, 1 - eps]."""
    c = np.clip(_as_float(probs, "probs"), eps, 1.0 - eps)
    return np.log(c) - np.log1p(-c)


def prefix_labels(num_accepted, proposal_len, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels, mask), each [R, gamma], from per-round accepted-draft counts and proposal lengths.

    labels[r, k-1] = k <= num_accepted[r]; mask[r, k-1] = k <= proposal_len[r]. The bonus token is not a draft and
    is not counted in ``num_accepted``.
    """
    acc = np.asarray(num_accepted, dtype=np.int64).reshape(-1)
    prop = np.asarray(proposal_len, dtype=np.int64).reshape(-1)
    if acc.shape != prop.shape:
        raise ValueError(f"num_accepted and proposal_len must have the same length, got {acc.shape} and {prop.shape}")
    if (acc < 0).any() or (acc > prop).any() or (prop > gamma).any():
        raise ValueError("need 0 <= num_accepted <= proposal_len <= gamma for every round")
    k = np.arange(1, gamma + 1)
    return (k[None, :] <= acc[:, None]).astype(np.float64), k[None, :] <= prop[:, None]


# --- metrics ------------------------------------------------------------------------------------------------------

def cumulative_confidence(conf_logits, temperatures=None) -> np.ndarray:
    """[R, gamma] survival a_{r,k} = prod_{i<=k} sigmoid(z_{r,i} / T_i) (T_i = 1 when ``temperatures`` is None).

    A non-finite logit in a masked-out position only spoils the positions to its right, which are masked out too.
    """
    z = _as_float(conf_logits, "conf_logits")
    if z.ndim != 2:
        raise ValueError(f"conf_logits must be [rounds, gamma], got shape {z.shape}")
    t = _as_temperatures(temperatures, z.shape[1])
    with np.errstate(invalid="ignore"):  # NaN placeholders in masked-out positions
        return np.cumprod(_sigmoid(z / t), axis=1)


def ece(pred, label, mask=None, n_bins: int = 20) -> float:
    """Expected calibration error over the masked-in entries (NaN when there are none); see the module docstring."""
    if int(n_bins) < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    p, y = _select(pred, label, mask)
    if p.size == 0:
        return math.nan
    idx = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    # sum_b n_b/N |mean p_b - mean y_b| = sum_b |sum p_b - sum y_b| / N
    gap = np.bincount(idx, weights=p, minlength=n_bins) - np.bincount(idx, weights=y, minlength=n_bins)
    return float(np.abs(gap).sum() / p.size)


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, tied values sharing the mean of their ranks."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2.0)[inverse.reshape(-1)]


def auroc(pred, label, mask=None) -> float:
    """Area under the ROC curve: P(pred_pos > pred_neg) + 0.5 P(tie). NaN when either class is absent."""
    p, y = _select(pred, label, mask)
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("auroc needs binary 0/1 labels")
    pos = y == 1.0
    n_pos = int(pos.sum())
    n_neg = p.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ranks = _average_ranks(p)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def brier(pred, label, mask=None) -> float:
    """Mean squared error between pred and label over the masked-in entries (NaN when there are none)."""
    p, y = _select(pred, label, mask)
    return float(np.mean((p - y) ** 2)) if p.size else math.nan


def calibration_report(conf_logits, labels, mask=None, temperatures=None, n_bins: int = 20) -> dict:
    """Per-position metrics of the cumulative confidence against the prefix-acceptance labels.

    Returns a dict of lists, one entry per draft position: ``ece``, ``auroc``, ``brier``, ``count`` (masked-in
    rounds), ``mean_confidence`` (mean cumulative confidence) and ``accept_rate`` (mean label). Metrics of a position
    with no rounds are NaN.
    """
    z, y, m = _as_rounds(conf_logits, labels, mask)
    a = cumulative_confidence(z, temperatures)
    report = {key: [] for key in ("ece", "auroc", "brier", "count", "mean_confidence", "accept_rate")}
    for k in range(z.shape[1]):
        mk = m[:, k]
        n = int(mk.sum())
        report["ece"].append(ece(a[:, k], y[:, k], mk, n_bins))
        report["auroc"].append(auroc(a[:, k], y[:, k], mk))
        report["brier"].append(brier(a[:, k], y[:, k], mk))
        report["count"].append(n)
        report["mean_confidence"].append(float(a[mk, k].mean()) if n else math.nan)
        report["accept_rate"].append(float(y[mk, k].mean()) if n else math.nan)
    return report


# --- sequential temperature scaling -------------------------------------------------------------------------------

def _best(candidates: np.ndarray, losses: np.ndarray) -> float:
    """Lowest loss; among equal losses (ECE is piecewise constant in T) the T closest to 1 in log space."""
    order = np.lexsort((np.abs(np.log(candidates)), losses))
    return float(candidates[order[0]])


def fit_sts(conf_logits, labels, mask=None, grid=None, n_bins: int = 20) -> list[float]:
    """Sequential temperature scaling: one temperature per draft position, fitted left to right.

    For k = 1..gamma, with T_1..T_{k-1} already fixed, T_k minimises ECE(prod_{i<=k} sigmoid(z_i/T_i), y_k) over the
    rounds that proposed draft k: first over ``grid`` (default: 61 log-spaced values in [0.05, 20]), then over a
    41-point log grid between the best grid value's neighbours. Ties go to the T closest to 1, and a position no
    round reached gets T = 1.

    Order preservation: T_k > 0, so sigmoid(z_k/T_k) ranks rounds exactly as z_k does; the per-position confidence's
    ordering, hence its AUROC, is unchanged, and at position 1 so is the cumulative product's. (Deeper products mix
    several temperatures and can reorder rounds; that reordering is what the later positions are fitted for.)
    """
    z, y, m = _as_rounds(conf_logits, labels, mask)
    grid = DEFAULT_GRID if grid is None else np.sort(_as_float(grid, "grid").reshape(-1))
    if grid.size == 0 or not (np.isfinite(grid).all() and (grid > 0).all()):
        raise ValueError("grid must be a non-empty list of finite temperatures > 0")
    temps: list[float] = []
    prefix = np.ones(z.shape[0])
    for k in range(z.shape[1]):
        mk = m[:, k]
        if mk.any():
            zk, pk, yk = z[mk, k], prefix[mk], y[mk, k]

            def loss(ts):
                return np.array([ece(pk * _sigmoid(zk / t), yk, None, n_bins) for t in ts])

            coarse = _best(grid, loss(grid))
            i = int(np.searchsorted(grid, coarse))
            lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
            fine = np.append(np.geomspace(lo, hi, REFINE_POINTS), coarse) if hi > lo else np.array([coarse])
            t_k = _best(fine, loss(fine))
        else:
            t_k = 1.0
        temps.append(t_k)
        with np.errstate(invalid="ignore"):  # masked-out logits may be NaN; they only reach masked-out positions
            prefix = prefix * _sigmoid(z[:, k] / t_k)
    return temps


def split_rounds(num_rounds: int, holdout_fraction: float = 0.5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random disjoint (fit_idx, eval_idx) over range(num_rounds), both sorted; eval gets round(fraction * n) rounds,
    at least one each side when num_rounds >= 2.

    Rounds of one generated sequence are correlated; to keep a sequence on one side, split sequence ids with this and
    gather their rounds.
    """
    n = int(num_rounds)
    if n < MIN_ROUNDS:
        raise ValueError(f"need at least {MIN_ROUNDS} rounds to split, got {num_rounds}")
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    n_eval = min(max(int(round(holdout_fraction * n)), 1), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def calibrate_sts(conf_logits, labels, mask=None, holdout_fraction: float = 0.5, seed: int = 0, grid=None,
                  n_bins: int = 20) -> dict:
    """Fit STS on one split of the rounds and measure ECE before/after on the other.

    Returns ``{temperatures, num_samples, ece_before, ece_after}`` (``num_samples`` = rounds fitted on), ready for
    ``save_sts(path, **result, dataset=...)``.
    """
    z, y, m = _as_rounds(conf_logits, labels, mask)
    fit_idx, eval_idx = split_rounds(z.shape[0], holdout_fraction, seed)
    temps = fit_sts(z[fit_idx], y[fit_idx], m[fit_idx], grid=grid, n_bins=n_bins)
    before = calibration_report(z[eval_idx], y[eval_idx], m[eval_idx], None, n_bins)["ece"]
    after = calibration_report(z[eval_idx], y[eval_idx], m[eval_idx], temps, n_bins)["ece"]
    return {"temperatures": temps, "num_samples": int(fit_idx.size), "ece_before": before, "ece_after": after}
