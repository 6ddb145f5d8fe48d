"""Pure statistics for the benchmarks: summaries, percentiles, Little's-law bounds, targets.

Nothing here does I/O; `tests/unit/test_benchmarks_stats.py` checks every function.

The latency means mirror `charge_worker.sandbox.latency.LatencyModel.sample`: a call is in
the slow tail with probability `slow_fraction` (uniform between `slow_min_s` and
`slow_max_s`), else lognormal through `p50_s`/`p99_s`, else `fixed_s`. A client deadline
`cap_s` (the scoring timeout) caps each call: the client waits `min(latency, cap_s)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

from charge_worker.sandbox.latency import Z_P99, LatencyModel

_STANDARD = NormalDist()
Op = Literal[">=", "<=", "<"]


@dataclass(frozen=True)
class Summary:
    """Median, min and max of repeated samples of one figure."""

    median: float
    minimum: float
    maximum: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        if not samples:
            raise ValueError("no samples to summarise")
        return cls(median(samples), min(samples), max(samples), len(samples))

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree (0 for one sample)."""
        return (self.maximum - self.minimum) / self.median if self.median else math.nan


def median(samples: Sequence[float]) -> float:
    """The median (mean of the two middle values for an even count)."""
    return percentile(samples, 50.0)


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not samples:
        raise ValueError("no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is not in 0..100")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is 0 (a figure that is missing)."""
    return numerator / denominator if denominator else math.nan


def littles_law_bound(concurrency: int, mean_latency_s: float) -> float:
    """The most items/s `concurrency` slots can finish when each item takes `mean_latency_s`.

    Little's law, L = lambda * W, with every slot always busy (L = concurrency).
    """
    if concurrency < 1 or mean_latency_s <= 0:
        raise ValueError("concurrency must be >= 1 and the mean latency > 0")
    return concurrency / mean_latency_s


def _lognormal_params(p50_s: float, p99_s: float) -> tuple[float, float]:
    mu = math.log(p50_s)
    return mu, (math.log(p99_s) - mu) / Z_P99


def capped_lognormal_mean(p50_s: float, p99_s: float, cap_s: float | None = None) -> float:
    """E[min(X, cap_s)] for the lognormal X through p50_s and p99_s (E[X] without a cap)."""
    mu, sigma = _lognormal_params(p50_s, p99_s)
    mean = math.exp(mu + sigma * sigma / 2)
    if cap_s is None:
        return mean
    if cap_s <= 0:
        return 0.0
    if sigma == 0:
        return min(p50_s, cap_s)
    log_cap = math.log(cap_s)
    below = mean * _STANDARD.cdf((log_cap - mu - sigma * sigma) / sigma)
    above = cap_s * (1.0 - _STANDARD.cdf((log_cap - mu) / sigma))
    return below + above


def capped_uniform_mean(low_s: float, high_s: float, cap_s: float | None = None) -> float:
    """E[min(U, cap_s)] for U uniform on [low_s, high_s]."""
    if cap_s is None or cap_s >= high_s:
        return (low_s + high_s) / 2
    if cap_s <= low_s:
        return cap_s
    width = high_s - low_s
    return ((cap_s * cap_s - low_s * low_s) / 2 + cap_s * (high_s - cap_s)) / width


def model_mean(model: LatencyModel, cap_s: float | None = None) -> float:
    """The mean time a client waits for one call of `model`, given its deadline `cap_s`."""
    if model.p50_s is not None and model.p99_s is not None:
        body = capped_lognormal_mean(model.p50_s, model.p99_s, cap_s)
    else:
        body = model.fixed_s if cap_s is None else min(model.fixed_s, cap_s)
    tail = capped_uniform_mean(model.slow_min_s, model.slow_max_s, cap_s)
    return (1.0 - model.slow_fraction) * body + model.slow_fraction * tail


def model_quantile(model: LatencyModel, q: float) -> float:
    """The q-quantile (0..1) of `model`'s latency, uncapped (bisection on the mixture CDF)."""
    if not 0.0 < q < 1.0:
        raise ValueError("q must be in (0, 1)")

    def cdf(x: float) -> float:
        if model.p50_s is not None and model.p99_s is not None:
            mu, sigma = _lognormal_params(model.p50_s, model.p99_s)
            body = _STANDARD.cdf((math.log(x) - mu) / sigma) if x > 0 and sigma > 0 else 1.0
        else:
            body = 1.0 if x >= model.fixed_s else 0.0
        width = model.slow_max_s - model.slow_min_s
        if x >= model.slow_max_s:
            tail = 1.0
        elif x < model.slow_min_s:
            tail = 0.0
        else:
            tail = (x - model.slow_min_s) / width if width else 1.0
        return (1.0 - model.slow_fraction) * body + model.slow_fraction * tail

    low, high = 0.0, max(model.slow_max_s, model.fixed_s, (model.p99_s or 0.0) * 100, 1.0)
    for _ in range(200):
        mid = (low + high) / 2
        if cdf(mid) < q:
            low = mid
        else:
            high = mid
    return high


@dataclass(frozen=True)
class Target:
    """A ratio with a target: `value <op> threshold`."""

    name: str
    op: Op
    threshold: float

    def met(self, value: float) -> bool:
        """Whether `value` meets the target (a missing value, NaN, never does)."""
        if math.isnan(value):
            return False
        if self.op == ">=":
            return value >= self.threshold
        if self.op == "<=":
            return value <= self.threshold
        return value < self.threshold

    def verdict(self, value: float) -> str:
        return "MET" if self.met(value) else "MISSED"

    @property
    def wanted(self) -> str:
        return f"{self.op} {self.threshold:g}"


def growth(before: float, after: float) -> float:
    """Relative growth from `before` to `after` (0.05 is 5 %)."""
    return ratio(after - before, before)


def per_item_us(cpu_s: float, items: int) -> float:
    """CPU microseconds per item."""
    return ratio(cpu_s * 1e6, items)


def crossing_time(series: Sequence[tuple[float, int]], level: float) -> float:
    """When a rising count first reached `level`, interpolated between polls.

    `series` is (time, count) in time order; raises if the count never got there.
    """
    previous: tuple[float, int] | None = None
    for at, count in series:
        if count >= level:
            if previous is None or count == previous[1]:
                return at
            before_at, before = previous
            return before_at + (at - before_at) * (level - before) / (count - before)
        previous = (at, count)
    raise ValueError(f"the count never reached {level}")


def interpolated(series: Sequence[tuple[float, float]], at: float) -> float:
    """The value at time `at` of a figure measured at the times of `series` ((time, value),
    in any order): linear between the measurements just before and just after `at`, the
    nearest one's where `at` is outside them. A drift of the machine between two samples of
    one case then falls on the sample of another case taken between them alike, whichever
    way it goes."""
    if not series:
        raise ValueError("no measurements")
    before = max((point for point in series if point[0] <= at), default=None)
    after = min((point for point in series if point[0] >= at), default=None)
    if before is None or after is None or before[0] == after[0]:
        nearest = before or after
        assert nearest is not None
        return nearest[1]
    weight = (at - before[0]) / (after[0] - before[0])
    return before[1] + weight * (after[1] - before[1])


def against_moments(
    top: Sequence[tuple[float, float]], bottom: Sequence[tuple[float, float]]
) -> list[float]:
    """Each (time, value) of `top` against `bottom`'s value at its time (`interpolated`)."""
    return [ratio(value, interpolated(bottom, at)) for at, value in top]


def steady_rate(
    series: Sequence[tuple[float, int]], total: int, low: float = 0.1, high: float = 0.9
) -> float:
    """Items/s between the times `low` and `high` of `total` were done.

    Leaves out the ramp-up (connections, first fetch) and the tail (the last slots
    finishing with nothing left to fetch), which a short run would otherwise mix in.
    """
    start = crossing_time(series, low * total)
    end = crossing_time(series, high * total)
    return ratio((high - low) * total, end - start)
