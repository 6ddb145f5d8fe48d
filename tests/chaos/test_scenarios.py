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

from tests.chaos.cluster import ServerPool
from tests.chaos.run import run_scenario
from tests.chaos.scenarios import CLUSTER_SCENARIOS, SCENARIOS, Scenario

SEED = int(os.environ.get("CHAOS_SEED", "20261130"))


@pytest.fixture(scope="module")
def pool() -> Iterator[ServerPool]:
    servers = ServerPool()
    yield servers
    servers.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", [*SCENARIOS, *CLUSTER_SCENARIOS], ids=lambda s: s.name)
async def test_scenario(pool: ServerPool, scenario: Scenario, tmp_path: Path) -> None:
    with pool.lend(scenario.shape, fresh=scenario.fresh_servers) as servers:
        result = await run_scenario(
            servers, scenario, size=scenario.quick_size, seed=SEED, root=tmp_path
        )
    print(result.report() if not result.passed else result.row())
    assert result.passed, result.report()
