"""A seeded latency model for the simulators: how long one call takes.

Three shapes, combinable:

* fixed: every call takes `fixed_s`;
* quantiles: a lognormal fitted to two quantiles, `mu = ln(p50)`,
  `sigma = (ln p99 - ln p50) / z(0.99)` with `z(0.99) ≈ 2.3263`;
* a slow tail on top of either: `slow_fraction` of calls take `uniform(slow_min_s, slow_max_s)`.

`p50_s`/`p99_s` describe the body of the distribution; a slow tail larger than 1 % moves the
mixture's own p99 into the tail. The model is pure: `sample(rng)` draws only from `rng`.
"""

from __future__ import annotations

import math
import random
from statistics import NormalDist
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

Z_P99 = NormalDist().inv_cdf(0.99)


class LatencyModel(BaseModel):
    """How long a simulated call takes, in seconds; build it with `fixed()` or `quantiles()`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fixed_s: float = Field(0.0, ge=0)
    p50_s: float | None = Field(None, gt=0)
    p99_s: float | None = Field(None, gt=0)
    slow_fraction: float = Field(0.0, ge=0, le=1)
    slow_min_s: float = Field(6.0, ge=0)
    slow_max_s: float = Field(8.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.p50_s is None) != (self.p99_s is None):
            raise ValueError("p50_s and p99_s are given together or not at all")
        if self.p50_s is not None and self.p99_s is not None and self.p99_s < self.p50_s:
            raise ValueError("p99_s must not be below p50_s")
        if self.slow_max_s < self.slow_min_s:
            raise ValueError("slow_max_s must not be below slow_min_s")
        return self

    @classmethod
    def fixed(cls, seconds: float) -> LatencyModel:
        """Every call takes exactly `seconds`."""
        return cls(fixed_s=seconds)

    @classmethod
    def quantiles(
        cls,
        p50_s: float,
        p99_s: float,
        *,
        slow_fraction: float = 0.0,
        slow_min_s: float = 6.0,
        slow_max_s: float = 8.0,
    ) -> LatencyModel:
        """A lognormal through `p50_s` and `p99_s`, plus an optional slow tail."""
        return cls(
            p50_s=p50_s,
            p99_s=p99_s,
            slow_fraction=slow_fraction,
            slow_min_s=slow_min_s,
            slow_max_s=slow_max_s,
        )

    def sample(self, rng: random.Random) -> float:
        """One call's latency in seconds."""
        if self.slow_fraction and rng.random() < self.slow_fraction:
            return rng.uniform(self.slow_min_s, self.slow_max_s)
        if self.p50_s is None or self.p99_s is None:
            return self.fixed_s
        mu = math.log(self.p50_s)
        sigma = (math.log(self.p99_s) - mu) / Z_P99
        return rng.lognormvariate(mu, sigma)
