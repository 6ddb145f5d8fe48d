"""The metrics of `charge-worker webhooks`, on one object over an injected registry.

Label values come from the same words the code uses: a delivery's `result` is the
`DeliveryRejected.result` of its rejection, or `journaled` / `duplicate` / `unavailable` /
`ignored`; an event's `status` is the journal status processing gave it. The series the
alerts read are created at 0 at start, so `increase()` sees their first increment. The
registry also carries the process and runtime collectors (`process_*`, `python_gc_*`,
`python_info`).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

PREFIX = "charge_worker_webhook"

OPEN_STATUSES = ("received", "processing", "awaiting_dependency", "needs_review")
FINAL_STATUSES = ("applied", "stale", "needs_review")
DELIVERY_RESULTS = (
    "journaled",
    "duplicate",
    "too_large",
    "too_slow",
    "malformed",
    "unauthorized",
    "unavailable",
    # a provider's event type the ledger does not use (Stripe sends many), or an event about
    # a charge not ours (an intent without our metadata: journaled `ignored`)
    "ignored",
)


class WebhookMetrics:
    """Receiver and processor figures."""

    def __init__(self, registry: CollectorRegistry, *, source: str) -> None:
        self.registry = registry
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        self.deliveries = Counter(
            f"{PREFIX}_deliveries",
            "Webhook deliveries received, by source and result.",
            ["source", "result"],
            registry=registry,
        )
        self.duplicates = Counter(
            f"{PREFIX}_duplicate_events",
            "Verified deliveries of an event already journaled (answered 2xx, nothing new).",
            ["source"],
            registry=registry,
        )
        self.journal_seconds = Histogram(
            f"{PREFIX}_journal_seconds",
            "Time from a delivery's arrival to its 200: checks, signature, journal insert.",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.events = Counter(
            f"{PREFIX}_events",
            "Journaled events processed, by the status they got.",
            ["status"],
            registry=registry,
        )
        self.needs_review = Counter(
            f"{PREFIX}_needs_review",
            "Webhook events the ledger cannot explain, left for a human (status needs_review).",
            registry=registry,
        )
        self.unmatched_charges = Counter(
            f"{PREFIX}_unmatched_charges",
            "Charges with our metadata whose amount, currency or customer is not the ledger"
            " row's: recorded as nothing (the due charge goes ahead), left for a human.",
            registry=registry,
        )
        self.purged = Counter(
            f"{PREFIX}_purged",
            "Journal rows deleted after the retention period.",
            registry=registry,
        )
        self.slow_connections = Counter(
            f"{PREFIX}_slow_connections",
            "Connections closed for being slow: a request head, or the rest of a body answered"
            " early, that did not arrive in time.",
            registry=registry,
        )
        self.inbox_rows = Gauge(
            f"{PREFIX}_inbox_rows",
            "Journal rows not final, by status.",
            ["status"],
            registry=registry,
        )
        self.oldest_open_s = Gauge(
            f"{PREFIX}_oldest_unprocessed_seconds",
            "Age of the oldest journaled event not processed yet (0 when none).",
            registry=registry,
        )
        for result in DELIVERY_RESULTS:
            self.deliveries.labels(source, result)
        self.duplicates.labels(source)
        for status in (*FINAL_STATUSES, "awaiting_dependency"):
            self.events.labels(status)
        for status in OPEN_STATUSES:
            self.inbox_rows.labels(status)
