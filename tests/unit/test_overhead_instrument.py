"""`benchmarks.overhead --fake-io`, the steady instrument's server-free mode, still runs the
worker's real pipeline to the end: its canned ledger answers what `Ledger.claim` reads."""

from __future__ import annotations

from tests.support.benchmarks import run_benchmark


def test_the_fake_io_mode_charges_and_acks_every_delivery() -> None:
    done = run_benchmark("overhead", "--fake-io", "--rounds", "1", "--batch", "8", timeout_s=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fake I/O; outcome events on" in done.stdout
