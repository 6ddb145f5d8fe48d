"""The `yookassa` adapter: autopayments with a saved payment method, as YooKassa's API v3
documents them, over the project's own HTTP client (docs/adapters.md says why not the
official SDK).

| call       | YooKassa                                                                  |
|------------|---------------------------------------------------------------------------|
| `charge`   | `POST /v3/payments` with `amount` (`{"value": "990.00", "currency"}`),    |
|            | `capture: true`, `payment_method_id` (the subscription's `customer_id`),  |
|            | `metadata` `order_id`, `billing_period` (`attempt` for a try n >= 2) and  |
|            | the try's key as `Idempotence-Key`                                        |
| `lookup`   | `GET /v3/payments?created_at.gte=<since - 1 h, else period - 31 days>`,   |
|            | every page, matched on the metadata (every try's payments of the period): |
|            | YooKassa has no search by metadata; a list is read-your-writes            |
| `history`  | `GET /v3/payments?created_at.gte=…&created_at.lt=…&cursor=…`, newest      |
|            | first (YooKassa's order); `starting_after` is YooKassa's `next_cursor`    |
| `refund`   | `GET /v3/payments/{id}` (what is left to refund: "already" when nothing), |
|            | then `POST /v3/refunds` `payment_id`, `amount` (the rest),                |
|            | `Idempotence-Key: refund:<payment id>`                                    |
| `retrieve` | `GET /v3/payments/{id}` (404 `not_found`: None)                           |

Every request carries HTTP Basic auth `<shopId>:<secret key>` (`GATEWAY_API_KEY`), spends
a token of the fleet's rate and goes through the breaker under the deadline (`Guarded`).
Every `Idempotence-Key` starts with `CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX`, short enough (21
at most, checked at start) that every key fits YooKassa's 64 characters. How each answer
maps: `yookassa_mapping.py`.
"""

from __future__ import annotations

import base64
import datetime as dt
import re
from collections.abc import Iterable
from typing import Any

import httpx

from charge_worker import money
from charge_worker.errors import (
    DependencyUnavailable,
    GatewayRejected,
    OutcomeUnknown,
    SettingsError,
)
from charge_worker.gateway import yookassa_mapping as mapping
from charge_worker.gateway.guard import BeforeSend, Guarded, answer
from charge_worker.gateway.protocol import GatewayKind, HistoryOrder, WebhookScheme
from charge_worker.gateway.results import (
    ChargeResult,
    GatewayCharge,
    HistoryPage,
    charge_metadata,
)
from charge_worker.http import build_client
from charge_worker.messages import ChargeDue
from charge_worker.ratelimit import RateLimiter
from charge_worker.settings import GatewaySettings

YOOKASSA_API = "https://api.yookassa.ru"
# YooKassa's limit on an Idempotence-Key. The longest is a refund's, `refund:<payment id>`
# (a UUID): a prefix that lets it fit lets every charge's fit too (at most 35 characters:
# a bigint order id, the period, a try of at most 4 digits)
MAX_KEY_LENGTH = 64
PAYMENT_ID_LENGTH = 36
# A period's payment is made once it is due: at its first day, or a little before when billed
# ahead. A lookup told nothing more lists the shop's payments from this long before the
# period's first day; told `since` (the ledger's try began then), from `since` less
# `LOOKUP_MARGIN`: the database's clock and YooKassa's may disagree, by far less.
LOOKUP_LEAD = dt.timedelta(days=31)
LOOKUP_MARGIN = dt.timedelta(hours=1)
LOOKUP_MAX_PAGES = 500  # 50,000 payments in the window: the lookup stops, nothing is known
# A saved payment method's id, as YooKassa mints them (a UUID) or as a sandbox names them
PAYMENT_METHOD_ID = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)
_CREDENTIALS = re.compile(r"([0-9]+):(\S+)", re.ASCII)


class YooKassaGateway(Guarded):
    """One shared client per process; `transport` is for unit tests only."""

    kind: GatewayKind = "yookassa"
    history_order: HistoryOrder = "newest_first"
    webhook_scheme: WebhookScheme = "yookassa"
    reads_by_id = True

    def __init__(
        self,
        cfg: GatewaySettings,
        *,
        limiter: RateLimiter | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        credentials = cfg.required_api_key()
        if not _CREDENTIALS.fullmatch(credentials):
            raise SettingsError(
                "GATEWAY_API_KEY: for GATEWAY_KIND=yookassa, <shopId>:<secret key>"
                " (HTTP Basic auth's pair: digits, a colon, the key)"
            )
        refund_key = len(f"{cfg.idempotency_key_prefix}refund:") + PAYMENT_ID_LENGTH
        if refund_key > MAX_KEY_LENGTH:
            raise SettingsError(
                "CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX: at most"
                f" {MAX_KEY_LENGTH - refund_key + len(cfg.idempotency_key_prefix)} characters"
                f" with GATEWAY_KIND=yookassa (a refund's key, refund:<payment id>, must fit"
                f" YooKassa's {MAX_KEY_LENGTH})"
            )
        super().__init__(cfg, limiter=limiter)
        token = base64.b64encode(credentials.encode()).decode()
        self.client = build_client(
            cfg.url or YOOKASSA_API,
            timeout_s=cfg.gateway_timeout_s,
            max_connections=cfg.gateway_max_connections,
            headers={"Authorization": f"Basic {token}"},
            transport=transport,
        )

    async def aclose(self) -> None:
        """Release the connections."""
        await self.client.aclose()

    async def charge(
        self,
        charge: ChargeDue,
        *,
        traceparent: str | None = None,
        before_send: BeforeSend | None = None,
    ) -> ChargeResult:
        """One autopayment per key with the saved method `customer_id` names, captured at
        once; `before_send` awaited before it. Nothing is sent for a charge YooKassa could
        not take as asked (`GatewayRejected`): a method id it never mints, a currency ISO
        4217 does not know."""
        if not PAYMENT_METHOD_ID.fullmatch(charge.customer_id):
            raise GatewayRejected(
                f"customer_id {charge.customer_id[:80]!r} is no YooKassa payment_method_id"
                " (1-64 characters of A-Z a-z 0-9 _ -)"
            )
        try:
            value = money.to_decimal_string(charge.amount_minor, charge.currency)
        except ValueError as error:
            raise GatewayRejected(f"amount: {error}") from error
        metadata = charge_metadata(charge)
        body = {
            "amount": {"value": value, "currency": charge.currency},
            "capture": True,
            "payment_method_id": charge.customer_id,
            # part of the keyed body: a change of its words between releases makes a key
            # in flight "duplicated" (rejected) when repeated; keep it as it is
            "description": f"Renewal {charge.order_id} {charge.billing_period.isoformat()}",
            "metadata": metadata,
        }
        headers = {"Idempotence-Key": f"{self.key_prefix}{charge.key}"}
        if traceparent:
            headers["traceparent"] = traceparent
        payment = await self._json(
            "POST", "/v3/payments", json=body, headers=headers, before_send=before_send
        )
        try:
            return mapping.charge_result(payment)
        except mapping.Unreadable as error:
            raise OutcomeUnknown(str(error)) from error

    async def lookup(
        self,
        order_id: int,
        billing_period: dt.date,
        *,
        customer_id: str | None = None,
        since: dt.datetime | None = None,
    ) -> list[GatewayCharge]:
        """The period's payments made since `since` (less `LOOKUP_MARGIN`), else since
        `LOOKUP_LEAD` before the period, oldest first: the shop's payments in that window,
        matched on their metadata (each read in full only once it matched: another
        integration's payment need not be readable). YooKassa has no search by metadata:
        the window is the whole cost of a lookup."""
        if since is None:
            since = dt.datetime.combine(billing_period - LOOKUP_LEAD, dt.time(), dt.UTC)
        else:
            since -= LOOKUP_MARGIN
        params = {"created_at.gte": mapping.iso(int(since.timestamp())), "limit": "100"}
        wanted = {"order_id": str(order_id), "billing_period": billing_period.isoformat()}
        found: list[GatewayCharge] = []
        for _ in range(LOOKUP_MAX_PAGES):
            items, cursor = await self._list(params)
            found += self._read(item for item in items if mapping.metadata_matches(item, wanted))
            if cursor is None:
                return found[::-1]
            params["cursor"] = cursor
        raise OutcomeUnknown(
            f"the shop has over {LOOKUP_MAX_PAGES * 100} payments since {since.date()}:"
            f" the lookup of {order_id}:{billing_period} stopped"
        )

    async def history(
        self,
        *,
        created_gte: int,
        created_lt: int,
        starting_after: str | None = None,
        limit: int = 100,
    ) -> HistoryPage:
        """One page of payments created in the window, newest first; `starting_after` is
        the page before's `next_after` (YooKassa's cursor)."""
        params = {
            "created_at.gte": mapping.iso(created_gte),
            "created_at.lt": mapping.iso(created_lt),
            "limit": str(limit),
        }
        if starting_after:
            params["cursor"] = starting_after
        return await self._page(params)

    async def refund(self, charge_id: str, *, reason: str = "duplicate") -> str:
        """Refund a payment in full: what is left of it ("already" when nothing is)."""
        payment = await self.retrieve(charge_id)
        if payment is None:
            raise GatewayRejected(f"YooKassa has no payment {charge_id}")
        if payment.refunded:
            return "already"
        if not payment.charged:
            raise GatewayRejected(f"YooKassa payment {charge_id} is {payment.status}: no refund")
        rest = money.to_decimal_string(payment.amount - payment.amount_refunded, payment.currency)
        refund = await self._json(
            "POST",
            "/v3/refunds",
            json={
                "payment_id": charge_id,
                "amount": {"value": rest, "currency": payment.currency},
                "description": reason,
            },
            headers={"Idempotence-Key": f"{self.key_prefix}refund:{charge_id}"},
        )
        return mapping.refund_id(refund)

    async def retrieve(self, charge_id: str) -> GatewayCharge | None:
        """The payment as YooKassa holds it now (None: no such payment)."""
        payment = await self._json("GET", f"/v3/payments/{charge_id}", absent_ok=True)
        if not payment:
            return None
        try:
            return mapping.gateway_charge(payment)
        except mapping.Unreadable as error:
            raise OutcomeUnknown(str(error)) from error

    async def probe(self) -> bool:
        """A cheap read that lets an open breaker close again without spending a charge."""
        try:
            await self.history(created_gte=0, created_lt=1, limit=1)
        except (DependencyUnavailable, OutcomeUnknown):
            return False
        return True

    async def _page(self, params: dict[str, str]) -> HistoryPage:
        items, cursor = await self._list(params)
        return HistoryPage(self._read(items), cursor is not None, cursor=cursor)

    async def _list(self, params: dict[str, str]) -> tuple[list[Any], str | None]:
        """One page of `GET /v3/payments`: its items, and the next page's cursor (None:
        the last page)."""
        data = await self._json("GET", "/v3/payments", params=params)
        items, cursor = data.get("items"), data.get("next_cursor")
        if not isinstance(items, list):
            raise OutcomeUnknown("unreadable YooKassa payment list: no items")
        return items, str(cursor) if cursor else None

    @staticmethod
    def _read(items: Iterable[Any]) -> list[GatewayCharge]:
        try:
            return [mapping.gateway_charge(item) for item in items]
        except mapping.Unreadable as error:
            raise OutcomeUnknown(f"unreadable YooKassa payment list: {error}") from error

    async def _json(
        self,
        method: str,
        path: str,
        *,
        absent_ok: bool = False,
        before_send: BeforeSend | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The 200 answer's JSON object; `{}` for YooKassa's own 404 when `absent_ok`; the
        domain error of any other answer, raised inside the breaker."""
        named = path.startswith("/v3/payments/")
        what = f"{method} /v3/payments/{{id}}" if named else f"{method} {path}"

        async def request() -> dict[str, Any]:
            response = await answer(self.client, method, path, who="YooKassa", what=what, **kwargs)
            try:
                body = response.json()
            except ValueError:
                body = None
            if response.status_code == 200:
                if not isinstance(body, dict):
                    raise OutcomeUnknown(f"YooKassa {what} answered 200 with no JSON object")
                return body
            if absent_ok and mapping.not_found(response.status_code, body):
                return {}  # an answer about the object: no breaker count
            raise mapping.domain_error(response.status_code, body, response.headers)

        return await self.guarded(what, request, before_send=before_send)
