"""Calibration metrics, STS and its SGLang file (eval/calibration.py); SPS table, Algorithm 1 and the simulator
(eval/scheduler.py). Small numpy examples with hand-computed answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from eval.calibration import (auroc, brier, calibrate_sts, calibration_report, cumulative_confidence, ece, fit_sts,
                              logits_from_probs, prefix_labels, split_rounds)
from eval.scheduler import VerifySchedule, fixed_gamma, format_table, profile_sps, schedule_batch, simulate
from export.serving import SPS_KEYS, STS_KEYS, SpsTable, load_sts, save_sts


# --- metrics ------------------------------------------------------------------------------------------------------

def test_ece_hand_computed_with_mask_and_edges():
    pred = [0.1, 0.15, 0.8, 0.9, 0.5]
    label = [0, 1, 1, 1, 0]
    # 2 bins, last entry masked: bin 0 {0.1, 0.15} |0.25 - 1| = 0.75, bin 1 {0.8, 0.9} |1.7 - 2| = 0.3 -> 1.05 / 4
    assert ece(pred, label, [1, 1, 1, 1, 0], n_bins=2) == pytest.approx(0.2625)
    # unmasked, 0.5 opens bin 1: bin 0 0.75, bin 1 {0.5, 0.8, 0.9} |2.2 - 2| = 0.2 -> 0.95 / 5
    assert ece(pred, label, None, n_bins=2) == pytest.approx(0.19)
    # 1.0 falls in the last bin together with 0.97: |1.97 - 1| / 2
    assert ece([1.0, 0.97], [1, 0]) == pytest.approx(0.485)
    assert ece([0.05, 0.95], [0, 1]) == pytest.approx(0.05)
    assert math.isnan(ece([0.3], [1], [False]))
    with pytest.raises(ValueError):
        ece([1.2], [1])


def test_auroc_ties_mask_single_class():
    pred = [0.2, 0.4, 0.4, 0.9, 0.1]
    label = [0, 0, 1, 1, 1]
    # masked: positives {0.4, 0.9} vs negatives {0.2, 0.4}: (1 + 0.5 + 2) / 4 (the 0.4-0.4 tie counts 1/2)
    assert auroc(pred, label, [1, 1, 1, 1, 0]) == pytest.approx(0.875)
    # unmasked the positive 0.1 loses both pairs: 3.5 / 6
    assert auroc(pred, label) == pytest.approx(3.5 / 6)
    assert auroc([0.3, 0.3, 0.3], [0, 1, 1]) == pytest.approx(0.5)
    assert math.isnan(auroc([0.2, 0.7, 0.1], [1, 1, 0], [1, 1, 0]))  # only positives left
    assert math.isnan(auroc([0.2, 0.7], [0, 0]))


def test_brier_hand_computed():
    assert brier([0.1, 0.15, 0.8, 0.9, 0.3], [0, 1, 1, 1, 1], [1, 1, 1, 1, 0]) == pytest.approx(
        (0.01 + 0.7225 + 0.04 + 0.01) / 4)


def test_cumulative_confidence_and_report_by_hand():
    ln3 = math.log(3.0)  # sigmoid = 0.75
    assert cumulative_confidence([[0.0, ln3]], [1.0, 0.5]) == pytest.approx(np.array([[0.5, 0.5 * 0.9]]))
    z = torch.tensor([[0.0, 0.0], [ln3, 0.0], [0.0, float("nan")]])  # torch input, NaN where masked
    labels = [[1, 0], [1, 1], [0, 0]]
    mask = [[True, True], [True, True], [True, False]]
    rep = calibration_report(z, labels, mask)
    # position 1: preds (0.5, 0.75, 0.5), labels (1, 1, 0); position 2: preds (0.25, 0.375), labels (0, 1)
    assert rep["count"] == [3, 2]
    assert rep["accept_rate"] == pytest.approx([2 / 3, 0.5])
    assert rep["mean_confidence"] == pytest.approx([1.75 / 3, 0.3125])
    assert rep["brier"] == pytest.approx([0.5625 / 3, (0.0625 + 0.390625) / 2])
    assert rep["auroc"] == pytest.approx([0.75, 1.0])
    assert rep["ece"] == pytest.approx([0.25 / 3, (0.25 + 0.625) / 2])


def test_prefix_labels_and_logits_from_probs():
    labels, mask = prefix_labels([0, 2, 3], [2, 3, 3], gamma=3)
    assert labels.tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert mask.tolist() == [[True, True, False], [True, True, True], [True, True, True]]
    with pytest.raises(ValueError):
        prefix_labels([3], [2], gamma=3)
    assert logits_from_probs([0.75, 0.5]) == pytest.approx([math.log(3.0), 0.0])


# --- STS ----------------------------------------------------------------------------------------------------------

T_STAR = [0.5, 2.5, 0.4]


def synthetic_rounds(seed: int, rounds: int = 40000):
    """Per-position acceptance ~ Bernoulli(sigmoid(z_k / T*_k)), so prod_k sigmoid(z_k / T*_k) is exactly the
    probability of the prefix label; 20% of rounds propose fewer drafts (masked, NaN logits)."""
    rng = np.random.default_rng(seed)
    gamma = len(T_STAR)
    z = rng.normal(2.0, 2.0, size=(rounds, gamma))
    hit = rng.random((rounds, gamma)) < 1.0 / (1.0 + np.exp(-z / np.array(T_STAR)))
    labels = np.cumprod(hit, axis=1).astype(float)
    proposal = np.where(rng.random(rounds) < 0.2, rng.integers(1, gamma + 1, rounds), gamma)
    mask = np.arange(1, gamma + 1)[None, :] <= proposal[:, None]
    z[~mask] = np.nan
    return z, labels, mask


def test_sts_recovers_known_temperatures_and_lowers_heldout_ece():
    z, labels, mask = synthetic_rounds(seed=0, rounds=60000)
    result = calibrate_sts(z, labels, mask, holdout_fraction=0.5, seed=1)
    temps = np.array(result["temperatures"])
    # deeper positions carry less signal (their factor is one of k in the product): over 16 seeds the worst relative
    # errors were 3%, 6% and 15%
    assert (np.abs(temps / T_STAR - 1) < [0.06, 0.12, 0.25]).all(), temps
    assert result["num_samples"] == 30000
    before, after = np.array(result["ece_before"]), np.array(result["ece_after"])
    assert (after < before).all(), (before, after)
    assert (before > 0.02).all() and (after < 0.02).all(), (before, after)
    # temperature scaling keeps the order at position 1: the cumulative product there is sigmoid(z_1 / T_1)
    fit_idx, eval_idx = split_rounds(z.shape[0], 0.5, 1)
    rep_before = calibration_report(z[eval_idx], labels[eval_idx], mask[eval_idx])
    rep_after = calibration_report(z[eval_idx], labels[eval_idx], mask[eval_idx], temps)
    assert rep_after["auroc"][0] == pytest.approx(rep_before["auroc"][0], abs=1e-12)
    assert rep_after["ece"] == pytest.approx(result["ece_after"])


def test_fit_sts_unreached_position_and_custom_grid():
    z = np.array([[1.0, np.nan], [-1.0, np.nan], [2.0, np.nan]])
    labels = np.array([[1, 0], [0, 0], [1, 0]])
    mask = np.array([[1, 0], [1, 0], [1, 0]], bool)
    temps = fit_sts(z, labels, mask, grid=[0.5, 1.0, 2.0])
    assert temps[1] == 1.0  # no round proposed draft 2
    assert 0.5 <= temps[0] <= 2.0
    with pytest.raises(ValueError):
        fit_sts(z, labels, mask, grid=[0.0, 1.0])


def test_split_rounds_disjoint_and_seeded():
    fit_idx, eval_idx = split_rounds(10, 0.3, seed=4)
    assert len(eval_idx) == 3 and len(fit_idx) == 7
    assert sorted(fit_idx.tolist() + eval_idx.tolist()) == list(range(10))
    again = split_rounds(10, 0.3, seed=4)
    assert again[0].tolist() == fit_idx.tolist() and again[1].tolist() == eval_idx.tolist()
    assert split_rounds(100, 0.3, seed=4)[1].tolist() != split_rounds(100, 0.3, seed=5)[1].tolist()
    assert len(split_rounds(3, 0.01, 0)[1]) == 1  # at least one round each side
    with pytest.raises(ValueError):
        split_rounds(10, 1.0, 0)


def test_sts_file_sglang_schema_round_trip(tmp_path):
    path = tmp_path / "sts.json"
    save_sts(path, np.array([0.5, 2.0, 1.25]), dataset="alpaca", num_samples=1000,
             ece_before=[0.057, 0.082, 0.058], ece_after=[0.02, 0.017, 0.008])
    raw = json.loads(path.read_text())
    assert set(raw) == set(STS_KEYS) == {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
    assert raw["temperatures"] == [0.5, 2.0, 1.25] and raw["num_samples"] == 1000 and raw["dataset"] == "alpaca"
    assert [p.name for p in tmp_path.iterdir()] == ["sts.json"]  # no temporary file left behind
    sts = load_sts(path)
    assert sts.temperatures == [0.5, 2.0, 1.25] and sts.ece_after == [0.02, 0.017, 0.008]
    save_sts(path, [1.0])  # the optional keys are left out, not written as null
    assert json.loads(path.read_text()) == {"temperatures": [1.0]}


def test_sts_file_validation(tmp_path):
    path = tmp_path / "sts.json"
    cases = {
        "zero temperature": {"temperatures": [1.0, 0.0]},
        "mismatched lengths": {"temperatures": [1.0, 2.0], "ece_before": [0.1]},
        "unknown key": {"temperatures": [1.0], "temperature": [1.0]},
        "no temperatures": {"dataset": "x"},
    }
    for obj in cases.values():
        path.write_text(json.dumps(obj))
        with pytest.raises(ValueError):
            load_sts(path)
    with pytest.raises(ValueError, match="temperatures"):
        save_sts(path, [1.0, -2.0])
    with pytest.raises(ValueError, match="ece_after"):
        save_sts(path, [1.0, 2.0], ece_after=[0.1, float("nan")])


# --- SPS table ----------------------------------------------------------------------------------------------------

def test_sps_lookup_floors_and_clamps_like_sglang_and_round_trips(tmp_path):
    """SGLang's SpsCostTable.lookup takes the value of the largest probe <= B and clamps at both ends; interpolating
    (as we did) gave 528 at B=31 where SGLang's planner uses 950."""
    issue_table = SpsTable((8, 16, 32, 64), (1000.0, 950.0, 500.0, 480.0), 64)
    assert issue_table.sps(31) == 950.0
    assert [issue_table.sps(b) for b in (1, 8, 15, 16, 32, 63, 64)] == [1000.0, 1000.0, 1000.0, 950.0, 500.0,
                                                                        500.0, 480.0]
    table = SpsTable((1, 4, 16), (100.0, 80.0, 20.0), 32)
    assert table.sps(1) == 100.0 and table.sps(3) == 100.0 and table.sps(4) == 80.0 and table.sps(10) == 80.0
    assert table.sps(16) == 20.0 and table.sps(32) == 20.0
    assert table.sps(33) == 20.0 and table.sps(10_000) == 20.0  # past max_batch_tokens: SGLang clamps, never raises
    with pytest.raises(ValueError, match="at least 1 token"):
        table.sps(0)
    path = tmp_path / "sps.json"
    table.save(path)
    raw = json.loads(path.read_text())
    assert set(raw) == set(SPS_KEYS)
    assert raw == {"sample_batch_tokens": [1, 4, 16], "sample_steps_per_sec": [100.0, 80.0, 20.0],
                   "max_batch_tokens": 32}
    assert SpsTable.load(path) == table


def test_sps_table_validation(tmp_path):
    path = tmp_path / "sps.json"
    bad = [
        {"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [5.0, 4.0], "max_batch_tokens": 2,
         "bias_seconds": 0.001},
        {"sample_batch_tokens": [4, 2], "sample_steps_per_sec": [5.0, 4.0], "max_batch_tokens": 4},
        {"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [5.0], "max_batch_tokens": 2},
        {"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [5.0, 0.0], "max_batch_tokens": 2},
        {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [5.0, 4.0], "max_batch_tokens": 4},
        {"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [5.0, 4.0]},
    ]
    for obj in bad:
        path.write_text(json.dumps(obj))
        with pytest.raises(ValueError):
            SpsTable.load(path)


def test_profile_sps_median_and_warmup():
    now = [0.0]
    calls = []
    durations = {}

    def clock():
        return now[0]

    def step(b):
        calls.append(b)
        seq = durations.setdefault(b, [0.0, 0.01 * b, 0.5, 0.01 * b])  # warmup, then one slow outlier
        now[0] += seq.pop(0)

    table = profile_sps(step, [8, 2, 8], repeats=3, warmup=1, clock=clock)
    assert table.batch_tokens == (2, 8) and table.max_batch_tokens == 8
    assert table.steps_per_sec == pytest.approx((50.0, 12.5))  # 1 / median, the 0.5 s outlier ignored
    assert calls == [2] * 4 + [8] * 4


def test_profile_sps_interleaved_sweeps_share_the_drift():
    """interleave=True: warm each size, then time every size once a sweep; a machine slowing down step by step slows
    both sizes alike, so their ratio survives (timed size after size, the later size would take all the slowdown)."""
    now, calls = [0.0], []

    def step(b):
        calls.append(b)
        now[0] += 0.01 * b * (1 + 0.1 * len(calls))  # every call 10% slower than the first

    table = profile_sps(step, [2, 4], repeats=3, warmup=1, clock=lambda: now[0], interleave=True)
    assert calls == [2, 4] + [2, 4] * 3
    # medians: 2 at calls 3,5,7 -> call 5; 4 at calls 4,6,8 -> call 6
    assert table.steps_per_sec == pytest.approx((1 / (0.02 * 1.5), 1 / (0.04 * 1.6)))


# --- Algorithm 1 --------------------------------------------------------------------------------------------------

# a jagged table: SPS(6) recovers after the cliff at 5, which only a global search would exploit
JAGGED = SpsTable((2, 3, 4, 5, 6), (10.0, 9.0, 8.0, 6.0, 8.0), 6)


def test_schedule_batch_hand_example_with_early_stop():
    alloc = schedule_batch([[0.9, 0.5], [0.8, 0.1]], JAGGED)
    # start B=2 tau=2 Theta=20; (0,1): B=3 tau=2.9 Theta=26.1 admit; (1,1): B=4 tau=3.7 Theta=29.6 admit;
    # (0,2): B=5 tau=4.2 Theta=25.2 <= 29.6 -> stop, although (1,2) would reach B=6 tau=4.3 Theta=34.4
    assert alloc.lengths == [1, 1]
    assert alloc.batch_tokens == 4
    assert alloc.tau == pytest.approx(3.7)
    assert alloc.theta == pytest.approx(29.6)
    assert alloc.admitted == [(0, 1), (1, 1)]
    assert alloc.stop == "early_stop"
    assert 4.3 * JAGGED.sps(6) > alloc.theta  # the early stop, not the optimum, decided


def test_verify_schedule_is_one_request_of_algorithm_1_on_calibrated_confidences():
    table = SpsTable((1, 2, 3, 4), (10.0, 8.0, 7.0, 6.5), 8)
    conf = [0.9, 0.6, 0.5, 0.9]  # survival 0.9, 0.54, 0.27, 0.243
    # Theta 10 -> (1.9)(8) = 15.2 -> (2.44)(7) = 17.08 -> (2.71)(6.5) = 17.615 -> B = 5 reads SPS(4):
    # (2.953)(6.5) = 19.19: every step raises Theta, all four drafts are verified
    assert VerifySchedule(table)(conf) == 4
    assert VerifySchedule(SpsTable((1, 2, 3), (10.0, 8.0, 6.0), 8))(conf) == 1  # (2.44)(6) = 14.64 <= 15.2: stop
    assert VerifySchedule(SpsTable((1, 2), (10.0, 5.0), 8))(conf) == 0  # (1.9)(5) = 9.5 <= 10: verify no draft
    assert VerifySchedule(table)([]) == 0
    # STS temperatures act on the logits: T = 0.5 sharpens 0.9 to 0.988 and 0.2 to 0.059, so the second draft no
    # longer pays: (1.9 + 0.18)(7.5) = 15.6 > 15.2 admits it uncalibrated, (1.988 + 0.058)(7.5) = 15.35 <= 15.9 not
    mid = SpsTable((1, 2, 3), (10.0, 8.0, 7.5), 8)
    conf = [0.9, 0.2]
    assert VerifySchedule(mid)(conf) == 2
    sharp = VerifySchedule(mid, temperatures=[0.5] * 7)  # more temperatures than drafts: the first ones apply
    logits = np.log(np.array(conf) / (1 - np.array(conf)))
    assert sharp(conf) == schedule_batch([np.cumprod(1 / (1 + np.exp(-logits / 0.5)))], mid).lengths[0] == 1


def test_schedule_batch_tie_order_and_capacity():
    flat = SpsTable((1,), (10.0,), 5)
    alloc = schedule_batch([[1.0, 1.0], [1.0, 1.0, 1.0]], flat)
    # ties: lower position first, then lower request; capacity 5 leaves room for 3 drafts after the 2 anchors
    assert alloc.admitted == [(0, 1), (1, 1), (0, 2)]
    assert alloc.lengths == [2, 1] and alloc.batch_tokens == 5 and alloc.stop == "capacity"
    with pytest.raises(ValueError):
        schedule_batch([[0.5]] * 6, flat)  # 6 anchors do not fit 5 tokens


def test_schedule_batch_respects_prefixes():
    rng = np.random.default_rng(0)
    for trial in range(30):
        survival = [np.cumprod(rng.random(rng.integers(0, 8))) for _ in range(rng.integers(1, 9))]
        sizes = np.arange(1, 80)
        table = SpsTable(tuple(sizes), tuple(100.0 / (1 + rng.uniform(0.01, 0.3) * sizes)), 79)
        alloc = schedule_batch(survival, table)
        for r, n in enumerate(alloc.lengths):
            assert [j for q, j in alloc.admitted if q == r] == list(range(1, n + 1))
        assert alloc.batch_tokens == len(survival) + sum(alloc.lengths)
        assert alloc.tau == pytest.approx(len(survival) + sum(float(a[:n].sum()) for a, n in zip(survival,
                                                                                               alloc.lengths)))
        assert alloc.theta == pytest.approx(alloc.tau * table.sps(alloc.batch_tokens))
        assert alloc.theta >= len(survival) * table.sps(len(survival))
    with pytest.raises(ValueError, match="non-increasing"):
        schedule_batch([[0.5, 0.6]], JAGGED)


def test_flat_table_admits_exactly_the_positive_pairs():
    # SPS constant: Theta = S * tau rises with every a > 0 and stays equal for a = 0 (not an improvement), so the
    # scheduler maximises tau with the fewest tokens: all positive pairs, no zero ones
    flat = SpsTable((1,), (50.0,), 64)
    survival = [[0.9, 0.3, 0.0], [0.2, 0.0], [], [1.0, 1.0, 0.4], [0.01]]
    alloc = schedule_batch(survival, flat)
    assert alloc.lengths == [2, 1, 0, 3, 1]
    assert alloc.batch_tokens == 5 + 7
    assert alloc.tau == pytest.approx(5 + 0.9 + 0.3 + 0.2 + 1.0 + 1.0 + 0.4 + 0.01)
    assert alloc.theta == pytest.approx(alloc.tau * 50.0)
    assert alloc.stop == "early_stop"


def test_steeper_table_admits_fewer():
    # SPS(B) = 1 / (c0 + c1 B): admitting a at (tau, B) pays iff a > tau / (c0/c1 + B), a threshold that rises with c1
    rng = np.random.default_rng(1)
    survival = [np.cumprod(rng.uniform(0.5, 1.0, 7)) for _ in range(8)]
    sizes = np.arange(1, 65)
    admitted = []
    for c1 in (0.0, 0.001, 0.01, 0.05, 0.2, 1.0):
        table = SpsTable(tuple(sizes), tuple(1.0 / (0.1 + c1 * sizes)), 64)
        admitted.append(sum(schedule_batch(survival, table).lengths))
    assert admitted[0] == 56  # flat: everything (all survivals > 0)
    assert all(x >= y for x, y in zip(admitted, admitted[1:])), admitted
    assert admitted[-1] < admitted[0]
    # SPS proportional to 1/B: Theta = const * tau / B starts at its maximum 1 per token, nothing below 1 pays
    fully_steep = SpsTable(tuple(sizes), tuple(1000.0 / sizes), 64)
    assert schedule_batch(survival, fully_steep).lengths == [0] * 8


def test_fixed_gamma_hand():
    survival = [[0.9, 0.5], [0.8]]
    alloc = fixed_gamma(survival, JAGGED, 2)
    assert alloc.lengths == [2, 1] and alloc.batch_tokens == 5
    assert alloc.tau == pytest.approx(4.2) and alloc.theta == pytest.approx(4.2 * 6.0)
    zero = fixed_gamma(survival, JAGGED, 0)
    assert zero.lengths == [0, 0] and zero.batch_tokens == 2 and zero.theta == pytest.approx(20.0)
    with pytest.raises(ValueError):
        fixed_gamma([[0.9, 0.5], [0.8, 0.7], [0.5]], JAGGED, 2)  # B = 8 > max_batch_tokens


# --- simulation ---------------------------------------------------------------------------------------------------

def test_simulate_single_round_by_hand():
    table = SpsTable((1, 2, 3), (10.0, 9.0, 5.0), 3)
    rows = simulate([[([0.9, 0.5], [1, 0])]], table, gammas=[1, 2], batch_sizes=[1], num_batches=3)
    by = {row["policy"]: row for row in rows}
    # survival (0.9, 0.45). Scheduler: (0,1) B=2 Theta 1.9*9=17.1 > 10 admit; (0,2) B=3 2.35*5=11.75 stop -> l=1,
    # realised 1 accepted draft + 1 token
    assert by["scheduler"]["mean_verify_tokens"] == 2
    assert by["scheduler"]["mean_tau_per_request"] == pytest.approx(2.0)
    assert by["scheduler"]["theta"] == pytest.approx(18.0)
    assert by["scheduler"]["expected_theta"] == pytest.approx(17.1)
    # gamma=2 verifies the rejected draft too: still 2 tokens, at SPS(3) = 5
    assert by["fixed_gamma=2"]["theta"] == pytest.approx(10.0)
    assert by["fixed_gamma=2"]["expected_tau_per_request"] == pytest.approx(2.35)
    assert by["fixed_gamma=2"]["expected_theta"] == pytest.approx(11.75)
    assert by["fixed_gamma=1"]["theta"] == pytest.approx(18.0)
    json.dumps(rows)  # plain Python numbers
    text = format_table(rows)
    assert "| 1 | scheduler | 2.00 | 2.000 | 1.900 | 18.0 | 17.1 | 1.000 |" in text
    assert "fixed_gamma=2" in text


def test_simulate_oracle_and_calibrated_confidences():
    rng = np.random.default_rng(2)
    flat = SpsTable((1,), (10.0,), 512)
    # oracle confidences (1 up to the first rejection, then 0) on a flat table: the scheduler verifies exactly the
    # accepted drafts, so it gets gamma=7's tokens with fewer verify tokens and realised == expected
    requests = []
    for _ in range(12):
        rounds = []
        for _ in range(5):
            n_acc = int(rng.integers(0, 8))
            flags = [1.0] * n_acc + [0.0] * (7 - n_acc)
            rounds.append((flags, flags))
        requests.append(rounds)
    rows = simulate(requests, flat, gammas=[7], batch_sizes=[4, 16], seed=3, num_batches=50)
    for size in (4, 16):
        sched, full = [r for r in rows if r["batch_size"] == size]
        assert sched["mean_tau_per_request"] == pytest.approx(sched["expected_tau_per_request"])
        assert sched["mean_tau_per_request"] == pytest.approx(full["mean_tau_per_request"])
        assert sched["mean_verify_tokens"] < full["mean_verify_tokens"]
    # calibrated confidences (accept ~ Bernoulli(c) per position): realised tau matches expected on average
    requests = []
    for _ in range(40):
        rounds = []
        for _ in range(10):
            c = rng.uniform(0.3, 1.0, 6)
            rounds.append((c, (rng.random(6) < c).astype(float)))
        requests.append(rounds)
    steep = SpsTable((1, 16, 64, 128), (100.0, 90.0, 50.0, 30.0), 512)
    rows = simulate(requests, steep, batch_sizes=[16], seed=0, num_batches=300)
    assert [r["policy"] for r in rows] == ["scheduler"] + [f"fixed_gamma={g}" for g in range(1, 7)]
    for row in rows:
        assert row["mean_tau_per_request"] == pytest.approx(row["expected_tau_per_request"], rel=0.03), row
