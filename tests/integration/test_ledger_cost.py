"""`benchmarks.ledger_cost`, the diagnosis of the worker's PostgreSQL cost part by part, runs
against real PostgreSQL, and each of its variants writes what it claims to: a variant that
stopped writing its part (the outbox's rows, the stories, the relay's marks) would read
cheap, so every round checks its rows and the run fails on a mismatch."""

from __future__ import annotations

from benchmarks.ledger_cost import VARIANTS

from tests.support.benchmarks import run_benchmark


def test_every_variant_writes_its_part_and_is_reported(pg_admin_url: str) -> None:
    done = run_benchmark(
        "ledger_cost", "--rounds", "1", "--charges", "20", env={"DATABASE_URL": pg_admin_url}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reported = [
        line.split(" us")[0].rsplit(maxsplit=1)[0].strip() for line in done.stdout.splitlines()[1:]
    ]
    assert reported == [variant.name for variant in VARIANTS]
    assert "round 1/1" in done.stderr
