"""Online estimators the planner reads: transfer cost per path and prefill cost per model.

Both fit a linear model by recency-weighted least squares: each new observation counts
fully, older ones decay by `decay` per observation (a half-life of ln 2 / -ln decay
observations), so the fit follows a drive or an engine whose speed changes. Outliers (a
transfer that stalled behind a flush, a prefill that waited for a batch) are skipped: once
the fit is warm, an observation more than `outlier_factor` times (or less than
1/`outlier_factor` of) the prediction is dropped — unless `accept_after` arrive in a row,
which means the path itself changed: then the fit starts again from those observations
(a drive throttled 100x would otherwise be averaged with the fast past for a long while).
The run fits, which have a drift rule, restart only if the run's calls disagree on one
ratio: a run that agrees moves the fit's level and keeps its shape (see `_OutlierGate`).
Until enough observations arrive, the seed (a calibration or a configured profile) is the
answer.

    path:    seconds = alpha + bytes / bandwidth
    prefill: seconds = a*(e - s) + c*(e^2 - s^2)/2 + step       for tokens [s, e)

Every weight is a cost, so none may be negative: the path and prefill fits are
non-negative least squares (exact, over the subsets of their terms), which keeps a cost
that noise would otherwise push below zero from being clamped after the fact (clamping one
term of an unconstrained fit leaves the others fitted to a model that is no longer the one
used).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvtier.index.planner import PrefillCost, TierCost

Verdict = Literal["admit", "reject", "changed", "jumped", "hold", "drifted"]


def _bandwidth(per_byte_s: float) -> float:
    """Bytes a second of a fitted per-byte cost; a fit with none (every call one size, or
    bigger ones no slower) is priced at 1 PB/s, not 1/0."""
    return 1 / max(per_byte_s, 1e-15)


class _WeightedLeastSquares:
    """y ~ w . x, with the normal equations kept as decayed sums (no history stored)."""

    def __init__(self, dims: int, decay: float) -> None:
        self.dims = dims
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        dims = self.dims
        self.xtx = [[0.0] * dims for _ in range(dims)]
        self.xty = [0.0] * dims
        self.yty = 0.0
        self.count = 0

    def load(self, other: _WeightedLeastSquares) -> None:
        """Become a copy of `other` (same dims and decay)."""
        self.xtx = [row[:] for row in other.xtx]
        self.xty = other.xty[:]
        self.yty, self.count = other.yty, other.count

    def add(self, x: list[float], y: float) -> None:
        d = self.decay
        for i in range(self.dims):
            self.xty[i] = self.xty[i] * d + x[i] * y
            row = self.xtx[i]
            for j in range(self.dims):
                row[j] = row[j] * d + x[i] * x[j]
        self.yty = self.yty * d + y * y
        self.count += 1

    def solve(self, columns: tuple[int, ...] | None = None) -> list[float] | None:
        """The fitted weights over `columns` (default all; the others 0), or None while
        that system is singular (too few or same points)."""
        cols = tuple(range(self.dims)) if columns is None else columns
        n = len(cols)
        a = [[*(self.xtx[i][j] for j in cols), self.xty[i]] for i in cols]
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
        weights = [0.0] * self.dims
        for i, c in enumerate(cols):
            weights[c] = a[i][n] / a[i][i]
        return weights

    def rescale(self, factor: float) -> None:
        """Every point so far as if its seconds were `factor` times what they were, for a
        fit of relative error (rows x / y, targets 1): the shape kept, the level moved."""
        inverse = 1 / factor
        for row in self.xtx:
            for j in range(self.dims):
                row[j] *= inverse * inverse
        self.xty = [v * inverse for v in self.xty]

    def residual(self, w: list[float]) -> float:
        """Weighted sum of squared errors of `w`: y'y - 2 w'X'y + w'X'X w."""
        quad = sum(w[i] * w[j] * self.xtx[i][j] for i in range(self.dims) for j in range(self.dims))
        return self.yty - 2 * sum(wi * b for wi, b in zip(w, self.xty, strict=True)) + quad

    def solve_nonnegative(self) -> list[float] | None:
        """Least squares with every weight >= 0: the best of the subset fits that come out
        non-negative (the constrained optimum is the unconstrained one on its support)."""
        best: tuple[float, list[float]] | None = None
        for size in range(1, self.dims + 1):
            for cols in itertools.combinations(range(self.dims), size):
                w = self.solve(cols)
                if w is None or min(w) < 0:
                    continue
                err = self.residual(w)
                if best is None or err < best[0]:
                    best = (err, w)
        return None if best is None else best[1]


class _OutlierGate:
    """Drops observations far from the prediction once the fit is warm, unless they keep
    coming (then the path changed and they are the new normal)."""

    def __init__(
        self,
        factor: float,
        warm_after: int,
        accept_after: int = 10,
        drift_factor: float | None = None,
        drift_after: int = 0,
    ) -> None:
        self.factor = factor
        self.warm_after = warm_after
        # The drift rule holds calls only once the fit has seen `drift_after` (and
        # `warm_after`): a younger fit is still finding its shape, and holding the calls
        # that disagree with it froze its error for `accept_after` calls (issue 26: after a
        # start, fitted to five calls, one-block NVMe runs priced 1.7x what they took for
        # six runs in a row, most of the real-tier check's p90).
        self.drift_after = max(warm_after, drift_after)
        self.accept_after = accept_after
        self.rejected: list[tuple[list[float], float]] = []  # the far ones, in a row
        self._rejected_ratios: list[float] = []  # their observed / predicted
        # `drift_factor`: calls inside the gate but all slower (or all faster) than
        # predicted by more than it, `accept_after` in a row, mean the path's level moved
        # (a tier that slowed 2x, too little for the gate): "drifted", by `drift_ratio`,
        # the median of their observed / predicted. Such calls are held ("hold") until the
        # run ends, so the ratio is against the fit they found, then `released` (to be
        # added before the current call, which is added only when "admit").
        # With a drift factor, a run past the gate that the old shape explains (every
        # call within `drift_factor` of the run's median ratio) is "jumped", not
        # "changed": the fit is moved to that ratio as on a drift, and keeps its shape,
        # instead of starting again from the run's few calls. The run may not have shown
        # every kind of call, so for `accept_after` calls after it the restart it spared
        # is kept beside the fit (`shadow`, see `_gated_add_relative`): a call the moved
        # fit misses by more than `drift_factor` and the restart predicts within it means
        # the shape changed too, and the restart becomes the fit.
        self.drift_factor = drift_factor
        self.shadow: list[_WeightedLeastSquares] | None = None
        self.probation = 0
        self._held: list[tuple[list[float], float]] = []
        self._held_ratios: list[float] = []
        self.released: list[tuple[list[float], float]] = []
        self.drift_ratio = 1.0

    def admit(self, x: list[float], observed: float, predicted: float, seen: int) -> Verdict:
        far = predicted > 0 and not predicted / self.factor <= observed <= predicted * self.factor
        ratio = observed / predicted if predicted > 0 else 1.0
        if not far or seen < self.warm_after:
            self.rejected.clear()
            self._rejected_ratios.clear()
            return self._drifted(x, observed, ratio, seen)
        self._release()
        if len(self.rejected) < self.accept_after:
            self.rejected.append((x, observed))
            self._rejected_ratios.append(ratio)
            return "reject"
        ratios = [*self._rejected_ratios, ratio]
        self._rejected_ratios = []
        drift = self.drift_factor
        if drift is not None:
            level = statistics.median(ratios)
            if all(1 / drift <= r / level <= drift for r in ratios):
                self.drift_ratio = level
                return "jumped"
        return "changed"

    def _release(self) -> None:
        self.released += self._held
        self._held, self._held_ratios = [], []

    def _drifted(self, x: list[float], observed: float, ratio: float, seen: int) -> Verdict:
        drift = self.drift_factor
        if drift is None or seen < self.drift_after or 1 / drift <= ratio <= drift:
            self._release()
            return "admit"
        if self._held_ratios and (self._held_ratios[0] > 1) != (ratio > 1):
            self._release()  # the other side: not one drift
        self._held.append((x, observed))
        self._held_ratios.append(ratio)
        if len(self._held) < self.accept_after:
            return "hold"
        self.drift_ratio = statistics.median(self._held_ratios)
        self._release()
        return "drifted"


def _gated_add(
    fit: _WeightedLeastSquares, gate: _OutlierGate, x: list[float], y: float, predicted: float
) -> None:
    verdict = gate.admit(x, y, predicted, fit.count)
    if verdict == "reject":
        return
    if verdict in ("changed", "jumped"):  # an absolute fit is not rescaled: it restarts
        fit.reset()
        for old_x, old_y in gate.rejected:
            fit.add(old_x, old_y)
        gate.rejected.clear()
    fit.add(x, y)


def _run_prediction(fits: list[_WeightedLeastSquares], features: list[list[float]]) -> float:
    """What run fits predict for a call with rows `features`, as the run estimators read
    them (the non-negative fit of least residual that grows with the run), or 0 if none."""
    best: tuple[float, float] | None = None
    for fit, x in zip(fits, features, strict=True):
        w = fit.solve_nonnegative()
        if w is None or w[1] + w[2] <= 0:
            continue
        err = fit.residual(w)
        if best is None or err < best[0] * (1 - 1e-9):
            best = (err, sum(wi * xi for wi, xi in zip(w, x, strict=True)))
    return 0.0 if best is None else best[1]


def _gated_add_relative(
    fits: list[_WeightedLeastSquares],
    features: list[list[float]],
    gate: _OutlierGate,
    raw: list[float],
    y: float,
    predicted: float,
    featurise: Callable[[int, list[float]], list[float]],
) -> bool:
    """As `_gated_add`, for fits that minimise the *relative* error: each point divided by
    its own seconds (a 0.3 ms call and a 60 ms call count alike; plain least squares would
    fit the long calls and leave short ones off by several times). `features[i]` is
    point `raw`'s row for fit i; `featurise(i, raw)` builds one for a replayed point. False
    if the fits did not change (the point dropped, or held by the drift rule)."""
    shadow, drift = gate.shadow, gate.drift_factor
    if shadow is not None and drift is not None:  # on probation after a jump
        gate.probation -= 1
        fresh = _run_prediction(shadow, features)
        if (
            predicted > 0
            and not 1 / drift <= y / predicted <= drift
            and fresh > 0
            and 1 / drift <= y / fresh <= drift
        ):  # the old shape misses a call the restart saw coming: restart after all
            for fit, restart in zip(fits, shadow, strict=True):
                fit.load(restart)
            shadow, predicted = None, fresh
        if shadow is None or gate.probation <= 0:
            gate.shadow = shadow = None
    verdict = gate.admit(raw, y, predicted, fits[0].count)

    def add_all(points: list[tuple[list[float], float]]) -> None:
        for old_raw, old_y in points:
            for i, fit in enumerate(fits):
                row = [v / old_y for v in featurise(i, old_raw)]
                fit.add(row, 1.0)
                if shadow is not None:
                    shadow[i].add(row, 1.0)
        points.clear()

    if verdict == "jumped":  # past the gate, but the same shape: keep a restart beside it
        shadow = gate.shadow = [_WeightedLeastSquares(fit.dims, fit.decay) for fit in fits]
        gate.probation = gate.accept_after
    if verdict in ("drifted", "jumped"):  # the same shape, at the level the latest calls ran at
        for fit in fits:
            fit.rescale(gate.drift_ratio)
    moved = verdict == "drifted" or bool(gate.released)
    add_all(gate.released)  # a run of held calls that ended (or drifted: then this one too)
    if verdict in ("reject", "hold", "drifted"):
        return moved
    if verdict == "changed":  # a new shape: only the run's calls describe it
        for fit in fits:
            fit.reset()
    if verdict in ("changed", "jumped"):
        add_all(gate.rejected)
    for i, (fit, x) in enumerate(zip(fits, features, strict=True)):
        fit.add([v / y for v in x], 1.0)
        if shadow is not None:
            shadow[i].add([v / y for v in x], 1.0)
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
        # Every Plan reads the estimate and few calls observe: solve once per observation.
        self._estimate: TierCost | None = None

    def observe(self, size_bytes: int, seconds: float) -> None:
        if size_bytes <= 0 or seconds <= 0:
            return
        predicted = self.estimate().fetch_s(size_bytes)
        _gated_add(self._fit, self._gate, [1.0, float(size_bytes)], seconds, predicted)
        self._estimate = None

    def estimate(self) -> TierCost:
        if self._estimate is None:
            self._estimate = self._solve()
        return self._estimate

    @property
    def seed(self) -> TierCost:
        return self._seed

    @seed.setter
    def seed(self, seed: TierCost) -> None:
        self._seed, self._estimate = seed, None

    def _solve(self) -> TierCost:
        if self._fit.count < self._min:
            return self.seed
        weights = self._fit.solve()
        if weights is None:
            # Every transfer one size (an engine's blocks usually are): alpha and the
            # bandwidth are not separable, but the cost at that size is known. Keep the
            # seed's split between the two, scaled to what was measured.
            sum_w, sum_size, sum_s = self._fit.xtx[0][0], self._fit.xtx[0][1], self._fit.xty[0]
            seeded_s = self.seed.fetch_s(int(sum_size / sum_w)) if sum_w > 0 else 0.0
            if sum_s <= 0 or seeded_s <= 0:
                return self.seed
            ratio = (sum_s / sum_w) / seeded_s
            return TierCost(self.seed.bandwidth_bytes_per_s / ratio, self.seed.latency_s * ratio)
        # Non-negative, as every weight here is a cost. Noise or a path whose speed changed
        # (a drive throttled since a start-up calibration at other sizes) can make bigger
        # transfers look no slower, or a negative alpha: the best fit with both >= 0 is
        # then one term alone, whichever misses the data less. Fitting through the origin
        # regardless let a few large calibration transfers price a run of small, slow,
        # latency-bound reads 5x low (CI: a 32-block plan at 0.085 s for a 0.44 s run).
        fitted = self._fit.solve_nonnegative()
        if fitted is None:
            return self.seed
        alpha, per_byte = fitted
        return TierCost(bandwidth_bytes_per_s=_bandwidth(per_byte), latency_s=alpha)


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
        self._min = min_observations
        self._gate = _OutlierGate(outlier_factor, min_observations)
        self._estimate: PrefillCost | None = None  # as PathEstimator's

    def observe(self, start_token: int, end_token: int, seconds: float) -> None:
        if end_token <= start_token or seconds <= 0:
            return
        predicted = self.estimate().seconds(start_token, end_token)
        x = [float(end_token - start_token), (end_token**2 - start_token**2) / 2, 1.0]
        _gated_add(self._fit, self._gate, x, seconds, predicted)
        self._estimate = None

    def estimate(self) -> PrefillCost:
        if self._estimate is None:
            self._estimate = self._solve()
        return self._estimate

    @property
    def seed(self) -> PrefillCost:
        return self._seed

    @seed.setter
    def seed(self, seed: PrefillCost) -> None:
        self._seed, self._estimate = seed, None

    def _solve(self) -> PrefillCost:
        if self._fit.count < self._min:
            return self.seed
        # Non-negative: a prefix hit makes an engine report only suffixes, every one the
        # same length, where the step constant and the per-token cost trade off freely
        # and an unconstrained fit drives one of them below zero.
        weights = self._fit.solve_nonnegative()
        if weights is None or weights[0] + weights[1] <= 0:
            return self.seed  # no per-token cost in the data (yet)
        a, c, step = weights
        return PrefillCost(a_s_per_token=a, c_s_per_token2=c, step_s=step)


DRIFT_FACTOR = 1.25  # run fits: calls this far off, all one way, accept_after in a row
DRIFT_AFTER = 16  # run fits: calls seen before the drift rule holds any (see _OutlierGate)


@dataclass(frozen=True, slots=True)
class RunCost:
    """Wall seconds of one call that moves a run: per_run_s + units * per_unit_s +
    size_bytes * per_byte_s (units: blocks copied, or rounds of parallel reads)."""

    per_run_s: float
    per_unit_s: float
    per_byte_s: float

    def seconds(self, units: int, size_bytes: float) -> float:
        return self.per_run_s + units * self.per_unit_s + size_bytes * self.per_byte_s

    def per_unit(self, unit_bytes: float) -> TierCost:
        """One unit's share as a per-block cost (the planner's `TierCost`)."""
        return TierCost(_bandwidth(self.per_byte_s), self.per_unit_s)


class RunEstimator:
    """What one call that moves a run of blocks costs, from the calls themselves.

    A per-block fit cannot be honest across queue depths: a call pays its round trip (and
    the start of its NVMe reads) once however many blocks it moves, so fitting
    seconds-per-block mixes a one-block call's overhead into a 16-block call's blocks and
    overprices long runs of small blocks several times over (measured: BENCHMARKS.md,
    issue 26). This fits seconds = per_run + units * per_unit + bytes * per_byte over whole
    calls, by non-negative least squares (a cost cannot be negative; a run of one size makes
    terms collinear, and the best non-negative subset fit stands in) of the relative error,
    recency-weighted and outlier-gated like `PathEstimator`. `estimate()` is None until
    `min_observations` calls: the caller keeps its per-block figures until then."""

    def __init__(
        self,
        decay: float = 0.98,
        min_observations: int = 8,
        outlier_factor: float = 4.0,
        drift_factor: float | None = DRIFT_FACTOR,
    ) -> None:
        self._fit = _WeightedLeastSquares(3, decay)
        self._min = min_observations
        self._gate = _OutlierGate(
            outlier_factor, min_observations, drift_factor=drift_factor, drift_after=DRIFT_AFTER
        )
        self._estimate: RunCost | None = None
        self._solved = True  # nothing to solve yet

    @property
    def observations(self) -> int:
        return self._fit.count

    def observe(self, units: int, size_bytes: float, seconds: float) -> None:
        if units <= 0 or size_bytes <= 0 or not seconds > 0:
            return
        warm = self.estimate()
        predicted = warm.seconds(units, size_bytes) if warm is not None else 0.0
        raw = [1.0, float(units), float(size_bytes)]
        if _gated_add_relative(
            [self._fit], [raw], self._gate, raw, seconds, predicted, lambda _, r: r
        ):
            self._solved = False

    def estimate(self) -> RunCost | None:
        if not self._solved:
            self._estimate = self._solve()
            self._solved = True
        return self._estimate

    def _solve(self) -> RunCost | None:
        if self._fit.count < self._min:
            return None
        weights = self._fit.solve_nonnegative()
        if weights is None or weights[1] + weights[2] <= 0:
            return None  # nothing grows with the run (yet): no model of it
        return RunCost(per_run_s=weights[0], per_unit_s=weights[1], per_byte_s=weights[2])


class ParallelRunEstimator:
    """What reading a run of m blocks at once costs, when up to `max_streams` reads run
    together but the machine may overlap fewer (two cores verifying checksums overlap
    two, whatever the thread count): seconds = per_run + ceil(m / s) * (per_read +
    bytes_per_read * per_byte), fitted for every s in 1, 2, 4, ... max_streams at once over
    the same observations (relative error, as `RunEstimator`), and the s whose fit has the
    least residual is the estimate.

    One outlier gate for all (from the chosen fit), so every candidate fits the same points
    and their residuals compare. `estimate()` is None until `min_observations`."""

    def __init__(
        self,
        max_streams: int,
        decay: float = 0.98,
        min_observations: int = 4,
        outlier_factor: float = 4.0,
        drift_factor: float | None = DRIFT_FACTOR,
    ) -> None:
        candidates = {1 << i for i in range(max(1, max_streams).bit_length())}
        self.candidates = sorted(candidates | {max(1, max_streams)})
        self._fits = [_WeightedLeastSquares(3, decay) for _ in self.candidates]
        self._min = min_observations
        self._gate = _OutlierGate(
            outlier_factor, min_observations, drift_factor=drift_factor, drift_after=DRIFT_AFTER
        )
        self._estimate: tuple[RunCost, int] | None = None
        self._solved = True

    @property
    def observations(self) -> int:
        return self._fits[0].count

    def _x(self, streams: int, blocks: int, mean_bytes: float) -> list[float]:
        rounds = -(-blocks // streams)
        return [1.0, float(rounds), rounds * mean_bytes]

    def observe(self, block_sizes: list[int], seconds: float) -> None:
        if not block_sizes or not seconds > 0 or min(block_sizes) <= 0:
            return
        blocks, mean_bytes = len(block_sizes), sum(block_sizes) / len(block_sizes)
        warm = self.estimate()
        predicted = 0.0
        if warm is not None:
            rounds = -(-blocks // warm[1])
            predicted = warm[0].seconds(rounds, rounds * mean_bytes)
        raw = [float(blocks), mean_bytes]

        def featurise(i: int, r: list[float]) -> list[float]:
            return self._x(self.candidates[i], int(r[0]), r[1])

        rows = [featurise(i, raw) for i in range(len(self.candidates))]
        if _gated_add_relative(self._fits, rows, self._gate, raw, seconds, predicted, featurise):
            self._solved = False

    def estimate(self) -> tuple[RunCost, int] | None:
        """(the cost of a run as per_run + rounds * one round's read, the overlapped
        streams s), or None while too few runs were seen."""
        if not self._solved:
            self._estimate = self._solve()
            self._solved = True
        return self._estimate

    def _solve(self) -> tuple[RunCost, int] | None:
        if self.observations < self._min:
            return None
        best: tuple[float, RunCost, int] | None = None
        for streams, fit in zip(self.candidates, self._fits, strict=True):
            w = fit.solve_nonnegative()
            if w is None or w[1] + w[2] <= 0:
                continue
            err = fit.residual(w)
            # Ties (a run never longer than one read) go to the fewest streams: the
            # cautious price of a longer run.
            if best is None or err < best[0] * (1 - 1e-9):
                best = (err, RunCost(w[0], w[1], w[2]), streams)
        return None if best is None else (best[1], best[2])
