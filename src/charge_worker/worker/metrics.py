"""All of the worker's metrics, on one object over an injected registry.

Label values come from the same enums as the decisions. Redeliveries are counted by the
worker (`num_delivered > 1`) as a counter: the server's `num_redelivered` is a gauge that
goes down, so `increase()` over it lies. Each is counted once, by its cause
(`decisions.RedeliveryCause`): asked for by a nak, or not; both series exist from the start,
so the first redelivery of either is an increase. The registry also carries the process and
runtime collectors (`process_*`, `python_gc_*`, `python_info`) the client's default registry
has.
Every figure is a stock prometheus_client class, updated through its public calls
(`.labels(...).inc()`, `.observe()`), as the webhook receiver's are. A labelled counter
counted on every delivery keeps its children (`Labelled`): `labels()` checks its arguments
and takes the metric's lock on each call, and a delivery makes four of them.
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

from charge_worker.breaker import Breaker
from charge_worker.worker.decisions import RedeliveryCause

PREFIX = "charge_worker"


class Labelled:
    """A labelled `Counter` whose child for each label-value tuple is made once, by the
    counter's own `labels()`, and kept. Counted from one event loop; the registry reads the
    counter itself."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.children: dict[tuple[str, ...], Counter] = {}

    def labels(self, *values: str) -> Counter:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.counter.labels(*values)
        return child


class Metrics:
    """The worker's figures; `registry` is what its `/metrics` serves."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        self.messages = Labelled(
            Counter(
                f"{PREFIX}_messages",
                "Deliveries processed, by outcome and action.",
                ["outcome", "action"],
                registry=registry,
            )
        )
        self.redeliveries = Labelled(
            Counter(
                f"{PREFIX}_redeliveries",
                "Deliveries seen with num_delivered > 1, by cause: nak (the previous delivery"
                " nak'd it with a delay, on purpose, as the ledger row records) or unacked"
                " (nothing recorded a nak: AckWait ran out, a worker died, an ack was lost).",
                ["cause"],
                registry=registry,
            )
        )
        for cause in RedeliveryCause:
            self.redeliveries.labels(cause.value)
        self.duplicates = Counter(
            f"{PREFIX}_duplicates_absorbed",
            "Deliveries of charges already final, absorbed by the ledger claim.",
            registry=registry,
        )
        self.charges = Labelled(
            Counter(
                f"{PREFIX}_charges", "Charges settled, by result.", ["result"], registry=registry
            )
        )
        self.gateway_calls = Labelled(
            Counter(
                f"{PREFIX}_gateway_calls",
                "Charge calls to the gateway, by result.",
                ["result"],
                registry=registry,
            )
        )
        self.declines = Labelled(
            Counter(
                f"{PREFIX}_declines",
                "Charges the provider declined, by kind: authentication_required (the bank wants "
                "the customer present: billing asks them to) or card_declined (any other reason);"
                " by the decline code (a code of docs/contracts/gateway.md's table, `other` for"
                " any other) and its class (soft, customer_action, hard).",
                ["kind", "code", "decline_class"],
                registry=registry,
            )
        )
        self.gateway_seconds = Histogram(
            f"{PREFIX}_gateway_seconds",
            "Time from a charge request's send to the gateway's answer (or its error), as the"
            " worker waited for it: the adapter's own reads and rate-limit waits before the"
            " send are not in it.",
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0),
        )
        self.tries = Labelled(
            Counter(
                f"{PREFIX}_tries",
                "Tries of a period that ended, by the state the period took (succeeded,"
                " processing, retry_scheduled, action_required, declined, blocked, failed), the"
                " decline's class (soft, customer_action, hard; none for no decline) and whether"
                " it was the period's first try or a retry.",
                ["outcome", "decline_class", "retry"],
                registry=registry,
            )
        )
        self.recovered = Labelled(
            Counter(
                f"{PREFIX}_retry_recovered_minor",
                "Minor units charged by retries (tries 2 and later), by currency.",
                ["currency"],
                registry=registry,
            )
        )
        self.periods_exhausted = Counter(
            f"{PREFIX}_periods_exhausted",
            "Periods final `declined` because the retry schedule had no try left.",
            registry=registry,
        )
        self.scoring = Labelled(
            Counter(
                f"{PREFIX}_scoring",
                "Scoring calls by result (approve, block, failed_<policy>).",
                ["result"],
                registry=registry,
            )
        )
        self.deferred_checks = Labelled(
            Counter(
                f"{PREFIX}_deferred_checks_resolved",
                "Deferred scoring checks resolved, by verdict.",
                ["verdict"],
                registry=registry,
            )
        )
        self.dead_letters = Labelled(
            Counter(
                f"{PREFIX}_dead_letters",
                "Dead letters written, by reason.",
                ["reason"],
                registry=registry,
            )
        )
        self.requeues = Counter(
            f"{PREFIX}_requeues",
            "Messages out of deliveries for a dependency's fault, republished as a fresh copy.",
            registry=registry,
        )
        self.exhausted = Labelled(
            Counter(
                f"{PREFIX}_deliveries_exhausted",
                "Messages whose last delivery died with its worker (the MAX_DELIVERIES advisory), "
                "by what became of them: forget (settled already), requeue, dead_letter.",
                ["verdict"],
                registry=registry,
            )
        )
        self.heartbeats = Counter(
            f"{PREFIX}_heartbeats", "In-progress acks (+WPI) sent.", registry=registry
        )
        self.breaker_open = Gauge(
            f"{PREFIX}_breaker_open",
            "1 while a dependency's circuit breaker is not closed.",
            ["dependency"],
            registry=registry,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_in_flight", "Messages being processed now.", registry=registry
        )
        self.consumer = {
            field: Gauge(
                f"{PREFIX}_consumer_{field}",
                f"JetStream's {field.replace('_', ' ')} of the durable consumer, seen by this pod.",
                registry=registry,
            )
            for field in ("pending", "ack_pending", "redelivered", "max_ack_pending")
        }
        self.paused = Gauge(
            f"{PREFIX}_paused",
            "1 while the durable consumer is paused (`charge-worker pause`): it delivers nothing.",
            registry=registry,
        )
        self.dlq_messages = Gauge(
            f"{PREFIX}_dlq_messages", "Messages in the dead-letter stream.", registry=registry
        )
        self.deferred_checks_pending = Gauge(
            f"{PREFIX}_deferred_checks_pending",
            "Charges made without a scoring verdict, not yet re-scored.",
            registry=registry,
        )
        self.processing = Histogram(
            f"{PREFIX}_processing_seconds",
            "Time from fetch to settle of one delivery.",
            registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )

    def watch(self, breaker: Breaker) -> None:
        """Keep `charge_worker_breaker_open{dependency=<breaker name>}` in step with it."""
        gauge = self.breaker_open.labels(breaker.name)
        gauge.set(breaker.state != "closed")
        breaker.listeners.append(lambda state: gauge.set(state != "closed"))
