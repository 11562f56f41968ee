from __future__ import annotations

import random

import pytest

from kvtier.index.estimators import PathEstimator, PrefillEstimator
from kvtier.index.planner import PrefillCost, TierCost


def test_path_estimator_recovers_alpha_and_bandwidth_through_noise() -> None:
    rng = random.Random(7)
    est = PathEstimator(seed=TierCost(1e9, 0.0))
    assert est.estimate() == TierCost(1e9, 0.0)  # the prior until data arrives
    for _ in range(400):
        size = rng.choice([256 << 10, 1 << 20, 4 << 20, 16 << 20])
        seconds = (200e-6 + size / 3e9) * rng.uniform(0.9, 1.1)
        if rng.random() < 0.03:
            seconds *= 50  # a stall behind something else
        est.observe(size, seconds)
    fitted = est.estimate()
    assert fitted.bandwidth_bytes_per_s == pytest.approx(3e9, rel=0.15)
    assert fitted.latency_s == pytest.approx(200e-6, abs=150e-6)


def test_path_estimator_follows_a_change() -> None:
    est = PathEstimator(seed=TierCost(1e9, 0.0), decay=0.9)
    for size in [1 << 20, 4 << 20] * 50:
        est.observe(size, 100e-6 + size / 5e9)
    for size in [1 << 20, 4 << 20] * 50:  # the drive slows to 1 GB/s
        est.observe(size, 100e-6 + size / 1e9)
    assert est.estimate().bandwidth_bytes_per_s == pytest.approx(1e9, rel=0.1)


def test_single_size_keeps_the_prior_bandwidth() -> None:
    est = PathEstimator(seed=TierCost(2e9, 1e-4))
    for _ in range(50):
        est.observe(1 << 20, 0.001)
    assert est.estimate() == TierCost(2e9, 1e-4)  # alpha and B are not separable


def test_prefill_estimator_recovers_a_c_step() -> None:
    truth = PrefillCost(40e-6, 1.1e-9, 0.004)
    est = PrefillEstimator(seed=PrefillCost(1e-5, 1e-10))
    rng = random.Random(3)
    for _ in range(300):
        start = rng.randrange(0, 60_000, 512)
        end = start + rng.choice([512, 2048, 8192])
        est.observe(start, end, truth.seconds(start, end) * rng.uniform(0.95, 1.05))
    fit = est.estimate()
    assert fit.a_s_per_token == pytest.approx(40e-6, rel=0.1)
    assert fit.c_s_per_token2 == pytest.approx(1.1e-9, rel=0.1)
    assert fit.seconds(0, 32768) == pytest.approx(truth.seconds(0, 32768), rel=0.05)


def test_bad_observations_are_ignored() -> None:
    est = PrefillEstimator(seed=PrefillCost(1e-5, 1e-10), min_observations=1)
    est.observe(100, 50, 1.0)
    est.observe(0, 100, -1.0)
    assert est.estimate() == PrefillCost(1e-5, 1e-10)


def test_noise_that_hides_the_size_dependence_still_replaces_a_wrong_seed() -> None:
    # A loaded machine: small transfers as slow as big ones. The intercept fit gives a
    # non-positive slope; the estimate must still come from the data, not the seed that
    # is 1000x off (which the outlier gate would then defend against the measurements).
    est = PathEstimator(seed=TierCost(1e13, 0.0))
    for _ in range(10):
        for size, seconds in ((256 << 10, 4.6e-4), (1 << 20, 4.0e-4), (4 << 20, 4.4e-4)):
            est.observe(size, seconds)
    predicted = est.estimate().fetch_s(1 << 20)
    assert 1e-4 < predicted < 2e-3, predicted


def test_suffix_only_prefills_still_teach_the_cost_of_a_whole_prompt() -> None:
    """An engine with prefix hits reports only the last block of each prompt: every
    observation has the same length, so the per-step constant cannot be told from the
    per-token cost. The estimate must still price a whole prompt, not fall back to the
    seed (here a GPU-class seed, 500x too cheap for this CPU engine)."""
    a, c, step = 5e-4, 3.4e-6, 0.01

    def true_s(start: int, end: int) -> float:
        return a * (end - start) + c / 2 * (end**2 - start**2) + step

    rng = random.Random(3)
    est = PrefillEstimator(PrefillCost(a_s_per_token=1e-5, c_s_per_token2=1e-10))
    for length in [1536, 2304, 3072, 768] * 3:
        start = (length - 1) // 128 * 128
        est.observe(start, length, true_s(start, length) * rng.uniform(0.95, 1.05))
    whole = est.estimate().seconds(0, 2944)
    assert whole == pytest.approx(true_s(0, 2944), rel=0.2)
