"""What the chaos run means to charge, written down before anything is published (the oracle).

Valid charges go the production way: one `subscriptions` row each, then `charge-worker
produce` (`charges.due` and `scheduled` ledger rows, one transaction per batch), so
reconcile can recover a message the broker lost. On top, as an external producer would, the
generator publishes directly: identical re-publishes (same `Nats-Msg-Id`, dropped by
JetStream), the same key under a new `Nats-Msg-Id` (absorbed by the claim), conflicting
duplicates (same key, another amount: dead-lettered `conflict`) and poison (dead-lettered
`poison`). Customer ids pick the outcome: `cus_decline…` is declined by the gateway,
`cus_block…` blocked by scoring.

With a retry schedule (the `retries_*` scenarios) the declines are the retries family's
(the simulator's customers, `sandbox/gateway/cards.py`): `cus_soft<k>_…` is declined
`insufficient_funds` until try `k` and charged on it (`k` within the schedule),
`cus_soft_…` on every try (exhausted: final `declined` on the last try),
`cus_code_stolen_card_…` hard (final `declined`, never sent again), `cus_code_expired_card_…`
and `cus_auth_…` the customer's to fix (`action_required`, never sent again by itself).
Each entry says the try its period ends on (`tries`).

With a `processing_share` (the `yookassa_pending` scenario) that share of the valid keys is
`cus_processing_…`: the gateway answers `pending` and settles the payment later, so the
ledger holds the row `processing` with the payment id until reconcile (or a webhook) finds
it settled (`settles_later`); the key is still charged once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import asyncpg
import nats.errors
from nats.js import JetStreamContext

from charge_worker.messages import ChargeDue

PERIOD = dt.date(2026, 12, 1)
FIRST_ORDER = 700_000
Expect = Literal["charged_once", "declined", "action_required", "blocked", "dead_lettered"]


@dataclass(frozen=True)
class Entry:
    """One manifest line: a charge key (or a poison body) and what must become of it."""

    key: str
    expect: Expect
    order_id: int | None = None
    customer: str | None = None
    amount: int | None = None
    poison: str | None = None  # the exact body, for poison (latin-1, to keep any byte)
    reason: str | None = None  # the Dlq-Reason a dead letter must carry
    conflict_amount: int | None = None  # a conflicting copy was published with this amount
    same_msg_id_copies: int = 0
    new_msg_id_copies: int = 0
    # the try the period ends on: charged on it, or its last one declined (1: the first)
    tries: int = 1
    # the gateway answers `pending` and settles later: the ledger records `processing`
    settles_later: bool = False

    def body(self) -> bytes:
        if self.poison is not None:
            return self.poison.encode("latin-1")
        return self.message().to_json()

    def message(self, amount: int | None = None) -> ChargeDue:
        assert self.order_id is not None
        assert self.customer is not None
        return ChargeDue.model_validate_json(
            json.dumps(
                {
                    "schema": "charge.due/v1",
                    "order_id": self.order_id,
                    "billing_period": PERIOD.isoformat(),
                    "subscription_id": f"sub_{self.order_id}",
                    "customer_id": self.customer,
                    "amount_minor": amount or self.amount,
                    "currency": "RUB",
                    "due_at": f"{PERIOD.isoformat()}T00:00:00Z",
                }
            )
        )


def _poison(index: int, rng: random.Random) -> str:
    """A body that breaks the contract in one of several ways; unique per index."""
    valid = {
        "schema": "charge.due/v1",
        "order_id": 9_000_000 + index,
        "billing_period": PERIOD.isoformat(),
        "subscription_id": f"sub_p{index}",
        "customer_id": f"cus_ok_p{index}",
        "amount_minor": 1000,
        "currency": "RUB",
        "due_at": f"{PERIOD.isoformat()}T00:00:00Z",
    }
    text = json.dumps(valid)
    shapes = [
        lambda: f"not json {index}",
        lambda: json.dumps(valid | {"amount_minor": 0}),
        lambda: json.dumps(valid | {"amount_minor": 10.5}),
        lambda: json.dumps(valid | {"amount_minor": "1000"}),
        lambda: json.dumps(valid | {"amount_minor": True}),
        lambda: json.dumps(valid | {"schema": "charge.due/v9"}),
        lambda: json.dumps({k: v for k, v in valid.items() if k != "currency"}),
        lambda: json.dumps([valid]),
        lambda: text.replace(f'"order_id": {valid["order_id"]}', '"order_id": ' + "9" * 5000),
        lambda: text[:-1] + ', "deep": ' + "[" * 5000 + "]" * 5000 + "}",
        lambda: json.dumps(valid | {"pad": "x" * 900_000}),
        lambda: text.replace('"amount_minor": 1000', '"amount_minor": NaN'),
        lambda: "\udcff".encode("utf-8", "surrogatepass").decode("latin-1") + f"{index}",
    ]
    return rng.choice(shapes)()


def plan(
    seed: int,
    size: int,
    *,
    poison_share: float = 0.03,
    conflicts: bool = True,
    retry_schedule: tuple[float, ...] = (),
    processing_share: float = 0.0,
) -> list[Entry]:
    """`size` keys: mostly charges, some declines, blocks, poison; extra copies of some
    (conflicting ones too, unless `conflicts` is False). With a `retry_schedule`, the
    declines are the retries family's (`_retried`), and half the keys are declined. With a
    `processing_share`, that share of the valid keys settles later (`_plain`)."""
    if retry_schedule and processing_share:
        raise ValueError("a processing share is drawn among the plain keys, not the retries'")
    shares = _plain(processing_share)
    rng = random.Random(seed)
    entries: list[Entry] = []
    for index in range(size):
        order_id = FIRST_ORDER + index
        draw = rng.random()
        amount = rng.randint(100, 500_000)
        if draw < poison_share:
            entries.append(
                Entry(
                    f"poison:{index}", "dead_lettered", poison=_poison(index, rng), reason="poison"
                )
            )
            continue
        tries = 1
        if retry_schedule:
            kind, customer, tries = _retried(index, draw - poison_share, rng, retry_schedule)
        else:
            kind, customer = next(
                (kind, c.format(index=index))
                for upto, kind, c in shares
                if draw < poison_share + upto
            )
        extra = rng.random()
        # a conflicting copy of try 1 must meet try 1's row: only a period charged on it
        first_try_charge = kind == "charged_once" and tries == 1
        entries.append(
            Entry(
                f"{order_id}:{PERIOD.isoformat()}",
                kind,
                order_id=order_id,
                customer=customer,
                amount=amount,
                conflict_amount=(
                    amount + 1 if conflicts and first_try_charge and extra < 0.02 else None
                ),
                same_msg_id_copies=1 if 0.02 <= extra < 0.07 else 0,
                new_msg_id_copies=1 if 0.07 <= extra < 0.12 else 0,
                tries=tries,
                settles_later=customer.startswith(PROCESSING),
            )
        )
    return entries


PROCESSING = "cus_processing_"  # the simulator answers `pending`, settles it later


def _plain(processing_share: float) -> tuple[tuple[float, Expect, str], ...]:
    """The plain keys' shares of the valid keys: (up to this draw, expected, customer)."""
    return (
        (0.06, "declined", "cus_decline_{index}"),
        (0.12, "blocked", "cus_block_{index}"),
        (0.12 + processing_share, "charged_once", PROCESSING + "{index}"),
        (1.00, "charged_once", "cus_ok_{index}"),
    )


# the retries family's shares of the valid keys: (up to this draw, expected, customer)
_RETRIED: tuple[tuple[float, Expect, str], ...] = (
    (0.25, "charged_once", "cus_soft{k}_{index}"),  # charged on a later try, k of the schedule
    (0.35, "declined", "cus_soft_{index}"),  # soft on every try: the schedule runs out
    (0.43, "declined", "cus_code_stolen_card_{index}"),  # hard: never sent again
    (0.47, "action_required", "cus_code_expired_card_{index}"),
    (0.51, "action_required", "cus_auth_{index}"),
    (0.54, "blocked", "cus_block_{index}"),
    (1.00, "charged_once", "cus_ok_{index}"),
)


def _retried(
    index: int, draw: float, rng: random.Random, schedule: tuple[float, ...]
) -> tuple[Expect, str, int]:
    """A key of the retries family: (what it becomes, its customer, the try it ends on)."""
    last = 1 + len(schedule)
    kind, customer = next((kind, c) for upto, kind, c in _RETRIED if draw < upto)
    k = rng.randint(2, last) if "{k}" in customer else 1
    tries = last if customer.startswith("cus_soft_") else k
    return kind, customer.format(k=k, index=index), tries


def write_manifest(path: Path, entries: Iterable[Entry]) -> None:
    with path.open("w") as out:
        for entry in entries:
            line = asdict(entry)
            if entry.poison is not None:  # the body can be 900 KB: keep its size and head
                line["poison"] = f"{len(entry.poison)} chars: {entry.poison[:80]!r}"
            out.write(json.dumps(line) + "\n")


async def load_subscriptions(database_url: str, entries: Iterable[Entry]) -> int:
    """One due subscription per valid entry, for `charge-worker produce` to schedule."""
    rows = [
        (f"sub_{e.order_id}", e.order_id, e.customer, e.amount, "RUB", PERIOD)
        for e in entries
        if e.order_id is not None
    ]
    conn = await asyncpg.connect(database_url)
    try:
        await conn.copy_records_to_table(
            "subscriptions",
            records=rows,
            columns=[
                "subscription_id",
                "order_id",
                "customer_id",
                "amount_minor",
                "currency",
                "next_billing_date",
            ],
        )
    finally:
        await conn.close()
    return len(rows)


def extras(entries: Iterable[Entry]) -> list[tuple[bytes, str]]:
    """Every direct publish: (body, Nats-Msg-Id)."""
    out: list[tuple[bytes, str]] = []
    for entry in entries:
        if entry.poison is not None:
            out.append((entry.body(), f"chaos-{entry.key}"))
            continue
        message = entry.message()
        out += [(entry.body(), message.msg_id)] * entry.same_msg_id_copies
        out += [(entry.body(), f"again:{entry.key}")] * entry.new_msg_id_copies
        if entry.conflict_amount is not None:
            out.append((entry.message(entry.conflict_amount).to_json(), f"conflict:{entry.key}"))
    return out


async def publish_all(
    js: JetStreamContext, subject: str, items: list[tuple[bytes, str]], *, within_s: float = 120
) -> None:
    """Publish each item until JetStream acknowledges it (the Nats-Msg-Id makes a retry safe)."""
    deadline = asyncio.get_running_loop().time() + within_s
    for body, msg_id in items:
        while True:
            try:
                await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id}, timeout=2)
                break
            except (nats.errors.Error, TimeoutError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
