"""The pipeline's decision table, one delivery at a time, on in-memory ports and a fake clock.

Each test runs the real `Pipeline` (parse, claim, look up, score, charge, decide, record)
over `InMemoryLedger`, the real `ContractGateway` on a `FakeGateway` and the real
`ScoringClient` on a `FakeScoring` (tests/support/fakes.py), and reads what it came to: the
result, the action, the ledger row and its story, the charges the gateway made. What only
the servers can show (SQL under concurrency, JetStream's redeliveries, sockets) stays in
tests/integration.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from charge_worker.messages import ChargeDue
from charge_worker.settings import LEASE_RENEWAL_S
from charge_worker.worker.decisions import (
    Ack,
    Action,
    DeadLetter,
    Nak,
    Outcome,
    Policy,
    Requeue,
)
from charge_worker.worker.pipeline import UNRECORDED_VERDICT, Delivery, Pipeline, Processed
from tests.support.fakes import (
    GATEWAY_URL,
    LEASE_S,
    PERIOD,
    LoseAnswer,
    Meanwhile,
    Refuse,
    Unreachable,
    World,
    due,
)

BACKOFF_S = (5.0, 10.0)
POLICY = Policy(max_deliver=4, backoff_s=BACKOFF_S, ack_wait_s=5.0, lease_s=LEASE_S)
CHARGE = "POST /v1/charges"
LOOKUP = "GET /v1/charges"


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with World() as made:
        yield made


async def through(
    pipeline: Pipeline,
    charge: ChargeDue | bytes,
    *,
    delivery: int = 1,
    replayed: bool = False,
) -> tuple[Processed, Action]:
    """One delivery, from its bytes to the action JetStream is told, recorded."""
    data = charge if isinstance(charge, bytes) else charge.to_json()
    concluded = await pipeline.conclude(Delivery(data, 1, delivery, replayed=replayed), POLICY)
    return concluded.processed, concluded.action


# ---- final outcomes: ack ------------------------------------------------------------------


async def test_a_charge_is_claimed_scored_charged_and_recorded_with_its_story(
    world: World,
) -> None:
    charge = due()
    processed, action = await through(world.pipeline(), charge)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    [made] = world.gateway.charges_of(charge)
    assert processed.answer is not None
    assert (processed.answer.charge_id, processed.called, processed.looked_up) == (
        made["id"],
        True,
        False,
    )
    row = world.ledger.row(charge)
    assert (row.status, row.gateway_charge_id, row.lease_owner) == ("succeeded", made["id"], None)
    assert (row.gateway_calls, row.scoring) == (1, "approved")
    [story] = world.ledger.story(charge)
    assert story | {"charge_id": made["id"]} == story
    assert (story["outcome"], story["action"], story["gateway"]) == ("charged", "ack", "succeeded")
    assert world.metric("charge_worker_gateway_calls_total", result="succeeded") == 1
    assert world.metric("charge_worker_gateway_seconds_count") == 1  # the one request's wait


async def test_a_decline_without_retries_is_final_and_keeps_its_code(world: World) -> None:
    charge = due(customer="cus_card")
    world.gateway.decline("cus_card", "insufficient_funds")
    processed, action = await through(world.pipeline(), charge)
    assert (processed.result.outcome, action) == (Outcome.DECLINED, Ack())
    row = world.ledger.row(charge)
    assert (row.status, row.decline_code, row.gateway_calls) == (
        "declined",
        "insufficient_funds",
        1,
    )
    declines = {"kind": "card_declined", "code": "insufficient_funds", "decline_class": "soft"}
    assert world.metric("charge_worker_declines_total", **declines) == 1


async def test_a_block_is_final_and_nothing_is_sent(world: World) -> None:
    charge = due(customer="cus_block_1")
    processed, action = await through(world.pipeline(), charge)
    assert (processed.result.outcome, action) == (Outcome.BLOCKED, Ack())
    assert (world.ledger.row(charge).status, world.ledger.row(charge).scoring) == (
        "blocked",
        "blocked",
    )
    assert world.gateway.sent() == 0


async def test_a_settled_charge_delivered_again_is_a_duplicate_told_not_sent(
    world: World,
) -> None:
    charge = due()
    pipeline = world.pipeline()
    await through(pipeline, charge)
    processed, action = await through(pipeline, charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.DUPLICATE, Ack())
    assert world.gateway.sent() == 1
    assert [s["outcome"] for s in world.ledger.story(charge)] == ["charged", "duplicate"]


async def test_a_settled_charge_replayed_from_the_dead_letters_is_still_a_duplicate(
    world: World,
) -> None:
    charge = due()
    pipeline = world.pipeline()
    await through(pipeline, charge)
    processed, action = await through(pipeline, charge, replayed=True)
    assert (processed.result.outcome, action) == (Outcome.DUPLICATE, Ack())
    assert world.gateway.sent() == 1


# ---- permanent outcomes: dead letter ------------------------------------------------------


async def test_poison_is_dead_lettered_and_nothing_is_written(world: World) -> None:
    processed, action = await through(world.pipeline(), b'{"schema": "charge.due/v1"}')
    assert (processed.result.outcome, action) == (Outcome.POISON, DeadLetter("poison"))
    assert world.ledger.rows == {}
    assert world.ledger.events == []


async def test_the_same_key_with_another_amount_is_a_conflict_never_sent(world: World) -> None:
    pipeline = world.pipeline()
    await through(pipeline, due(amount=500))
    processed, action = await through(pipeline, due(amount=900))
    assert (processed.result.outcome, action) == (Outcome.CONFLICT, DeadLetter("conflict"))
    assert world.gateway.sent() == 1
    assert world.ledger.row(due()).fingerprint == "500 RUB cus_ok"


async def test_a_charge_no_subscription_says_is_due_is_unverified(world: World) -> None:
    world.ledger.verified = lambda charge: charge.amount_minor < 100_000
    processed, action = await through(world.pipeline(), due(amount=500_000))
    assert (processed.result.outcome, action) == (Outcome.UNVERIFIED, DeadLetter("unverified"))
    assert world.ledger.rows == {}
    assert world.gateway.sent() == 0


async def test_a_rejected_request_fails_the_row_and_is_dead_lettered(world: World) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(400, "invalid_request_error", "parameter_invalid"))
    processed, action = await through(world.pipeline(), charge)
    assert (processed.result.outcome, action) == (Outcome.REJECTED, DeadLetter("rejected"))
    assert world.ledger.row(charge).status == "failed"


# ---- unknown outcomes: keep the lease, look up before anything is sent again -------------


@pytest.mark.parametrize("lost", [LoseAnswer(), LoseAnswer(dropped=True)], ids=["502", "reset"])
async def test_a_lost_answer_keeps_the_lease_and_the_next_delivery_finds_the_charge(
    world: World, lost: LoseAnswer
) -> None:
    charge = due()
    world.gateway.script(CHARGE, lost)
    processed, action = await through(world.pipeline("w1"), charge)
    assert processed.result.outcome is Outcome.OUTCOME_UNKNOWN
    assert action == Nak(LEASE_S)  # the call may still be running: wait the lease out
    row = world.ledger.row(charge)
    assert (row.status, row.lease_owner, row.gateway_calls) == ("pending", "w1", 1)

    world.clock.advance(LEASE_S + 1)
    processed, action = await through(world.pipeline("w2"), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    [made] = world.gateway.charges_of(charge)
    assert processed.looked_up
    assert processed.found is not None
    assert (processed.found.id, processed.called) == (made["id"], False)
    assert world.gateway.sent(CHARGE) == 1  # found by the lookup, never sent again
    row = world.ledger.row(charge)
    assert (row.status, row.gateway_charge_id, row.gateway_calls) == ("succeeded", made["id"], 1)
    assert world.ledger.story(charge)[-1]["lookup"] == "charged"


async def test_a_lookup_that_finds_nothing_lets_the_charge_go_ahead(world: World) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(503))  # nothing recorded, nothing known
    await through(world.pipeline("w1"), charge)
    world.clock.advance(LEASE_S + 1)
    processed, action = await through(world.pipeline("w2"), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert (processed.looked_up, processed.found, processed.called) == (True, None, True)
    assert world.gateway.sent(LOOKUP) == 1
    assert len(world.gateway.charges_of(charge)) == 1
    assert world.ledger.row(charge).gateway_calls == 2
    assert world.ledger.story(charge)[-1]["lookup"] == "nothing"


async def test_a_decline_found_by_the_lookup_is_recorded_as_the_decline(world: World) -> None:
    charge = due(customer="cus_decline_1")
    world.gateway.script(CHARGE, LoseAnswer())
    await through(world.pipeline("w1"), charge)
    world.clock.advance(LEASE_S + 1)
    processed, action = await through(world.pipeline("w2"), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.DECLINED, Ack())
    assert world.ledger.row(charge).status == "declined"
    assert world.gateway.sent(CHARGE) == 1


async def test_an_expired_lease_taken_over_is_looked_up_and_its_call_counted_when_found(
    world: World,
) -> None:
    """A worker died mid-call (no write counts its call): the next claim takes its lease
    over, looks up, and the write counts the dead worker's call it found."""
    charge = due()
    await world.ledger.claim(charge, "dead", 1)
    world.gateway.charged_earlier(charge)
    world.clock.advance(LEASE_S + 1)
    processed, action = await through(world.pipeline("w2"), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert processed.claim is not None
    assert processed.claim.taken_from == "dead"
    assert world.gateway.sent(CHARGE) == 0
    row = world.ledger.row(charge)
    assert (row.gateway_calls, row.scoring) == (1, "deferred")  # no verdict was recorded
    assert world.ledger.deferred[charge.order_id, PERIOD] == UNRECORDED_VERDICT


async def test_an_expired_lease_taken_over_with_nothing_found_counts_only_its_own_call(
    world: World,
) -> None:
    charge = due()
    await world.ledger.claim(charge, "dead", 1)
    world.clock.advance(LEASE_S + 1)
    processed, action = await through(world.pipeline("w2"), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert world.ledger.row(charge).gateway_calls == 1  # the dead worker's call never landed


async def test_a_charge_the_ledger_could_not_record_is_found_by_the_next_lookup(
    world: World,
) -> None:
    charge = due()
    world.ledger.down.add("settle")
    processed, action = await through(world.pipeline("w1"), charge)
    assert processed.result.outcome is Outcome.UNAVAILABLE  # nothing final was written
    assert action == Nak(BACKOFF_S[0])
    assert world.ledger.story(charge)[-1]["outcome"] == "unavailable"  # told, all the same
    world.ledger.down.clear()
    world.clock.advance(LEASE_S + 1)
    processed, action = await through(world.pipeline("w2"), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert world.gateway.sent(CHARGE) == 1


# ---- the gateway's other answers: retry later --------------------------------------------


async def test_a_request_in_progress_is_retried_soon_and_looked_up_then(world: World) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(409, "idempotency_error", "request_in_progress"))
    processed, action = await through(world.pipeline(), charge)
    assert (processed.result.outcome, action) == (Outcome.IN_PROGRESS, Nak(2.0))
    row = world.ledger.row(charge)
    assert (row.status, row.lease_owner, row.gateway_calls) == ("pending", None, 1)
    processed, action = await through(world.pipeline(), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert world.gateway.sent(LOOKUP) == 1


@pytest.mark.parametrize(("header", "delay"), [("7", 7.0), ("86400", BACKOFF_S[-1])])
async def test_a_rate_limit_waits_its_retry_after_within_the_last_backoff_step(
    world: World, header: str, delay: float
) -> None:
    world.gateway.script(CHARGE, Refuse(429, "rate_limit_error", "rate_limit", header))
    processed, action = await through(world.pipeline(), due())
    assert (processed.result.outcome, action) == (Outcome.RATE_LIMITED, Nak(delay))


async def test_a_404_is_no_verdict_the_charge_stays_pending_and_free(world: World) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(404))
    processed, action = await through(world.pipeline(), charge)
    assert (processed.result.outcome, action) == (Outcome.UNAVAILABLE, Nak(BACKOFF_S[0]))
    row = world.ledger.row(charge)
    assert (row.status, row.lease_owner) == ("pending", None)
    processed, action = await through(world.pipeline(), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert len(world.gateway.charges_of(charge)) == 1


async def test_an_unreachable_gateway_is_retried_with_the_backoff(world: World) -> None:
    charge = due()
    world.gateway.script(CHARGE, Unreachable())
    processed, action = await through(world.pipeline(), charge)
    assert (processed.result.outcome, action) == (Outcome.UNAVAILABLE, Nak(BACKOFF_S[0]))
    assert world.gateway.charges == []


# ---- leases ---------------------------------------------------------------------------------


async def test_a_lease_held_by_another_worker_waits_for_it(world: World) -> None:
    charge = due()
    await world.ledger.claim(charge, "w2", 1)
    world.clock.advance(4)
    processed, action = await through(world.pipeline("w1"), charge)
    assert (processed.result.outcome, action) == (Outcome.LEASE_HELD, Nak(BACKOFF_S[-1]))
    assert processed.result.retry_after_s == LEASE_S - 4
    assert world.ledger.row(charge).lease_owner == "w2"
    assert world.gateway.sent() == 0


async def test_a_lease_that_no_longer_outlives_the_request_is_renewed_before_it(
    world: World,
) -> None:
    charge = due()

    async def slow() -> None:
        world.clock.advance(LEASE_S - 10)  # the request (10 s) and the margin no longer fit

    world.scoring.meanwhile = slow
    processed, action = await through(world.pipeline(), charge)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert world.gateway.sent(CHARGE) == 1


async def test_a_lease_renewed_too_slowly_for_the_request_sends_nothing(world: World) -> None:
    charge = due()
    world.ledger.lease_s = 12.0  # shorter than the request (10 s) and the margin (5 s)
    processed, action = await through(world.pipeline(), charge)
    assert processed.result.outcome is Outcome.LEASE_HELD
    assert action == Nak(LEASE_RENEWAL_S)
    assert world.gateway.sent() == 0


async def test_a_lease_taken_over_while_scoring_sends_nothing(world: World) -> None:
    charge = due()

    async def taken_over() -> None:
        world.clock.advance(LEASE_S + 1)
        await world.ledger.claim(charge, "w2", 2)

    world.scoring.meanwhile = taken_over
    processed, _ = await through(world.pipeline("w1"), charge)
    assert processed.result.outcome is Outcome.LEASE_HELD
    assert world.gateway.sent() == 0
    assert world.ledger.row(charge).lease_owner == "w2"


async def test_a_final_state_the_ledger_refuses_is_decided_again_and_told(world: World) -> None:
    """The lease was taken over while the request was in flight: the charge's owner now is
    the other worker, which looks it up; this delivery records nothing but its story."""
    charge = due()

    async def taken_over() -> None:
        world.clock.advance(LEASE_S + 1)
        await world.ledger.claim(charge, "w2", 2)

    world.gateway.script(CHARGE, Meanwhile(taken_over))
    processed, action = await through(world.pipeline("w1"), charge)
    assert processed.result.outcome is Outcome.LEASE_HELD
    assert isinstance(action, Nak)
    row = world.ledger.row(charge)
    assert (row.status, row.lease_owner, row.gateway_calls) == ("pending", "w2", 0)
    [story] = world.ledger.story(charge)
    assert (story["outcome"], story["action"]) == ("lease_held", "nak")


# ---- scoring --------------------------------------------------------------------------------


async def test_scoring_too_slow_defers_the_verdict_and_the_charge_goes_ahead(
    world: World,
) -> None:
    charge = due()
    world.scoring.silent = True
    processed, action = await through(world.pipeline(scoring={"scoring_timeout_s": 0.01}), charge)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert world.ledger.row(charge).scoring == "deferred"
    assert "timed out" in world.ledger.deferred[charge.order_id, PERIOD]


async def test_scoring_behind_an_open_breaker_defers_without_a_call(world: World) -> None:
    world.scoring.down = True
    pipeline = world.pipeline(scoring={"scoring_breaker_failures": 1})
    await through(pipeline, due(1))  # opens the breaker
    processed, action = await through(pipeline, due(2))
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert world.scoring.calls == 1
    assert world.ledger.deferred[2, PERIOD] == "scoring breaker open"
    assert world.metric("charge_worker_scoring_total", result="failed_defer") == 2


async def test_scoring_down_under_policy_hold_sends_nothing_and_retries(world: World) -> None:
    charge = due()
    world.scoring.down = True
    pipeline = world.pipeline(scoring={"scoring_policy": "hold"})
    processed, action = await through(pipeline, charge)
    assert (processed.result.outcome, action) == (Outcome.UNAVAILABLE, Nak(BACKOFF_S[0]))
    assert world.gateway.sent() == 0
    assert world.ledger.row(charge).lease_owner is None


# ---- the last delivery --------------------------------------------------------------------


async def test_a_dependency_down_on_the_last_delivery_requeues_and_stays_pending(
    world: World,
) -> None:
    charge = due()
    world.gateway.script(CHARGE, Refuse(404))
    processed, action = await through(world.pipeline(), charge, delivery=POLICY.max_deliver)
    assert (processed.result.outcome, action) == (Outcome.UNAVAILABLE, Requeue())
    assert world.ledger.row(charge).status == "pending"


async def test_a_crash_on_the_last_delivery_gives_up_a_charge_never_sent(world: World) -> None:
    charge = due()
    pipeline = world.pipeline(failpoints="after_claim:raise")
    processed, action = await through(pipeline, charge, delivery=POLICY.max_deliver)
    assert processed.result.outcome is Outcome.CRASHED
    assert action == DeadLetter("max_deliveries")
    row = world.ledger.row(charge)
    assert (row.status, row.lease_owner) == ("failed", None)


async def test_a_crash_after_the_gateway_answered_keeps_the_lease_and_looks_up_next(
    world: World,
) -> None:
    charge = due()
    crashing = world.pipeline("w1", failpoints="after_gateway_response_before_commit:raise")
    processed, action = await through(crashing, charge)
    assert processed.result.outcome is Outcome.CRASHED
    assert processed.result.call_in_flight
    assert action == Nak(BACKOFF_S[0])
    assert world.ledger.row(charge).lease_owner == "w1"
    world.clock.advance(LEASE_S + 1)
    processed, action = await through(world.pipeline("w2"), charge, delivery=2)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    assert world.gateway.sent(CHARGE) == 1


async def test_a_replay_revives_a_failed_row(world: World) -> None:
    charge = due()
    await through(world.pipeline(failpoints="after_claim:raise"), charge, delivery=4)
    assert world.ledger.row(charge).status == "failed"
    processed, action = await through(world.pipeline(), charge)
    assert processed.result.outcome is Outcome.DUPLICATE  # only a replay may revive it
    processed, action = await through(world.pipeline(), charge, replayed=True)
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())


async def test_the_gateway_fake_answers_as_the_contract_says(world: World) -> None:
    """The fake itself: a key replays its first answer, other parameters reuse it."""
    charge = due()
    adapter = world.gateway.adapter()
    world.clients.append(adapter)
    first = await adapter.charge(charge)
    again = await adapter.charge(charge)
    assert (again.charge_id, again.replayed) == (first.charge_id, True)
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(world.gateway.handle), base_url=GATEWAY_URL
    ) as raw:
        reused = await raw.post(
            "/v1/charges",
            json={"amount": 1, "currency": "RUB", "customer": "cus_ok", "metadata": {}},
            headers={"Authorization": "Bearer sk_test_fake", "Idempotency-Key": charge.key},
        )
    assert reused.status_code == 400
    assert reused.json()["error"]["code"] == "key_reused"
