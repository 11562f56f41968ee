"""Online estimators the planner reads: transfer cost per path and prefill cost per model.

Both fit a linear model by recency-weighted least squares: each new observation counts
fully, older ones decay by `decay` per observation (a half-life of ln 2 / -ln decay
observations), so the fit follows a drive or an engine whose speed changes. Outliers (a
transfer that stalled behind a flush, a prefill that waited for a batch) are skipped: once
the fit is warm, an observation more than `outlier_factor` times (or less than
1/`outlier_factor` of) the prediction is dropped — unless `accept_after` arrive in a row,
which means the path itself changed. Until enough observations arrive, the seed (a calibration or a
configured profile) is the answer.

    path:    seconds = alpha + bytes / bandwidth
    prefill: seconds = a*(e - s) + c*(e^2 - s^2)/2 + step       for tokens [s, e)
"""

from __future__ import annotations

from kvtier.index.planner import PrefillCost, TierCost


class _WeightedLeastSquares:
    """y ~ w . x, with the normal equations kept as decayed sums (no history stored)."""

    def __init__(self, dims: int, decay: float) -> None:
        self.dims = dims
        self.decay = decay
        self.xtx = [[0.0] * dims for _ in range(dims)]
        self.xty = [0.0] * dims
        self.count = 0

    def add(self, x: list[float], y: float) -> None:
        d = self.decay
        for i in range(self.dims):
            self.xty[i] = self.xty[i] * d + x[i] * y
            row = self.xtx[i]
            for j in range(self.dims):
                row[j] = row[j] * d + x[i] * x[j]
        self.count += 1

    def solve(self) -> list[float] | None:
        """The fitted weights, or None while the system is singular (too few or same points)."""
        n = self.dims
        a = [[*row, self.xty[i]] for i, row in enumerate(self.xtx)]
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            scale = max(abs(a[r][col]) for r in range(n)) or 1.0
            if abs(a[pivot][col]) <= 1e-12 * scale:
                return None
            a[col], a[pivot] = a[pivot], a[col]
            for r in range(n):
                if r != col:
                    factor = a[r][col] / a[col][col]
                    for cc in range(col, n + 1):
                        a[r][cc] -= factor * a[col][cc]
        return [a[i][n] / a[i][i] for i in range(n)]


class _OutlierGate:
    """Drops observations far from the prediction once the fit is warm, unless they keep
    coming (then the path changed and they are the new normal)."""

    def __init__(self, factor: float, warm_after: int, accept_after: int = 10) -> None:
        self.factor = factor
        self.warm_after = warm_after
        self.accept_after = accept_after
        self.rejected_in_a_row = 0

    def admit(self, observed: float, predicted: float, seen: int) -> bool:
        far = predicted > 0 and not predicted / self.factor <= observed <= predicted * self.factor
        if seen >= self.warm_after and far and self.rejected_in_a_row < self.accept_after:
            self.rejected_in_a_row += 1
            return False
        self.rejected_in_a_row = 0
        return True


class PathEstimator:
    """Transfer cost of one path (e.g. nvme -> engine): alpha + bytes / bandwidth."""

    def __init__(
        self,
        seed: TierCost,
        decay: float = 0.98,
        min_observations: int = 8,
        outlier_factor: float = 4.0,
    ) -> None:
        self.seed = seed
        self._fit = _WeightedLeastSquares(2, decay)
        self._min = min_observations
        self._gate = _OutlierGate(outlier_factor, min_observations)

    def observe(self, size_bytes: int, seconds: float) -> None:
        if size_bytes <= 0 or seconds <= 0:
            return
        if self._gate.admit(seconds, self.estimate().fetch_s(size_bytes), self._fit.count):
            self._fit.add([1.0, float(size_bytes)], seconds)

    def estimate(self) -> TierCost:
        if self._fit.count < self._min:
            return self.seed
        weights = self._fit.solve()
        if weights is None:
            return self.seed  # all transfers one size: alpha and B are not separable
        if weights[1] > 0:
            alpha, per_byte = weights
            return TierCost(bandwidth_bytes_per_s=1 / per_byte, latency_s=max(alpha, 0.0))
        # Noise that makes bigger transfers look no slower (a loaded machine): the data
        # still says what a byte costs on average — seconds
        # proportional to bytes, fitted through the origin. Falling back to the seed here
        # would throw away what was measured (and the outlier gate would then reject
        # measurements for being far from that seed).
        sum_xy, sum_xx = self._fit.xty[1], self._fit.xtx[1][1]
        if sum_xy <= 0 or sum_xx <= 0:
            return self.seed
        return TierCost(bandwidth_bytes_per_s=sum_xx / sum_xy, latency_s=0.0)


class PrefillEstimator:
    """Prefill cost of one model from the timings engines report."""

    def __init__(
        self,
        seed: PrefillCost,
        decay: float = 0.98,
        min_observations: int = 8,
        outlier_factor: float = 4.0,
    ) -> None:
        self.seed = seed
        self._fit = _WeightedLeastSquares(3, decay)
        # Without the per-step constant: what is left to fit when every observation has
        # the same length (an engine whose prefills are all a block's suffix after a
        # prefix hit makes the step constant and the per-token term indistinguishable).
        self._fit_no_step = _WeightedLeastSquares(2, decay)
        self._min = min_observations
        self._gate = _OutlierGate(outlier_factor, min_observations)

    def observe(self, start_token: int, end_token: int, seconds: float) -> None:
        if end_token <= start_token or seconds <= 0:
            return
        predicted = self.estimate().seconds(start_token, end_token)
        if self._gate.admit(seconds, predicted, self._fit.count):
            x = [float(end_token - start_token), (end_token**2 - start_token**2) / 2, 1.0]
            self._fit.add(x, seconds)
            self._fit_no_step.add(x[:2], seconds)

    def estimate(self) -> PrefillCost:
        if self._fit.count < self._min:
            return self.seed
        weights = self._fit.solve()
        if weights is not None and weights[0] > 0:
            a, c, step = weights
            return PrefillCost(a_s_per_token=a, c_s_per_token2=max(c, 0.0), step_s=max(step, 0.0))
        reduced = self._fit_no_step.solve()
        if reduced is not None and reduced[0] > 0:
            return PrefillCost(a_s_per_token=reduced[0], c_s_per_token2=max(reduced[1], 0.0))
        return self.seed
