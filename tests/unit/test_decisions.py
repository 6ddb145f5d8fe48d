"""The decision table, over every outcome and delivery number."""

from __future__ import annotations

import math

import pytest

from charge_worker import errors
from charge_worker.worker.decisions import (
    MAX_EXHAUSTIONS,
    Ack,
    Action,
    DeadLetter,
    Nak,
    Outcome,
    Policy,
    RedeliveryCause,
    Requeue,
    Result,
    after_deliveries_ran_out,
    decide,
    redelivery_cause,
    result_of,
)

BACKOFF = (30.0, 60.0, 300.0, 900.0)
MAX_DELIVER = 5


POLICY = Policy(max_deliver=MAX_DELIVER, backoff_s=BACKOFF, ack_wait_s=30.0, lease_s=45.0)


def act(result: Result, delivery: int) -> Action:
    return decide(result, delivery, POLICY)


DELIVERIES = range(1, MAX_DELIVER + 1)


@pytest.mark.parametrize("delivery", DELIVERIES)
@pytest.mark.parametrize(
    "outcome",
    [Outcome.CHARGED, Outcome.DECLINED, Outcome.PROCESSING, Outcome.BLOCKED, Outcome.DUPLICATE],
)
def test_final_outcomes_ack_on_any_delivery(outcome: Outcome, delivery: int) -> None:
    assert act(Result(outcome), delivery) == Ack()


@pytest.mark.parametrize("delivery", DELIVERIES)
@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        (Outcome.POISON, "poison"),
        (Outcome.CONFLICT, "conflict"),
        (Outcome.UNVERIFIED, "unverified"),
        (Outcome.REJECTED, "rejected"),
    ],
)
def test_permanent_outcomes_dead_letter_at_once(
    outcome: Outcome, reason: str, delivery: int
) -> None:
    assert act(Result(outcome, error="why"), delivery) == DeadLetter(reason)


RETRYABLE = [
    Outcome.OUTCOME_UNKNOWN,
    Outcome.IN_PROGRESS,
    Outcome.RATE_LIMITED,
    Outcome.LEASE_HELD,
    Outcome.UNAVAILABLE,
]


@pytest.mark.parametrize(("delivery", "delay"), [(1, 30.0), (2, 60.0), (3, 300.0), (4, 900.0)])
@pytest.mark.parametrize("outcome", RETRYABLE)
def test_retryable_naks_with_the_backoff_step(
    outcome: Outcome, delivery: int, delay: float
) -> None:
    assert act(Result(outcome), delivery) == Nak(delay)


@pytest.mark.parametrize("outcome", RETRYABLE)
def test_retryable_prefers_its_own_delay(outcome: Outcome) -> None:
    assert act(Result(outcome, retry_after_s=2.5), 1) == Nak(2.5)
    assert act(Result(outcome, retry_after_s=-1.0), 1) == Nak(0.0)


@pytest.mark.parametrize("outcome", RETRYABLE)
@pytest.mark.parametrize(
    ("asked", "delay"),
    [
        (math.inf, BACKOFF[-1]),  # nak(delay=inf) raises inside nats-py
        (1e12, BACKOFF[-1]),  # parks the message for millennia
        (BACKOFF[-1] + 1, BACKOFF[-1]),
        (-math.inf, 0.0),
        (math.nan, BACKOFF[1]),  # no delay at all: the backoff step of delivery 2
    ],
)
def test_an_own_delay_is_clamped_to_the_last_backoff_step(
    outcome: Outcome, asked: float, delay: float
) -> None:
    assert act(Result(outcome, retry_after_s=asked), 2) == Nak(delay)


def test_without_backoff_an_own_delay_is_clamped_to_the_ack_wait() -> None:
    policy = Policy(max_deliver=5, backoff_s=(), ack_wait_s=12.0, lease_s=1.0)
    assert decide(Result(Outcome.RATE_LIMITED, retry_after_s=1e9), 1, policy) == Nak(12.0)


@pytest.mark.parametrize("outcome", RETRYABLE)
def test_last_delivery_of_a_dependency_problem_requeues(outcome: Outcome) -> None:
    assert act(Result(outcome, retry_after_s=1.0), MAX_DELIVER) == Requeue()
    assert act(Result(outcome), MAX_DELIVER + 3) == Requeue()


@pytest.mark.parametrize("delivery", range(1, MAX_DELIVER))
def test_crash_naks_until_the_last_delivery(delivery: int) -> None:
    assert act(Result(Outcome.CRASHED), delivery) == Nak(BACKOFF[delivery - 1])


def test_crash_on_the_last_delivery_dead_letters_max_deliveries() -> None:
    assert act(Result(Outcome.CRASHED), MAX_DELIVER) == DeadLetter("max_deliveries")


def test_every_outcome_is_covered_by_a_table_above() -> None:
    covered = {
        Outcome.CHARGED,
        Outcome.DECLINED,
        Outcome.PROCESSING,
        Outcome.BLOCKED,
        Outcome.DUPLICATE,
    }
    covered |= {Outcome.POISON, Outcome.CONFLICT, Outcome.UNVERIFIED, Outcome.REJECTED}
    covered |= {Outcome.CRASHED}
    covered |= set(RETRYABLE)
    assert covered == set(Outcome)


def test_backoff_last_step_repeats_and_empty_falls_back_to_ack_wait() -> None:
    assert POLICY.backoff_delay(9) == 900.0
    assert POLICY.backoff_delay(0) == 30.0
    assert (
        Policy(max_deliver=5, backoff_s=(), ack_wait_s=12.0, lease_s=1.0).backoff_delay(3) == 12.0
    )


@pytest.mark.parametrize("delivery", range(1, MAX_DELIVER))
def test_a_lost_charge_answer_waits_out_the_lease(delivery: int) -> None:
    lost = Result(Outcome.OUTCOME_UNKNOWN, error="gateway 503", call_in_flight=True)
    assert act(lost, delivery) == Nak(POLICY.lease_s)
    assert act(lost, MAX_DELIVER) == Requeue()


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (errors.PoisonMessage("x"), Outcome.POISON),
        (errors.PayloadConflict("x"), Outcome.CONFLICT),
        (errors.Unverified("x"), Outcome.UNVERIFIED),
        (errors.GatewayRejected("x"), Outcome.REJECTED),
        (errors.OutcomeUnknown("x"), Outcome.OUTCOME_UNKNOWN),
        (errors.RequestInProgress("x"), Outcome.IN_PROGRESS),
        (errors.RateLimited("x", retry_after_s=3), Outcome.RATE_LIMITED),
        (errors.LeaseHeld("x"), Outcome.LEASE_HELD),
        (errors.DependencyUnavailable("x"), Outcome.UNAVAILABLE),
        (errors.NoVerdict("x"), Outcome.UNAVAILABLE),
        (errors.AlreadySettled("x"), Outcome.DUPLICATE),
        (errors.SettingsError("x"), Outcome.UNAVAILABLE),
    ],
)
def test_result_of_maps_the_most_specific_error(
    error: errors.ChargeWorkerError, outcome: Outcome
) -> None:
    result = result_of(error)
    assert result.outcome == outcome
    assert result.error == "x"


def _subclasses(cls: type[errors.ChargeWorkerError]) -> list[type[errors.ChargeWorkerError]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


@pytest.mark.parametrize("cls", _subclasses(errors.ChargeWorkerError), ids=lambda c: c.__name__)
def test_every_error_names_an_outcome(cls: type[errors.ChargeWorkerError]) -> None:
    assert Outcome(cls.outcome)  # raises ValueError for a value decisions do not know


def test_result_of_keeps_the_retry_delay() -> None:
    assert result_of(errors.RateLimited("slow down", retry_after_s=3)).retry_after_s == 3


@pytest.mark.parametrize(
    ("status", "valid", "exhausted", "verdict"),
    [
        (None, False, 0, "dead_letter"),  # poison whose worker died: nothing to requeue
        ("succeeded", True, 0, "forget"),  # settled: only the ack died with the worker
        ("declined", True, 2, "forget"),
        ("failed", True, 0, "forget"),
        ("retry_scheduled", True, 0, "forget"),  # the try ended; the producer starts the next
        ("action_required", True, 0, "forget"),
        (None, True, 0, "requeue"),  # died before the claim
        ("pending", True, 0, "requeue"),
        ("scheduled", True, MAX_EXHAUSTIONS - 2, "requeue"),
        ("pending", True, MAX_EXHAUSTIONS - 1, "dead_letter"),  # keeps killing its workers
    ],
)
def test_a_death_on_the_last_delivery_requeues_an_open_charge_a_bounded_number_of_times(
    status: str | None, valid: bool, exhausted: int, verdict: str
) -> None:
    assert after_deliveries_ran_out(status, valid=valid, exhausted=exhausted) == verdict


NAK, UNACKED = RedeliveryCause.NAK, RedeliveryCause.UNACKED


@pytest.mark.parametrize(
    ("delivery", "nak_delivery", "cause"),
    [
        (1, None, None),  # a first delivery is no redelivery, whatever the row says
        (1, 1, None),
        (2, 1, NAK),  # the previous delivery nak'd: asked for
        (5, 4, NAK),
        (2, None, UNACKED),  # no nak recorded: AckWait ran out, a worker died, no row
        (3, 1, UNACKED),  # delivery 1 nak'd, delivery 2 ended without a word
        (2, 2, UNACKED),  # a nak of a later delivery is not this one's cause
        (3, 3, UNACKED),
    ],
)
def test_a_redelivery_is_asked_for_only_when_its_previous_delivery_nakd(
    delivery: int, nak_delivery: int | None, cause: RedeliveryCause | None
) -> None:
    assert redelivery_cause(delivery, nak_delivery) == cause
