"""The quick chaos suite (inside `make test`): every scenario at its quick size, one seed.

`make chaos` runs the same scenarios at 10,000 keys plus the combined one. A failure prints
the seed, the chronicle of every fault and `charge-worker explain` for the first bad keys;
`CHAOS_SEED=<seed> pytest tests/chaos -k <scenario>` runs it again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.cluster import Servers
from tests.chaos.run import run_scenario
from tests.chaos.scenarios import SCENARIOS, Scenario

SEED = int(os.environ.get("CHAOS_SEED", "20261130"))


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    started = Servers().start()
    yield started
    started.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
async def test_scenario(servers: Servers, scenario: Scenario, tmp_path: Path) -> None:
    result = await run_scenario(
        servers, scenario, size=scenario.quick_size, seed=SEED, root=tmp_path
    )
    print(result.report() if not result.passed else result.row())
    assert result.passed, result.report()
