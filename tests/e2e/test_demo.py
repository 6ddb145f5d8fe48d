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
def test_demo_charges_every_period_once_retries_by_class_and_dead_letters_the_bad_ones() -> None:
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
    assert_every_period_charged_once(output)
    assert re.search(r"#\d+ poison .*not UTF-8 JSON", output), output
    assert re.search(r"#\d+ poison .*amount_minor", output), output
    assert re.search(r"#\d+ conflict .*order 1003 ", output), output
    assert "worker-1 exited 0, worker-2 exited 0" in output
    assert_retries(output)
    assert_outcome_events(output)
    assert_declined_periods(output)
    assert "every expectation held" in output


def assert_every_period_charged_once(output: str) -> None:
    """The promise across every try's key: 20 ordinary periods, one recovered by the
    schedule and one retried on purpose."""
    assert (
        "22 periods, each charged exactly once across every try's key (2 on a later try)" in output
    ), output
    assert "!!!" not in output  # no period charged twice


def assert_retries(output: str) -> None:
    """Support's retry and the producer's run, as the demo ran them."""
    assert "    $ charge-worker retry 1026 2026-12-01\n" in output, output
    assert (
        "    | started try 2 of 1026:2026-12-01 (was action_required), key 1026:2026-12-01:2:"
        " published as charge:1026:2026-12-01:2\n"
    ) in output, output
    assert "    due now: orders 1021, 1024\n" in output, output
    assert "    | next tries started: 2, published: 2, postponed by the cap: 0\n" in output, output


# the provider's codes of the demo's declines: generic, hard, the customer's to fix
CODES = {
    "contract": ("generic_decline", "stolen_card", "expired_card"),
    "stripe": ("generic_decline", "stolen_card", "expired_card"),
    "yookassa": ("general_decline", "permission_revoked", "card_expired"),
}


EVENTS = 29  # 20 ordinary, 1 blocked, and the declined periods' 2 + 2 + 1 + 3


def assert_outcome_events(output: str, kind: str = "contract") -> None:
    """The events section: what a downstream consumer read, one line per event, counted;
    each declined period's events with the try they tell of."""
    generic, hard, action = CODES[kind]
    assert "the outbox is drained: every outcome event is in CHARGE_OUTCOMES" in output, output
    section = output.split("outcome events (CHARGE_OUTCOMES), as a downstream consumer read them")
    assert len(section) == 2, output
    heading, *lines = section[1].splitlines()
    assert heading == (
        f" (durable demo-downstream on charges.outcome.>): {EVENTS}: 1 action_required,"
        " 1 blocked, 2 declined, 3 retry_scheduled, 22 succeeded; by period, in sequence"
    )
    event = re.compile(
        r"      (\d+):2026-12-01:(\d) +(charge\.\w+) +try (\d)  sequence \2  (\d+) ([A-Z]{3})"
        r"(?:  (\w+))?(?:  retry_at \S+)?"
    )
    matched = [m for m in map(event.fullmatch, lines[:EVENTS]) if m]
    assert len(matched) == EVENTS, lines[:EVENTS]
    seen = {(m[1], int(m[2])): (m[3], int(m[4]), int(m[5]), m[6], m[7]) for m in matched}
    assert seen["1001", 1] == ("charge.succeeded", 1, 1990, "RUB", None)
    assert seen["1022", 1] == ("charge.blocked", 1, 250000, "RUB", None)
    # a generic decline is soft: retried once (the demo's schedule), then final
    assert seen["1021", 1][:2] == ("charge.retry_scheduled", 1)
    assert seen["1021", 2] == ("charge.declined", 2, 1500, "USD", generic)
    # recovered on try 2
    assert seen["1024", 1] == ("charge.retry_scheduled", 1, 4900, "EUR", "insufficient_funds")
    assert seen["1024", 2] == ("charge.succeeded", 2, 4900, "EUR", None)
    assert ("1024", 3) not in seen
    # hard: final on try 1
    assert seen["1025", 1] == ("charge.declined", 1, 7500, "USD", hard)
    assert ("1025", 2) not in seen
    # customer action: waits, then retried on purpose (made due now) and charged on try 2
    assert seen["1026", 1] == ("charge.action_required", 1, 12900, "RUB", action)
    assert seen["1026", 2][:2] == ("charge.retry_scheduled", 1)
    assert seen["1026", 3] == ("charge.succeeded", 2, 12900, "RUB", None)
    assert lines[EVENTS] == (
        f"      each of the ledger's {EVENTS} changes (charge_attempts.outcome_seq) seen once;"
        " 0 duplicate deliveries dropped by event_id"
    )


def assert_declined_periods(output: str, kind: str = "contract") -> None:
    """The summary's last section: each declined period's tries in plain words."""
    generic, hard, action = CODES[kind]
    section = output.split("declined renewals, period by period (CHARGE_WORKER_RETRY_SCHEDULE=5s)")
    assert len(section) == 2, output
    lines = section[1].splitlines()
    assert lines[0] == ": 4"
    assert lines[1:11] == [
        "      order 1021 cus_decline_carol (1500 USD): declined for good after 2 tries"
        " (2 tries at the gateway)",
        f"        try 1: declined {generic} (soft); retry scheduled; charge-worker produce"
        " started the next try when it came due",
        f"        try 2: declined {generic} (soft): final, the schedule has no try left",
        "      order 1024 cus_soft2_dan (4900 EUR): recovered on try 2 by the retry schedule",
        "        try 1: declined insufficient_funds (soft); retry scheduled; charge-worker produce"
        " started the next try when it came due",
        "        try 2: charged",
        f"      order 1025 cus_code_{hard}_victor (7500 USD): a hard decline, never retried"
        " (1 try at the gateway)",
        f"        try 1: declined {hard} (hard): final, never tried again",
        f"      order 1026 cus_code_{action}_wendy (12900 RUB): charged on try 2, retried on"
        " purpose after the customer acted",
        f"        try 1: declined {action} (customer action); waited for the customer;"
        " support retried on purpose (charge-worker retry)",
    ]
    assert lines[11] == "        try 2: charged"


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
@pytest.mark.parametrize("kind", ["stripe", "yookassa"])
def test_demo_on_another_providers_flavour_tells_the_same_story(kind: str) -> None:
    result = _demo(GATEWAY_KIND=kind)
    output = result.stdout
    assert result.returncode == 0, f"{output}\n{result.stderr}"
    assert f"gateway simulator ({kind} flavour, GATEWAY_KIND={kind})" in output
    assert_every_period_charged_once(output)
    assert_retries(output)
    assert_outcome_events(output, kind)
    assert_declined_periods(output, kind)
    assert "every expectation held" in output


def test_demo_refuses_an_unknown_gateway_kind_before_starting_anything() -> None:
    result = _demo(GATEWAY_KIND="paypal")
    assert result.returncode != 0
    assert "GATEWAY_KIND" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "starting NATS" not in result.stdout
