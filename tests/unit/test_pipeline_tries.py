"""The pipeline's tries of a declined period (gateway.md, "Retrying a declined renewal"):
what a decline leaves the period in, by its class and the try's number, and what a lookup
of the period's charges may take as this try's answer."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from charge_worker.messages import ChargeDue
from charge_worker.worker.decisions import Ack, Outcome
from tests.support.fakes import LoseAnswer, World, due
from tests.unit.test_pipeline import CHARGE, LEASE_S, through

SCHEDULE = (86400.0, 3 * 86400.0)  # three tries: the first, then after 1 day and 3 days


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with World() as made:
        yield made


def try_of(charge: ChargeDue, n: int) -> ChargeDue:
    return charge.model_copy(update={"attempt": n})


def start_try(world: World, charge: ChargeDue, n: int) -> None:
    """What the producer's start of try `n` leaves the row as (retries/starts.py)."""
    row = world.ledger.row(charge)
    row.status, row.current_try, row.retry_in_s = "scheduled", n, None
    row.gateway_charge_id = row.decline_code = row.last_error = None


@pytest.mark.parametrize(
    ("code", "status", "retry_in_s"),
    [
        ("insufficient_funds", "retry_scheduled", SCHEDULE[0]),
        ("unheard_of_code", "retry_scheduled", SCHEDULE[0]),
        ("expired_card", "action_required", None),
        ("stolen_card", "declined", None),
    ],
)
async def test_a_decline_leaves_the_period_as_its_class_says(
    world: World, code: str, status: str, retry_in_s: float | None
) -> None:
    charge = due(customer="cus_card")
    world.gateway.decline("cus_card", code)
    processed, action = await through(world.pipeline(retry_schedule=SCHEDULE), charge)
    assert (processed.result.outcome, action) == (Outcome.DECLINED, Ack())
    row = world.ledger.row(charge)
    assert (row.status, row.decline_code, row.retry_in_s) == (status, code, retry_in_s)


async def test_without_a_schedule_every_decline_ends_the_period(world: World) -> None:
    charge = due(customer="cus_card")
    world.gateway.decline("cus_card", "insufficient_funds")
    await through(world.pipeline(), charge)
    assert world.ledger.row(charge).status == "declined"


async def test_the_last_try_declined_soft_exhausts_the_period(world: World) -> None:
    charge = due(customer="cus_card")
    world.gateway.decline("cus_card", "insufficient_funds")
    pipeline = world.pipeline(retry_schedule=SCHEDULE)
    await through(pipeline, charge)
    for n in (2, 3):
        start_try(world, charge, n)
        processed, _ = await through(pipeline, try_of(charge, n))
    assert processed.settlement is not None
    assert (processed.settlement.status, processed.settlement.exhausted) == ("declined", True)
    assert world.gateway.sent(CHARGE) == 3


async def test_a_later_try_that_succeeds_charges_under_its_own_key(world: World) -> None:
    charge = due(customer="cus_card")
    world.gateway.decline("cus_card", "insufficient_funds", until_try=2)
    pipeline = world.pipeline(retry_schedule=SCHEDULE)
    await through(pipeline, charge)
    start_try(world, charge, 2)
    processed, action = await through(pipeline, try_of(charge, 2))
    assert (processed.result.outcome, action) == (Outcome.CHARGED, Ack())
    failed, made = world.gateway.charges_of(charge)
    assert (failed["status"], made["status"], made["metadata"]["attempt"]) == (
        "failed",
        "succeeded",
        "2",
    )
    assert world.ledger.row(charge).gateway_charge_id == made["id"]


async def test_a_lost_answer_of_try_2_ignores_try_1s_decline_and_finds_its_own(
    world: World,
) -> None:
    charge = due(customer="cus_card")
    world.gateway.decline("cus_card", "insufficient_funds", until_try=2)
    await through(world.pipeline("w1", retry_schedule=SCHEDULE), charge)
    start_try(world, charge, 2)
    world.gateway.script(CHARGE, LoseAnswer())
    await through(world.pipeline("w1", retry_schedule=SCHEDULE), try_of(charge, 2))
    world.clock.advance(LEASE_S + 1)
    processed, _ = await through(
        world.pipeline("w2", retry_schedule=SCHEDULE), try_of(charge, 2), delivery=2
    )
    assert processed.result.outcome is Outcome.CHARGED
    assert world.ledger.row(charge).status == "succeeded"
    assert world.gateway.sent(CHARGE) == 2


async def test_a_lost_decline_of_try_2_is_try_2s_not_try_1s(world: World) -> None:
    charge = due(customer="cus_card")
    world.gateway.decline("cus_card", "insufficient_funds")
    await through(world.pipeline("w1", retry_schedule=SCHEDULE), charge)
    start_try(world, charge, 2)
    world.gateway.script(CHARGE, LoseAnswer())
    await through(world.pipeline("w1", retry_schedule=SCHEDULE), try_of(charge, 2))
    world.clock.advance(LEASE_S + 1)
    processed, _ = await through(
        world.pipeline("w2", retry_schedule=SCHEDULE), try_of(charge, 2), delivery=2
    )
    assert processed.found is not None
    assert processed.found.attempt == 2
    assert world.ledger.row(charge).retry_in_s == SCHEDULE[1]
    assert world.gateway.sent(CHARGE) == 2


async def test_money_an_earlier_try_holds_settles_the_period_and_nothing_is_sent(
    world: World,
) -> None:
    charge = due(customer="cus_card")
    world.gateway.decline("cus_card", "insufficient_funds")
    await through(world.pipeline("w1", retry_schedule=SCHEDULE), charge)
    world.gateway.charged_earlier(charge)  # try 1 captured after all (a gateway's late word)
    start_try(world, charge, 2)
    world.ledger.row(charge).gateway_calls = 1  # ...and try 2's outcome is unknown
    processed, _ = await through(world.pipeline("w2", retry_schedule=SCHEDULE), try_of(charge, 2))
    assert processed.result.outcome is Outcome.CHARGED
    assert world.gateway.sent(CHARGE) == 1
