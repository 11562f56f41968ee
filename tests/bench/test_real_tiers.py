"""The error figure of `kvtier bench planner --real-tiers`: known inputs, known answers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.bench.real_tiers import fetch_errors


def test_relative_errors_p50_and_p90_by_nearest_rank() -> None:
    # Errors 0.0, 0.1, ..., 0.9 (predicted = measured * (1 ± e)), shuffled, both signs.
    measured = [2.0, 1.0, 4.0, 0.5, 8.0, 1.0, 3.0, 2.0, 5.0, 1.0]
    errors = [0.3, 0.0, 0.9, 0.5, 0.1, 0.7, 0.2, 0.8, 0.4, 0.6]
    signs = [1, -1, 1, -1, 1, 1, -1, -1, 1, -1]
    predicted = [m * (1 + s * e) for m, e, s in zip(measured, errors, signs, strict=True)]
    got = fetch_errors(predicted, measured)
    assert got.count == 10
    assert got.p50 == pytest.approx(0.4)  # the 5th smallest of ten
    assert got.p90 == pytest.approx(0.8)  # the 9th: a figure some fetch had
    assert got.worst == pytest.approx(0.9)
    # Relative to what was measured, not to the prediction: 2 s predicted for 1 s is 100 %.
    assert fetch_errors([2.0], [1.0]).p90 == pytest.approx(1.0)
    assert fetch_errors([0.5], [1.0]).p90 == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("predicted", "measured"), [([], []), ([1.0], [1.0, 2.0]), ([1.0], [0.0]), ([1.0], [-1.0])]
)
def test_bad_inputs_are_refused(predicted: list[float], measured: list[float]) -> None:
    with pytest.raises(ValueError):
        fetch_errors(predicted, measured)


@given(
    st.lists(st.tuples(st.floats(1e-6, 10.0), st.floats(1e-6, 10.0)), min_size=1, max_size=200),
    st.floats(1e-3, 1e3),
)
def test_percentiles_are_ordered_scale_free_and_taken_from_the_errors(
    pairs: list[tuple[float, float]], scale: float
) -> None:
    predicted = [p for p, _ in pairs]
    measured = [m for _, m in pairs]
    got = fetch_errors(predicted, measured)
    errors = sorted(abs(p - m) / m for p, m in pairs)
    assert got.p50 <= got.p90 <= got.worst == errors[-1]
    assert got.p50 in errors and got.p90 in errors
    # At least 90 % of the fetches are within the p90, and fewer than 90 % are below it.
    assert sum(e <= got.p90 for e in errors) >= 0.9 * len(errors)
    assert sum(e < got.p90 for e in errors) < 0.9 * len(errors)
    scaled = fetch_errors([p * scale for p in predicted], [m * scale for m in measured])
    assert scaled.p90 == pytest.approx(got.p90, rel=1e-9, abs=1e-12)
