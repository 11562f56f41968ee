"""Rate limits: the token bucket's envelope, and per-tenant limits from the configuration."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import Config
from kvtier.server.ratelimit import RateLimiter, TokenBucket

# A little slack for float rounding in `elapsed * rate` sums, far below one token.
EPS = 1e-6

rates = st.floats(min_value=0.1, max_value=1000.0)
bursts = st.floats(min_value=1.0, max_value=100.0)


@settings(max_examples=200, deadline=None)
@given(
    rate_per_s=rates,
    burst=bursts,
    arrivals=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=2.0), st.floats(min_value=0.01, max_value=1)),
        min_size=1,
        max_size=120,
    ),
)
def test_never_admits_more_than_rate_times_window_plus_burst(
    rate_per_s: float, burst: float, arrivals: list[tuple[float, float]]
) -> None:
    bucket = TokenBucket(rate_per_s, burst, now_s=0.0)
    now_s = 0.0
    admitted: list[tuple[float, float]] = []
    for gap_s, fraction in arrivals:
        now_s += gap_s
        amount = fraction * burst
        if bucket.take(amount, now_s) == 0.0:
            admitted.append((now_s, amount))
    for (i, (start_s, _)), (j, (end_s, _)) in itertools.combinations_with_replacement(
        enumerate(admitted), 2
    ):
        total = sum(amount for _, amount in admitted[i : j + 1])
        assert total <= rate_per_s * (end_s - start_s) + burst + EPS * burst


@settings(max_examples=200, deadline=None)
@given(
    rate_per_s=rates,
    burst=bursts,
    slack=st.lists(st.floats(min_value=1e-6, max_value=5.0), min_size=1, max_size=200),
)
def test_admits_everything_under_the_rate(
    rate_per_s: float, burst: float, slack: list[float]
) -> None:
    """Requests never closer than 1/rate apart are all admitted, after any burst."""
    bucket = TokenBucket(rate_per_s, burst, now_s=0.0)
    for _ in range(int(burst)):  # spend the whole burst at once: all of it admitted
        assert bucket.take(1.0, 0.0) == 0.0
    now_s = 0.0
    for extra in slack:
        now_s += (1.0 + extra) / rate_per_s
        assert bucket.take(1.0, now_s) == 0.0


@settings(max_examples=200, deadline=None)
@given(rate_per_s=rates, burst=bursts, spent=st.integers(min_value=0, max_value=5))
def test_the_retry_hint_is_when_the_request_would_pass(
    rate_per_s: float, burst: float, spent: int
) -> None:
    bucket = TokenBucket(rate_per_s, burst, now_s=0.0)
    while bucket.take(1.0, 0.0) == 0.0:
        pass
    wait_s = bucket.take(1.0, 0.0)
    assert 0.0 < wait_s <= 1.0 / rate_per_s + EPS
    assert bucket.take(1.0, wait_s * (1 + EPS)) == 0.0


def test_a_refused_take_takes_nothing_and_a_clock_step_back_drains_nothing() -> None:
    bucket = TokenBucket(2.0, 2.0, now_s=10.0)
    assert bucket.take(2.0, 10.0) == 0.0
    assert bucket.take(1.0, 10.0) == pytest.approx(0.5)
    assert bucket.take(1.0, 9.0) == pytest.approx(0.5)  # earlier time: no refill, no drain
    assert bucket.take(1.0, 10.5) == 0.0
    with pytest.raises(ValueError, match="burst"):
        bucket.take(3.0, 10.5)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _config(**sections: object) -> Config:
    return Config.model_validate(sections)


def _tenants(**overrides: object) -> dict[str, object]:
    return {
        name: {"dram_capacity_bytes": "16MiB", **fields}  # type: ignore[dict-item]
        for name, fields in overrides.items()
    }


def test_a_tenant_over_its_own_rate_is_refused_and_the_others_are_not() -> None:
    clock = FakeClock()
    config = _config(
        limits={"requests_per_s": 100},
        tenants=_tenants(a={"requests_per_s": 2, "request_burst": 3}, b={}),
    )
    limiter = RateLimiter(config, clock)
    assert [limiter.admit_request("a") for _ in range(3)] == [None, None, None]
    refusal = limiter.admit_request("a")
    assert refusal is not None
    assert refusal.retry_after_s == pytest.approx(0.5)
    assert "tenant 'a'" in refusal.message and "2 requests/s, burst 3" in refusal.message
    assert "tenants.a.requests_per_s" in refusal.message and "retry in 500 ms" in refusal.message
    assert all(limiter.admit_request("b") is None for _ in range(100))  # global: burst 100
    refusal_b = limiter.admit_request("b")
    assert refusal_b is not None
    assert "limits.requests_per_s (or set tenants.b.requests_per_s)" in refusal_b.message
    assert all(limiter.admit_request("default") is None for _ in range(100))
    clock.now_s += 0.5
    assert limiter.admit_request("a") is None


def test_zero_means_unlimited() -> None:
    clock = FakeClock()
    limiter = RateLimiter(_config(tenants=_tenants(a={"requests_per_s": 0})), clock)
    assert all(limiter.admit_request("a") is None for _ in range(10_000))
    assert all(limiter.admit_bytes("a", 1 << 30) is None for _ in range(100))


def test_payload_bytes_are_limited_and_the_burst_is_never_below_the_largest_block() -> None:
    clock = FakeClock()
    config = _config(
        limits={"max_block_bytes": "4MiB", "payload_bytes_per_s": "1MiB"},
        tenants=_tenants(a={"payload_burst_bytes": "1KiB"}),
    )
    limiter = RateLimiter(config, clock)
    assert limiter.admit_bytes("a", 4 << 20) is None  # burst raised to max_block_bytes
    refusal = limiter.admit_bytes("a", 1 << 20)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(1.0)
    assert "block payload rate" in refusal.message
    assert "limits.payload_bytes_per_s" in refusal.message
    assert limiter.admit_request("a") is None  # requests are not limited here
    clock.now_s += 1.0
    assert limiter.admit_bytes("a", 1 << 20) is None
    # A block larger than the burst (a reload lowered max_block_bytes) empties the bucket
    # instead of being refused for ever.
    clock.now_s += 10.0
    assert limiter.admit_bytes("a", 64 << 20) is None
    assert limiter.admit_bytes("a", 1) is not None


def test_reconfigure_keeps_what_was_used_and_can_lift_a_limit() -> None:
    clock = FakeClock()
    tight = _config(tenants=_tenants(a={"requests_per_s": 1, "request_burst": 5}))
    limiter = RateLimiter(tight, clock)
    assert all(limiter.admit_request("a") is None for _ in range(5))
    assert limiter.admit_request("a") is not None
    # A reload with a larger burst does not refill the bucket: still empty.
    limiter.reconfigure(_config(tenants=_tenants(a={"requests_per_s": 1, "request_burst": 50})))
    assert limiter.admit_request("a") is not None
    clock.now_s += 2.0
    assert limiter.admit_request("a") is None and limiter.admit_request("a") is None
    assert limiter.admit_request("a") is not None
    # Lifting the limit (0) admits at once; setting one again starts from a full bucket.
    limiter.reconfigure(_config(tenants=_tenants(a={"requests_per_s": 0})))
    assert all(limiter.admit_request("a") is None for _ in range(1000))
    limiter.reconfigure(tight)
    assert all(limiter.admit_request("a") is None for _ in range(5))
    assert limiter.admit_request("a") is not None
