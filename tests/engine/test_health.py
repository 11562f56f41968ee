"""Tier health: offline after N consecutive errors, counted errors, back after a probe."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.engine.health import TierHealth


@given(st.integers(1, 8), st.lists(st.booleans(), max_size=60))
def test_offline_exactly_when_the_last_n_results_were_errors(
    limit: int, results: list[bool]
) -> None:
    clock = iter(range(1000))
    health = TierHealth("nvme", limit, clock_s=lambda: float(next(clock)))
    run = 0
    went_offline = False
    for ok in results:
        if ok:
            health.succeeded()
            run = 0
        else:
            went_offline |= health.failed(OSError(5, "EIO"))
            run += 1
        if run >= limit:
            went_offline = True
        # Once offline only a probe brings it back: successes alone do not.
        assert health.online is not went_offline
    assert health.errors_total == results.count(False)
    assert health.offline_transitions == (1 if went_offline else 0)


def test_a_probe_brings_it_back_and_it_can_fail_again() -> None:
    now = [0.0]
    health = TierHealth("nvme", 2, clock_s=lambda: now[0])
    assert not health.failed(OSError(5, "EIO"))
    assert health.failed(OSError(5, "EIO"))
    assert not health.online and health.offline_since_s == 0.0
    now[0] = 5.0
    health.recovered()
    assert health.online and health.consecutive_errors == 0
    assert not health.failed(OSError(5, "EIO"))
    assert health.failed(OSError(5, "EIO"))
    assert health.offline_transitions == 2
