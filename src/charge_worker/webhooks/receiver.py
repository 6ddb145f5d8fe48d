"""`POST /webhooks/gateway`: check, verify, journal, answer. Nothing slow happens here.

In this order, each step refusing with no side effect:

| step                                                    | refused with              |
|---------------------------------------------------------|---------------------------|
| `Content-Length` over the limit (nothing read yet)      | 413                       |
| a signature header missing or malformed                 | 400                       |
| `webhook-timestamp` further from now than the tolerance | 401                       |
| the body, read as a stream, passes the limit (stops)    | 413                       |
| the body is not complete within the body deadline       | 408                       |
| no signature matches a configured secret                | 401                       |
| the body is no event of the contract                    | 400                       |
| the journal insert fails or outlasts `JOURNAL_BUDGET_S` | 503 (the gateway retries) |

Then `200`, whether the event is new or a redelivery (counted as a duplicate). Applying it
is the processor's business, after the answer. Log lines carry the event and message ids,
never a secret or a signature.

How the `stripe` and `yookassa` schemes check a delivery, what each scheme's body is, and
the journal row it makes: `bodies.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from charge_worker import tracing
from charge_worker.errors import (
    DeliveryRejected,
    DeliveryTooLarge,
    DeliveryTooSlow,
    DependencyUnavailable,
    ForeignSource,
    MalformedDelivery,
    SettingsError,
)
from charge_worker.webhooks.bodies import journal_entry
from charge_worker.webhooks.inbox import Inbox
from charge_worker.webhooks.metrics import WebhookMetrics
from charge_worker.webhooks.signature import Scheme, StripeVerifier, Verifier
from charge_worker.webhooks.sources import SourceCheck

log = structlog.get_logger(__name__)
JOURNAL_BUDGET_S = 3.0  # the gateway gives up on an answer after 5 s


def check_length(request: Request, max_bytes: int) -> None:
    """`DeliveryTooLarge` when the declared `Content-Length` is over `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise DeliveryTooLarge(f"Content-Length is over {max_bytes} bytes")


async def read_limited(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body, or `DeliveryTooLarge` as soon as it passes `max_bytes` (the rest unread),
    or `DeliveryTooSlow` when it is not complete within `timeout_s`."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise DeliveryTooLarge(f"the body is over {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError as error:
        raise DeliveryTooSlow(f"the body took over {timeout_s:g}s") from error
    except ClientDisconnect as error:
        raise MalformedDelivery("the client left before the body was complete") from error
    return b"".join(chunks)


async def read_verified(
    request: Request,
    verifier: Verifier | StripeVerifier | None,
    max_bytes: int,
    timeout_s: float,
) -> tuple[bytes, str]:
    """The body and its signed message id: the signature headers and their time checked
    before the body is read, the signature after. Unsigned (`verifier=None`): the body, ""."""
    if verifier is None:
        return await read_limited(request, max_bytes, timeout_s), ""
    signed = verifier.read_headers(request.headers)
    verifier.check_time(signed)
    body = await read_limited(request, max_bytes, timeout_s)
    verifier.verify(body, signed)
    return body, signed.message_id


def receiver(
    *,
    source: str,
    verifier: Verifier | StripeVerifier | None,
    inbox: Inbox,
    scheme: Scheme = "standard",
    sources: SourceCheck | None = None,
    metrics: WebhookMetrics,
    max_bytes: int,
    body_timeout_s: float,
    on_journaled: Callable[[], None] = lambda: None,
) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint for one source's webhooks: signed ones checked by `verifier`, unsigned
    ones (`verifier=None`) by where they come from (`sources`)."""
    if verifier is None and sources is None:
        raise SettingsError("the webhook receiver has neither a secret nor source networks")

    @tracing.served("POST", f"/webhooks/{source}")
    async def receive(request: Request) -> Response:
        started = time.perf_counter()
        message_id = request.headers.get("webhook-id", "")[:255]
        sender: dict[str, str] = {}
        try:
            if sources is not None:  # before anything is read
                peer = request.client.host if request.client else None
                found = sources.check(peer, request.headers.getlist("x-forwarded-for"))
                sender = {"address": found.text}
            check_length(request, max_bytes)
            body, signed_id = await read_verified(request, verifier, max_bytes, body_timeout_s)
            entry = journal_entry(source, scheme, body, signed_id)
        except DeliveryRejected as rejected:
            if isinstance(rejected, ForeignSource):
                sender = {"address": rejected.address}
            metrics.deliveries.labels(source, rejected.result).inc()
            log.info(
                "webhook.rejected",
                source=source,
                message_id=message_id,
                status=rejected.status_code,
                reason=str(rejected),
                **sender,
            )
            return JSONResponse({"error": str(rejected)}, status_code=rejected.status_code)
        if tracing.enabled() and entry is not None:
            tracing.note(
                {
                    "charge_worker.event_id": entry.event_id,
                    "charge_worker.charge_id": entry.object_id,
                }
            )
        if entry is None:  # a Stripe or YooKassa event about nothing the ledger records
            metrics.deliveries.labels(source, "ignored").inc()
            return JSONResponse({"received": None, "ignored": True})
        try:
            async with asyncio.timeout(JOURNAL_BUDGET_S):
                new = await inbox.journal(entry)
        except MalformedDelivery as rejected:
            metrics.deliveries.labels(source, rejected.result).inc()
            log.info(
                "webhook.rejected", source=source, event_id=entry.event_id, reason=str(rejected)
            )
            return JSONResponse({"error": str(rejected)}, status_code=400)
        except (TimeoutError, DependencyUnavailable) as error:
            metrics.deliveries.labels(source, "unavailable").inc()
            log.warning(
                "webhook.not_journaled",
                source=source,
                event_id=entry.event_id,
                error=f"{type(error).__name__}: {error}",
            )
            return JSONResponse(
                {"error": "the journal is unavailable; retry"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        ignored = entry.status == "ignored"
        result = "ignored" if ignored else "journaled"
        metrics.deliveries.labels(source, result if new else "duplicate").inc()
        if new and not ignored:
            on_journaled()
        else:
            metrics.duplicates.labels(source).inc()
        metrics.journal_seconds.observe(time.perf_counter() - started)
        log.info(
            "webhook.received",
            source=source,
            event_id=entry.event_id,
            message_id=entry.message_id,
            type=entry.event_type,
            charge_id=entry.object_id,
            revision=entry.revision,
            duplicate=not new,
            ignored=ignored,
            **sender,
        )
        answer: dict[str, object] = {"received": entry.event_id, "duplicate": not new}
        return JSONResponse(answer | ({"ignored": True} if ignored else {}))

    return receive
