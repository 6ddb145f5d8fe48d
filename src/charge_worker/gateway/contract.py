"""The `contract` adapter: the project's own gateway API (docs/contracts/gateway.md).

Every answer is classified here, and only here:

| answer                                   | result                                     |
|------------------------------------------|--------------------------------------------|
| 200 (replayed or not)                    | `ChargeResult(succeeded, charge_id)`       |
| 402                                      | `ChargeResult(declined, decline_code)`:    |
|                                          | `error.decline_code`, else `error.code`    |
|                                          | unless `card_declined`, else None (generic)|
| 409 request_in_progress                  | `RequestInProgress`                        |
| 429                                      | `RateLimited(retry_after_s=Retry-After)`   |
| 400 / 422 with the contract's error body | `GatewayRejected`                          |
| (`invalid_request_error`,                |                                            |
| `idempotency_error`: key_reused)         |                                            |
| 401 / 403                                | `DependencyUnavailable` (our key is wrong) |
| any other 4xx (404, 405, 408, 413, …),   | `DependencyUnavailable` (not accepted:     |
| or 400 / 422 without that body           | nothing charged, try later)                |
| 5xx, timeout, reset, unreadable 200      | `OutcomeUnknown`                           |
| 5xx with `Idempotent-Replayed: true`     | `ReplayedFailure` (an `OutcomeUnknown` the |
|                                          | breaker does not hear of: no new failure)  |
| connection refused (never sent)          | `DependencyUnavailable`                    |
| breaker open                             | `DependencyUnavailable` (until half-open)  |

Every `Idempotency-Key` sent (`<key>`, `refund:<charge id>`) starts with
`CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX`, empty unless set: an account shared with other
integrations. Lookups find charges by their metadata, which carries no prefix.

Try `n` of a period (docs/contracts/gateway.md, "Retrying a declined renewal") is sent under
its own key (`ChargeDue.key`: `<order_id>:<billing_period>`, `:<n>` after for `n >= 2`) with
`metadata.attempt = "<n>"` for `n >= 2`; try 1's request is byte for byte the one sent before
retries existed (no `attempt`), so a worker of either age repeating it is a replay, never a
`key_reused`. A lookup lists every try's charges of the period, each with its `attempt`
and, when failed, its `decline_code`.
Only the gateway's own verdict is final: a bare status from a proxy or a wrong path is not.
Every other `OutcomeUnknown` and every `DependencyUnavailable` counts toward the breaker.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import httpx

from charge_worker.errors import (
    DependencyUnavailable,
    GatewayRejected,
    OutcomeUnknown,
    RateLimited,
    ReplayedFailure,
    RequestInProgress,
)
from charge_worker.gateway.guard import BeforeSend, Guarded, answer, retry_after
from charge_worker.gateway.protocol import GatewayKind, HistoryOrder, WebhookScheme
from charge_worker.gateway.results import (
    CARD_DECLINED,
    ChargeResult,
    GatewayCharge,
    HistoryPage,
    charge_metadata,
)
from charge_worker.http import build_client
from charge_worker.messages import ChargeDue
from charge_worker.ratelimit import RateLimiter
from charge_worker.settings import GatewaySettings, require

IN_PROGRESS_RETRY_S = 2.0
LOOKUP_MAX_PAGES = 20  # 2,000 charges of one key: something is wrong
FINAL_ERROR_TYPES = frozenset({"invalid_request_error", "idempotency_error"})
FINAL_ERROR_CODES = frozenset({"charge_already_refunded"})  # the contract gives it no type


class ContractGateway(Guarded):
    """One shared client per process; `transport` is for unit tests only."""

    kind: GatewayKind = "contract"
    history_order: HistoryOrder = "oldest_first"
    webhook_scheme: WebhookScheme = "standard"
    reads_by_id = False

    def __init__(
        self,
        cfg: GatewaySettings,
        *,
        limiter: RateLimiter | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        api_key = cfg.required_api_key()
        super().__init__(cfg, limiter=limiter)
        self.client = build_client(
            require(cfg.url, "GATEWAY_URL"),
            timeout_s=cfg.gateway_timeout_s,
            max_connections=cfg.gateway_max_connections,
            headers={"Authorization": f"Bearer {api_key}"},
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
        """Charge once per key; raise the domain error the answer stands for."""
        headers = {"Idempotency-Key": f"{self.key_prefix}{charge.key}"}
        if traceparent:
            headers["traceparent"] = traceparent
        metadata = charge_metadata(charge)
        body = {
            "amount": charge.amount_minor,
            "currency": charge.currency,
            "customer": charge.customer_id,
            "metadata": metadata,
        }
        response = await self._send(
            "POST", "/v1/charges", json=body, headers=headers, before_send=before_send
        )
        if response.status_code == 200:
            data = _json(response)
            if not isinstance(data.get("id"), str) or data.get("status") != "succeeded":
                raise OutcomeUnknown(f"gateway answered 200 with an unexpected body: {data!r:.200}")
            return ChargeResult("succeeded", data["id"], replayed=_replayed(response))
        if response.status_code == 402:
            return ChargeResult("declined", None, decline_code=_decline_code(_error(response)))
        raise _classify(response)

    async def lookup(
        self,
        order_id: int,
        billing_period: dt.date,
        *,
        customer_id: str | None = None,
        since: dt.datetime | None = None,
    ) -> list[GatewayCharge]:
        """Every charge the gateway holds for this period (normally 0 or 1 a try), every
        try's, every page of them, oldest first; the contract finds them by the period
        alone (`customer_id` and `since` are not needed)."""
        params = {"order_id": str(order_id), "billing_period": billing_period.isoformat()}
        found: list[GatewayCharge] = []
        for _ in range(LOOKUP_MAX_PAGES):
            page = await self._page(params)
            found += page.charges
            if not page.has_more:
                return found
            if not page.charges:  # nothing to page on from: the rest is unknown
                raise OutcomeUnknown(
                    f"the gateway says more charges of {order_id}:"
                    f"{billing_period} follow an empty page"
                )
            params["starting_after"] = page.charges[-1].id
        raise OutcomeUnknown(
            f"the gateway lists over {LOOKUP_MAX_PAGES} pages of charges for"
            f" {order_id}:{billing_period}: the lookup stopped, nothing is known"
        )

    async def history(
        self,
        *,
        created_gte: int,
        created_lt: int,
        starting_after: str | None = None,
        limit: int = 100,
    ) -> HistoryPage:
        """One page of charge history, oldest first."""
        params: dict[str, str] = {
            "created_gte": str(created_gte),
            "created_lt": str(created_lt),
            "limit": str(limit),
        }
        if starting_after:
            params["starting_after"] = starting_after
        return await self._page(params)

    async def refund(self, charge_id: str, *, reason: str = "duplicate") -> str:
        """Refund a charge in full; return the refund id ("already" if it was refunded)."""
        response = await self._send(
            "POST",
            "/v1/refunds",
            json={"charge": charge_id, "reason": reason},
            headers={"Idempotency-Key": f"{self.key_prefix}refund:{charge_id}"},
        )
        if response.status_code == 200:
            return str(_json(response)["id"])
        if response.status_code == 400 and _error(response).get("code") == (
            "charge_already_refunded"
        ):
            return "already"
        raise _classify(response)

    async def retrieve(self, charge_id: str) -> GatewayCharge | None:
        """docs/contracts/gateway.md has no charge by id: its webhooks carry the whole charge at
        a revision (the `standard` scheme), so nothing needs one. Raises `GatewayRejected`."""
        raise GatewayRejected(
            f"contracts/gateway.md has no GET /v1/charges/{{id}} (asked for {charge_id})"
        )

    async def probe(self) -> bool:
        """A cheap read that lets an open breaker close again without spending a charge."""
        try:
            await self.history(created_gte=0, created_lt=1, limit=1)
        except (DependencyUnavailable, OutcomeUnknown):
            return False
        return True

    async def _page(self, params: dict[str, str]) -> HistoryPage:
        response = await self._send("GET", "/v1/charges", params=params)
        if response.status_code != 200:
            raise _classify(response)
        data = _json(response)
        try:
            charges = [GatewayCharge.from_json(item) for item in data["data"]]
        except (KeyError, TypeError, ValueError) as error:
            raise OutcomeUnknown(f"unreadable charge list: {error!r}") from error
        return HistoryPage(charges, bool(data.get("has_more")))

    async def _send(
        self, method: str, path: str, *, before_send: BeforeSend | None = None, **kwargs: Any
    ) -> httpx.Response:
        async def request() -> httpx.Response:
            response = await answer(
                self.client, method, path, who="gateway", what=f"{method} {path}", **kwargs
            )
            if response.status_code >= 500:
                if _replayed(response):
                    raise ReplayedFailure(
                        f"gateway answered {response.status_code}, replayed: its first"
                        " answer to this key"
                    )
                raise OutcomeUnknown(f"gateway answered {response.status_code}")
            if (refused := _refused(response)) is not None:
                raise refused  # inside the breaker: it counts
            return response

        return await self.guarded(f"{method} {path}", request, before_send=before_send)


def _decline_code(error: dict[str, Any]) -> str | None:
    """A 402's reason: `decline_code`; else a `code` other than `card_declined` (a gateway
    that names the reason there, as this project's simulator once did:
    `authentication_required`); else None, a generic decline."""
    for code in (error.get("decline_code"), error.get("code")):
        if isinstance(code, str) and code and code != CARD_DECLINED:
            return code
    return None


def _replayed(response: httpx.Response) -> bool:
    """The gateway's first answer to this idempotency key, told again."""
    return str(response.headers.get("Idempotent-Replayed", "")).lower() == "true"


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError as error:
        raise OutcomeUnknown(f"gateway answered {response.status_code} with non-JSON") from error
    if not isinstance(data, dict):
        raise OutcomeUnknown(f"gateway answered {response.status_code} with a JSON non-object")
    return data


def _error(response: httpx.Response) -> dict[str, Any]:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def _summary(response: httpx.Response) -> str:
    error = _error(response)
    what = f"{error.get('type', '')}/{error.get('code', '')}".strip("/")
    return f"gateway {response.status_code} {what}".rstrip()


def _refused(response: httpx.Response) -> DependencyUnavailable | None:
    """Our credentials refused, or the request not accepted at all (a wrong path, a proxy,
    a limit): nothing was charged. None for every other answer."""
    status = response.status_code
    if status in (401, 403):
        return DependencyUnavailable(f"{_summary(response)}: check GATEWAY_API_KEY")
    if not 400 <= status < 500 or status in (402, 409, 429) or _verdict(response):
        return None
    why = " without the contract's error body" if status in (400, 422) else ""
    return DependencyUnavailable(
        f"gateway answered {status}{why}: not accepted, nothing charged, retried later"
        " (a wrong GATEWAY_URL, a proxy, a limit?)"
    )


def _verdict(response: httpx.Response) -> bool:
    """A 400/422 that carries the contract's error body: the gateway's own answer."""
    error = _error(response)
    return response.status_code in (400, 422) and (
        error.get("type") in FINAL_ERROR_TYPES or error.get("code") in FINAL_ERROR_CODES
    )


def _classify(response: httpx.Response) -> Exception:
    """The domain error for an answer `_send` let through that is no success."""
    summary = _summary(response)
    if response.status_code == 409:
        return RequestInProgress(summary, retry_after_s=IN_PROGRESS_RETRY_S)
    if response.status_code == 429:
        return RateLimited(summary, retry_after_s=retry_after(response.headers.get("Retry-After")))
    if _verdict(response):
        return GatewayRejected(summary)
    return OutcomeUnknown(summary)  # e.g. a 402 where none belongs: nothing is known
