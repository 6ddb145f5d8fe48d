"""Simulators over real HTTP for the worker tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from charge_worker.sandbox.gateway import GatewayConfig, build_gateway_app
from charge_worker.sandbox.scoring import ScoringConfig, build_scoring_app
from charge_worker.sandbox.serve import ServedApp


@pytest.fixture
def gateway_sim() -> Iterator[ServedApp]:
    with ServedApp(build_gateway_app(GatewayConfig(seed=1))) as served:
        yield served


@pytest.fixture
def scoring_sim() -> Iterator[ServedApp]:
    with ServedApp(build_scoring_app(ScoringConfig(seed=1))) as served:
        yield served
