"""Statistics for benchmark figures that a noisy drive moves from run to run."""

from __future__ import annotations

import math


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of `values`: the order
    statistics the sign test gives (k-th smallest and k-th largest, with k as large as
    keeps the chance of the median falling outside under 1 - confidence). None when
    there are too few values for that confidence (fewer than 6 at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    tail = (1 - confidence) / 2
    k = 0
    below = 0.0  # P(Binomial(n, 1/2) < k)
    while k < n and (with_k := below + math.comb(n, k) / 2**n) <= tail:
        below = with_k
        k += 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]
