"""The simulators' latency model: statistics over seeded samples, not timing."""

from __future__ import annotations

import random
import statistics

import pytest
from pydantic import ValidationError

from charge_worker.sandbox.latency import LatencyModel

N = 20_000


def _samples(model: LatencyModel, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [model.sample(rng) for _ in range(N)]


def test_fixed_is_fixed() -> None:
    assert set(_samples(LatencyModel.fixed(0.25))) == {0.25}


def test_default_is_instant() -> None:
    assert LatencyModel().sample(random.Random(0)) == 0.0


@pytest.mark.parametrize(("p50_s", "p99_s"), [(0.030, 1.2), (0.010, 0.050), (0.2, 0.2)])
def test_quantiles_land_near_p50_and_p99(p50_s: float, p99_s: float) -> None:
    cuts = statistics.quantiles(_samples(LatencyModel.quantiles(p50_s, p99_s)), n=100)
    assert cuts[49] == pytest.approx(p50_s, rel=0.05)
    assert cuts[98] == pytest.approx(p99_s, rel=0.15)


def test_incident_shape_has_its_slow_tail() -> None:
    model = LatencyModel.quantiles(0.030, 1.2, slow_fraction=0.02, slow_min_s=6, slow_max_s=8)
    samples = _samples(model)
    # The lognormal body itself reaches 6 s about 0.04 % of the time.
    assert sum(6 <= s <= 8 for s in samples) / N == pytest.approx(0.02, abs=0.005)
    assert statistics.median(samples) == pytest.approx(0.030, rel=0.1)


def test_slow_tail_on_a_fixed_latency() -> None:
    samples = _samples(LatencyModel(fixed_s=0.005, slow_fraction=0.5, slow_min_s=1, slow_max_s=2))
    assert {s for s in samples if s < 1} == {0.005}
    assert all(1 <= s <= 2 for s in samples if s >= 1)
    assert sum(s >= 1 for s in samples) / N == pytest.approx(0.5, abs=0.02)


def test_same_seed_same_samples() -> None:
    model = LatencyModel.quantiles(0.030, 1.2, slow_fraction=0.02)
    assert _samples(model, seed=7)[:100] == _samples(model, seed=7)[:100]


@pytest.mark.parametrize(
    "knobs",
    [
        {"p50_s": 0.1},
        {"p99_s": 0.1},
        {"p50_s": 0.2, "p99_s": 0.1},
        {"slow_fraction": 1.5},
        {"slow_min_s": 8, "slow_max_s": 6},
        {"fixed_s": -1},
        {"p95_s": 0.1},
    ],
)
def test_inconsistent_knobs_are_refused(knobs: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        LatencyModel.model_validate(knobs)
