from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvtier.index.estimators import (
    DRIFT_AFTER,
    ParallelRunEstimator,
    PathEstimator,
    PrefillEstimator,
    RunEstimator,
)
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


def test_single_size_prices_that_size_as_measured_with_the_seed_shape() -> None:
    # alpha and B are not separable from one size: the seed's split stays, scaled so the
    # estimate at that size is what was measured (here a drive 50x slower than its seed).
    seed = TierCost(2e9, 1e-4)
    est = PathEstimator(seed=seed)
    for _ in range(50):
        est.observe(1 << 20, 0.03)
    fitted = est.estimate()
    assert fitted.fetch_s(1 << 20) == pytest.approx(0.03, rel=1e-6)
    assert fitted.latency_s * fitted.bandwidth_bytes_per_s == pytest.approx(
        seed.latency_s * seed.bandwidth_bytes_per_s, rel=1e-6
    )


def test_a_throttled_path_is_learned_from_its_new_reads_not_averaged_with_the_old() -> None:
    # Calibrated fast at many sizes, then every read of the engine's one block size takes
    # 250 ms (a throttled or remote drive): once the gate accepts that the path changed,
    # the estimate is the new cost, not a line through the old points and the new ones.
    est = PathEstimator(seed=TierCost(1e9, 0.0))
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    for size in sizes * 10:
        est.observe(size, 50e-6 + size / 2e9)
    block = 2 << 20
    for _ in range(15):
        est.observe(block, 0.25)
    assert est.estimate().fetch_s(block) == pytest.approx(0.25, rel=0.1)


@pytest.mark.parametrize(
    "calibration_ms",
    [
        # A start-up calibration cut short (fewer points than warm the gate), one of
        # whose reads stalled behind something else on the disk: as CI measured it.
        [(256 << 10, 0.23), (1 << 20, 187.0), (4 << 20, 44.0), (256 << 10, 1.2), (1 << 20, 1.3)],
        [(256 << 10, 0.2), (1 << 20, 0.6)],
        [(4 << 20, 2.2), (1 << 20, 0.6), (256 << 10, 0.2), (4 << 20, 650.0)],
    ],
)
def test_a_short_calibration_then_a_throttled_drive_prices_the_reads_as_they_ran(
    calibration_ms: list[tuple[int, float]],
) -> None:
    # Then every read of the engine's one size is latency-bound (50 ms, some stalled up to
    # 150): a line through those and the few calibration points must not extrapolate far
    # from what they took (through the origin, it priced them at 11 ms for 60).
    for seed in range(10):
        est = PathEstimator(seed=TierCost(1.9 * 2**30, 200e-6))
        for size, ms in calibration_ms:
            est.observe(size, ms / 1e3)
        rng = random.Random(seed)
        taken_s = [0.05 + rng.uniform(0, 0.01) * rng.choice([1, 1, 1, 10]) for _ in range(32)]
        for seconds in taken_s:
            est.observe(256 << 10, seconds)
        mean_s = sum(taken_s) / len(taken_s)
        assert mean_s / 1.25 < est.estimate().fetch_s(256 << 10) < mean_s * 1.25, seed


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


@settings(max_examples=200, deadline=None)
@given(
    a=st.floats(0, 1e-3),
    c=st.floats(0, 1e-6),
    step=st.floats(0, 0.05),
    spans=st.lists(st.tuples(st.integers(0, 64), st.integers(1, 64)), min_size=8, max_size=40),
    noise=st.lists(st.floats(0.5, 2.0), min_size=40, max_size=40),
)
def test_prefill_fit_is_non_negative_and_no_worse_than_any_non_negative_truth(
    a: float,
    c: float,
    step: float,
    spans: list[tuple[int, int]],
    noise: list[float],
) -> None:
    """Whatever the reports (noisy, all one length, all from 0), the fit has no negative
    cost and fits them at least as well as the truth that made them (a non-negative
    candidate), so it is the non-negative least-squares optimum, not a clamped one."""
    truth = PrefillCost(a, c, step)
    est = PrefillEstimator(PrefillCost(1e-5, 1e-10), outlier_factor=1e9)
    observed: list[tuple[int, int, float]] = []
    for (start_blocks, length_blocks), factor in zip(spans, noise, strict=False):
        start, end = start_blocks * 128, (start_blocks + length_blocks) * 128
        seconds = truth.seconds(start, end) * factor
        if seconds > 0:
            est.observe(start, end, seconds)
            observed.append((start, end, seconds))
    fit = est.estimate()
    assert min(fit.a_s_per_token, fit.c_s_per_token2, fit.step_s) >= 0
    if len(observed) < 8 or fit == est.seed:
        return

    def weighted_error(cost: PrefillCost) -> float:
        n = len(observed)
        return sum(
            0.98 ** (n - 1 - i) * (cost.seconds(s, e) - y) ** 2
            for i, (s, e, y) in enumerate(observed)
        )

    assert weighted_error(fit) <= weighted_error(truth) * (1 + 1e-6) + 1e-18


@given(st.lists(st.tuples(st.integers(1, 64 << 20), st.floats(1e-6, 1.0)), min_size=0, max_size=30))
@settings(max_examples=50, deadline=None)
def test_cached_estimates_equal_a_fresh_solve_after_every_observation(
    points: list[tuple[int, float]],
) -> None:
    """The estimate a Plan reads is solved once per observation and reused: after every
    observe (and a seed change) it is exactly what solving from scratch gives."""
    path = PathEstimator(seed=TierCost(1e9, 1e-5), min_observations=3)
    prefill = PrefillEstimator(seed=PrefillCost(1e-4, 1e-9), min_observations=3)
    for size, seconds in points:
        path.observe(size, seconds)
        prefill.observe(0, size % 8192 + 1, seconds)
        assert path.estimate() == path._solve()
        assert path.estimate() is path.estimate()
        assert prefill.estimate() == prefill._solve()
    path.seed = TierCost(5e8, 2e-5)
    prefill.seed = PrefillCost(2e-4, 0.0)
    assert path.estimate() == path._solve()
    assert prefill.estimate() == prefill._solve()


def _lognormal_noise(rng: random.Random, sigma: float) -> float:
    return rng.lognormvariate(0.0, sigma)


def test_run_estimator_converges_on_a_call_cost_it_was_not_given() -> None:
    """Calls of 1-16 blocks of 256 KiB-4 MiB whose time is 180 µs per call + 6 µs per block
    + 1 / 9 GB/s per byte, with ±10 % noise: after 200 calls, every (depth, size) pairing,
    including ones it never saw (2 and 64 blocks, 2 MiB), is predicted within 7 %. A fit
    per block (what the planner had) cannot: it is off by several times at one end."""
    from kvtier.index.estimators import RunEstimator

    def truth(blocks: int, size: int) -> float:
        return 180e-6 + blocks * 6e-6 + blocks * size / 9e9

    rng = random.Random(3)
    est = RunEstimator()
    per_block = PathEstimator(TierCost(1e12, 0.0))
    assert est.estimate() is None
    for _ in range(200):
        blocks, size = rng.choice([1, 4, 16]), rng.choice([256 << 10, 1 << 20, 4 << 20])
        seconds = truth(blocks, size) * _lognormal_noise(rng, 0.1)
        est.observe(blocks, blocks * size, seconds)
        per_block.observe(size, seconds / blocks)
    fit = est.estimate()
    assert fit is not None
    worst_per_block = 0.0
    for blocks in (1, 2, 4, 16, 64):
        for size in (256 << 10, 2 << 20, 4 << 20):
            want = truth(blocks, size)
            assert fit.seconds(blocks, blocks * size) == pytest.approx(want, rel=0.07)
            alone = blocks * per_block.estimate().fetch_s(size)
            worst_per_block = max(worst_per_block, abs(alone - want) / want)
    assert worst_per_block > 1.0  # the premise: per-block pricing is not honest across depths


def test_parallel_run_estimator_finds_the_overlap_the_machine_gives() -> None:
    """Reads overlap 2 at a time (two cores verifying) though 8 threads were configured: a
    run of m blocks takes 400 µs + ceil(m / 2) * (150 µs + size / 1.2 GB/s), ±10 %. The fit
    finds s = 2 and predicts depths it never saw (3, 7, 32 blocks) within 8 %."""
    from kvtier.index.estimators import ParallelRunEstimator

    def truth(blocks: int, size: int) -> float:
        return 400e-6 + -(-blocks // 2) * (150e-6 + size / 1.2e9)

    rng = random.Random(5)
    est = ParallelRunEstimator(max_streams=8)
    assert est.candidates == [1, 2, 4, 8]
    for _ in range(300):
        blocks, size = rng.choice([1, 2, 4, 16]), rng.choice([256 << 10, 1 << 20, 4 << 20])
        est.observe([size] * blocks, truth(blocks, size) * _lognormal_noise(rng, 0.1))
    fitted = est.estimate()
    assert fitted is not None
    cost, streams = fitted
    assert streams == 2
    for blocks in (1, 3, 7, 32):
        for size in (256 << 10, 1 << 20, 4 << 20):
            rounds = -(-blocks // streams)
            got = cost.seconds(rounds, rounds * size)
            assert got == pytest.approx(truth(blocks, size), rel=0.08), (blocks, size)


def test_run_estimators_ignore_bad_observations_and_stay_cold_until_warm() -> None:
    from kvtier.index.estimators import ParallelRunEstimator, RunEstimator

    run, parallel = RunEstimator(min_observations=4), ParallelRunEstimator(4)
    for bad in ((0, 100, 1.0), (1, 0, 1.0), (1, 100, 0.0), (1, 100, float("nan"))):
        run.observe(*bad)
    parallel.observe([], 1.0)
    parallel.observe([100], -1.0)
    parallel.observe([0], 1.0)
    assert run.observations == parallel.observations == 0
    for i in range(3):
        run.observe(1 + i, 1000 * (1 + i), 1e-3 * (1 + i))
    assert run.estimate() is None  # three calls: still the caller's per-block figures
    run.observe(8, 8000, 8e-3)
    assert run.estimate() is not None


_SIZES = (256 << 10, 1 << 20, 4 << 20)


@settings(max_examples=60, deadline=None)
@given(
    per_call_s=st.floats(5e-6, 2e-3),
    per_block_s=st.floats(0.0, 50e-6),
    bytes_per_s=st.floats(0.5e9, 30e9),
    sigma=st.floats(0.0, 0.1),
    seed=st.integers(0, 2**16),
)
def test_run_fit_recovers_a_call_latency_and_bandwidth_through_noise(
    per_call_s: float, per_block_s: float, bytes_per_s: float, sigma: float, seed: int
) -> None:
    """Calls of 1-16 blocks timed as per_call + blocks * per_block + bytes / bandwidth with
    lognormal noise: after 150 calls the fit prices runs it never saw (2 and 32 blocks,
    512 KiB and 3 MiB) within 12 %, and its fixed cost and bandwidth where they decide."""
    from kvtier.index.estimators import RunEstimator

    def truth(blocks: int, size_bytes: int) -> float:
        return per_call_s + blocks * per_block_s + blocks * size_bytes / bytes_per_s

    rng = random.Random(seed)
    est = RunEstimator()
    for _ in range(150):
        blocks, size = rng.choice([1, 4, 16]), rng.choice(_SIZES)
        est.observe(blocks, blocks * size, truth(blocks, size) * _lognormal_noise(rng, sigma))
    fit = est.estimate()
    assert fit is not None
    for blocks in (1, 2, 32):
        for size in (512 << 10, 3 << 20):
            want = truth(blocks, size)
            assert fit.seconds(blocks, blocks * size) == pytest.approx(want, rel=0.12)
    if per_call_s > 10 * (per_block_s + (4 << 20) / bytes_per_s):  # the call's start decides
        assert fit.per_run_s == pytest.approx(per_call_s, rel=0.12)
    if (256 << 10) / bytes_per_s > 10 * (per_call_s + per_block_s):  # the bytes decide
        assert 1 / fit.per_byte_s == pytest.approx(bytes_per_s, rel=0.12)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.integers(1, 64 << 20), st.floats(1e-7, 10.0)),
        min_size=0,
        max_size=60,
    )
)
def test_run_fits_never_price_anything_below_zero(calls: list[tuple[int, int, float]]) -> None:
    """Whatever the calls (noise that makes bigger runs look faster, one size only, a
    burst of stalls), no term of either run fit is negative, so no run costs less than
    nothing and a longer run never costs less than a shorter one of the same blocks."""
    from kvtier.index.estimators import ParallelRunEstimator, RunEstimator

    run, parallel = RunEstimator(min_observations=4), ParallelRunEstimator(4)
    for blocks, size_bytes, seconds in calls:
        run.observe(blocks, size_bytes, seconds)
        parallel.observe([max(1, size_bytes // blocks)] * blocks, seconds)
        for fit in (run.estimate(), (parallel.estimate() or (None, 1))[0]):
            if fit is None:
                continue
            assert min(fit.per_run_s, fit.per_unit_s, fit.per_byte_s) >= 0
            assert fit.seconds(1, 1 << 20) <= fit.seconds(2, 2 << 20)


@settings(max_examples=40, deadline=None)
@given(
    factor=st.sampled_from([0.4, 0.5, 2.0, 3.0, 8.0, 30.0]),
    sigma=st.floats(0.0, 0.05),
    seed=st.integers(0, 2**16),
)
# Restarted from the run past the gate, these fits were 15 % and 50 % off (1 x 256 KiB).
@example(factor=8.0, sigma=0.05, seed=47657)
@example(factor=8.0, sigma=0.05, seed=4728)
def test_run_fit_follows_a_tier_that_slows_or_recovers(
    factor: float, sigma: float, seed: int
) -> None:
    """200 calls at one speed, then the tier's every cost moves by `factor` (a drive
    throttled 2x, a neighbour's load gone): within 25 calls the fit prices the new
    regime within 15 %. A 2-3x change is within the outlier gate, so only the drift rule
    (calls one way off, in a row) moves it that soon; the decayed fit alone took 110-180."""
    from kvtier.index.estimators import RunEstimator

    def truth(blocks: int, size_bytes: int, scale: float) -> float:
        return scale * (30e-6 + blocks * 5e-6 + blocks * size_bytes / 10e9)

    rng = random.Random(seed)
    est = RunEstimator()
    for _ in range(200):
        blocks, size = rng.choice([1, 4, 16]), rng.choice(_SIZES)
        est.observe(blocks, blocks * size, truth(blocks, size, 1.0) * _lognormal_noise(rng, sigma))
    for _ in range(25):
        blocks, size = rng.choice([1, 4, 16]), rng.choice(_SIZES)
        est.observe(
            blocks, blocks * size, truth(blocks, size, factor) * _lognormal_noise(rng, sigma)
        )
    fit = est.estimate()
    assert fit is not None
    for blocks in (1, 8, 16):
        for size in (256 << 10, 4 << 20):
            want = truth(blocks, size, factor)
            assert fit.seconds(blocks, blocks * size) == pytest.approx(want, rel=0.15)


def test_a_tier_that_changes_shape_past_the_gate_is_relearned_not_moved() -> None:
    """Past the gate, the fit keeps its shape and moves its level only when the run of far
    calls agrees on one ratio (as `test_run_fit_follows_a_tier_that_slows_or_recovers`):
    here the call's start costs 20x and the rest 5x, so a 1-block 256 KiB call is 12x
    slower and a 16-block 4 MiB one 5x. Whether the run shows that (the fit restarts from
    it) or shows only 16-block calls, whose ratios agree (the fit is moved, then the first
    short call it misses by 2x and the restart beside it does not makes the restart the
    fit), 25 calls later every pairing is priced within 15 %."""
    from kvtier.index.estimators import RunEstimator

    def old(blocks: int, size_bytes: int) -> float:
        return 30e-6 + blocks * 5e-6 + size_bytes / 10e9

    def new(blocks: int, size_bytes: int) -> float:
        return 20 * 30e-6 + blocks * 25e-6 + 5 * size_bytes / 10e9

    cells = [(b, s) for b in (1, 4, 16) for s in _SIZES]
    # The premise: no level fits the new regime with the old shape within 25 %.
    ratios = [new(b, b * s) / old(b, b * s) for b, s in cells]
    assert max(ratios) / min(ratios) > 2.0
    for run in (cells, [(16, s) for s in _SIZES]):  # the run shows every kind, or only long ones
        rng = random.Random(5)
        est = RunEstimator()
        for _ in range(200):
            blocks, size = rng.choice(cells)
            est.observe(
                blocks, blocks * size, old(blocks, blocks * size) * _lognormal_noise(rng, 0.02)
            )
        calls = [rng.choice(run) for _ in range(11)] + [rng.choice(cells) for _ in range(14)]
        for blocks, size in calls:
            est.observe(
                blocks, blocks * size, new(blocks, blocks * size) * _lognormal_noise(rng, 0.02)
            )
        fit = est.estimate()
        assert fit is not None
        for blocks in (1, 8, 16):
            for size in (256 << 10, 4 << 20):
                want = new(blocks, blocks * size)
                assert fit.seconds(blocks, blocks * size) == pytest.approx(want, rel=0.15), run


def test_a_stationary_noisy_tier_does_not_drift() -> None:
    """The drift rule needs `accept_after` calls in a row off the same way by 25 %: noise
    of 10 % (lognormal) never gets there, so the fit stays the least-squares fit."""
    from kvtier.index.estimators import RunEstimator

    rng = random.Random(11)
    with_rule, without = RunEstimator(), RunEstimator(drift_factor=None)
    for _ in range(2000):
        blocks, size = rng.choice([1, 4, 16]), rng.choice(_SIZES)
        seconds = (30e-6 + blocks * size / 10e9) * _lognormal_noise(rng, 0.1)
        with_rule.observe(blocks, blocks * size, seconds)
        without.observe(blocks, blocks * size, seconds)
    assert with_rule.estimate() == without.estimate()


def _price(est: RunEstimator | ParallelRunEstimator, blocks: int, size_bytes: int) -> float:
    """What either run fit prices a run of `blocks` blocks of `size_bytes` at."""
    if isinstance(est, RunEstimator):
        fit = est.estimate()
        assert fit is not None
        return fit.seconds(blocks, blocks * size_bytes)
    fitted = est.estimate()
    assert fitted is not None
    cost, streams = fitted
    rounds = -(-blocks // streams)
    return cost.seconds(rounds, rounds * size_bytes)


def _observe(
    est: RunEstimator | ParallelRunEstimator, blocks: int, size_bytes: int, seconds: float
) -> None:
    if isinstance(est, RunEstimator):
        est.observe(blocks, blocks * size_bytes, seconds)
    else:
        est.observe([size_bytes] * blocks, seconds)


def test_a_young_run_fit_learns_from_every_call_the_drift_rule_would_hold() -> None:
    """Five calls of one shape (the call's start dear, few blocks), then calls that cost
    1.6x that shape's price (inside the 4x gate, outside the drift rule's 25 %), as after
    a start when a few calls have not shown the tier yet: each call moves the young fit
    towards them (it was frozen for ten calls, each priced 1.6x off). A fit that has seen
    DRIFT_AFTER calls holds them as before (the drift rule's own tests)."""

    def first(blocks: int, size_bytes: int) -> float:
        return 400e-6 + blocks * (200e-6 + size_bytes / 1e9)

    def later(blocks: int, size_bytes: int) -> float:
        return 1.6 * first(blocks, size_bytes)

    rng = random.Random(2)
    young = [(1, 1 << 20), (4, 256 << 10), (1, 4 << 20), (2, 1 << 20), (4, 4 << 20)]
    estimators: list[RunEstimator | ParallelRunEstimator] = [
        RunEstimator(min_observations=4),
        ParallelRunEstimator(4),
    ]
    for est in estimators:
        for blocks, size in young:
            _observe(est, blocks, size, first(blocks, size))
        calls = [(rng.choice([1, 2, 4]), rng.choice(_SIZES)) for _ in range(5)]
        errors = [max(abs(_price(est, b, s) - later(b, s)) / later(b, s) for b, s in calls)]
        assert errors[0] > 0.25  # the premise: priced outside the drift rule's band
        estimates = [est.estimate()]
        for blocks, size in calls:
            _observe(est, blocks, size, later(blocks, size))
            estimates.append(est.estimate())
        errors.append(max(abs(_price(est, b, s) - later(b, s)) / later(b, s) for b, s in calls))
        assert all(a != b for a, b in itertools.pairwise(estimates)), est  # none held
        assert errors[1] < 0.9 * errors[0], (est, errors)
    assert len(young) + 5 < DRIFT_AFTER
