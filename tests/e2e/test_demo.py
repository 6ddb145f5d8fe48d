"""`charge-worker demo` as a user runs it: the whole story, to the end, on a clean machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

DEMO_TIMEOUT_S = 240


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_charges_every_key_once_and_dead_letters_the_bad_ones() -> None:
    clean = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("CHARGE_WORKER_") and key not in ("NATS_URL", "DATABASE_URL")
    }
    result = subprocess.run(
        [sys.executable, "-m", "charge_worker", "demo"],
        env=clean,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    output = result.stdout
    assert result.returncode == 0, f"{output}\n{result.stderr}"
    assert re.search(r"\b20 keys, each charged exactly once", output), output
    assert "charged 2 times" not in output
    assert re.search(r"#\d+ poison .*not UTF-8 JSON", output), output
    assert re.search(r"#\d+ poison .*amount_minor", output), output
    assert re.search(r"#\d+ conflict .*order 1003 ", output), output
    assert "worker-1 exited 0, worker-2 exited 0" in output
    assert_outcome_events(output)
    assert "every expectation held" in output


def assert_outcome_events(output: str) -> None:
    """The events section: what a downstream consumer read, one line per event, counted."""
    assert "the outbox is drained: every outcome event is in CHARGE_OUTCOMES" in output, output
    section = output.split("outcome events (CHARGE_OUTCOMES), as a downstream consumer read them")
    assert len(section) == 2, output
    heading, *lines = section[1].splitlines()
    assert heading == (
        " (durable demo-downstream on charges.outcome.>): 22: 1 blocked, 1 declined, 20 succeeded"
    )
    event = re.compile(r"      (\d+):2026-12-01:1 +(charge\.\w+) +sequence 1  (\d+) ([A-Z]{3})")
    seen = {m[1]: (m[2], int(m[3]), m[4]) for m in map(event.fullmatch, lines[:22]) if m}
    assert len(seen) == 22, lines[:22]
    assert seen["1001"] == ("charge.succeeded", 1990, "RUB")
    assert seen["1021"] == ("charge.declined", 1500, "USD")
    assert seen["1022"] == ("charge.blocked", 250000, "RUB")
    assert lines[22] == (
        "      each of the ledger's 22 changes (charge_attempts.outcome_seq) seen once;"
        " 0 duplicate deliveries dropped by event_id"
    )


def _demo(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("CHARGE_WORKER_")
        and key not in ("NATS_URL", "DATABASE_URL", "GATEWAY_KIND")
    }
    return subprocess.run(
        [sys.executable, "-m", "charge_worker", "demo"],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_on_the_stripe_flavour_charges_every_key_once() -> None:
    result = _demo(GATEWAY_KIND="stripe")
    output = result.stdout
    assert result.returncode == 0, f"{output}\n{result.stderr}"
    assert "gateway simulator (stripe flavour, GATEWAY_KIND=stripe)" in output
    assert re.search(r"\b20 keys, each charged exactly once", output), output
    assert "charged 2 times" not in output
    assert_outcome_events(output)
    assert "every expectation held" in output


def test_demo_refuses_an_unknown_gateway_kind_before_starting_anything() -> None:
    result = _demo(GATEWAY_KIND="paypal")
    assert result.returncode != 0
    assert "GATEWAY_KIND" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "starting NATS" not in result.stdout
