"""All of the worker's metrics, on one object over an injected registry.

Label values come from the same enums as the decisions. Redeliveries are counted by the
worker (`num_delivered > 1`) as a counter: the server's `num_redelivered` is a gauge that
goes down, so `increase()` over it lies. The registry also carries the process and runtime
collectors (`process_*`, `python_gc_*`, `python_info`) the client's default registry has.

What every delivery counts (the labelled counters, the processing time) is kept in plain
integers by `Tally` and `Timings` and turned into samples when the registry is read:
prometheus_client's `Counter` and `Histogram` take a lock and make three calls or more on
every update, five times per charge. The exposition is the same, `_created` included.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from charge_worker.breaker import Breaker

PREFIX = "charge_worker"


class Tally:
    """A labelled counter counted by one event loop; a scrape from another thread reads a
    copy. Exposed as prometheus_client's `Counter` would expose it."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.counts: dict[tuple[str, ...], int] = {}
        self.created: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, *labels: str) -> None:
        """Count one for these label values (as many as the label names)."""
        counts = self.counts
        if labels in counts:
            counts[labels] += 1
            return
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {labels}")
        self.created[labels] = time.time()
        counts[labels] = 1

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.counts.items()):
            family.add_metric(labels, value, created=self.created[labels])
        return [family]


class Timings:
    """A histogram without labels, observed by one event loop; exposed as
    prometheus_client's `Histogram` would expose it."""

    def __init__(
        self,
        name: str,
        documentation: str,
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = sorted(buckets)
        # the `le` label as prometheus_client writes it ("0.01", "1.0", "+Inf")
        self.le = [floatToGoString(b) for b in [*self.bounds, float("inf")]]  # type: ignore[no-untyped-call]
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[Metric]:
        counts, total = list(self.counts), self.sum
        buckets, cumulative = [], 0
        for le, count in zip(self.le, counts, strict=True):
            cumulative += count
            buckets.append((le, float(cumulative)))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], buckets, total)
        family.samples.append(Sample(f"{self.name}_created", {}, self.created))
        return [family]


class Metrics:
    """The worker's figures; `registry` is what its `/metrics` serves."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        self.messages = Tally(
            f"{PREFIX}_messages",
            "Deliveries processed, by outcome and action.",
            ["outcome", "action"],
            registry=registry,
        )
        self.redeliveries = Counter(
            f"{PREFIX}_redeliveries", "Deliveries seen with num_delivered > 1.", registry=registry
        )
        self.duplicates = Counter(
            f"{PREFIX}_duplicates_absorbed",
            "Deliveries of charges already final, absorbed by the ledger claim.",
            registry=registry,
        )
        self.charges = Tally(
            f"{PREFIX}_charges", "Charges settled, by result.", ["result"], registry=registry
        )
        self.gateway_calls = Tally(
            f"{PREFIX}_gateway_calls",
            "Charge calls to the gateway, by result.",
            ["result"],
            registry=registry,
        )
        self.declines = Tally(
            f"{PREFIX}_declines",
            "Charges the provider declined, by kind: authentication_required (the bank wants "
            "the customer present: billing asks them to) or card_declined (any other reason).",
            ["kind"],
            registry=registry,
        )
        self.scoring = Tally(
            f"{PREFIX}_scoring",
            "Scoring calls by result (approve, block, failed_<policy>).",
            ["result"],
            registry=registry,
        )
        self.deferred_checks = Tally(
            f"{PREFIX}_deferred_checks_resolved",
            "Deferred scoring checks resolved, by verdict.",
            ["verdict"],
            registry=registry,
        )
        self.dead_letters = Tally(
            f"{PREFIX}_dead_letters",
            "Dead letters written, by reason.",
            ["reason"],
            registry=registry,
        )
        self.requeues = Counter(
            f"{PREFIX}_requeues",
            "Messages out of deliveries for a dependency's fault, republished as a fresh copy.",
            registry=registry,
        )
        self.exhausted = Tally(
            f"{PREFIX}_deliveries_exhausted",
            "Messages whose last delivery died with its worker (the MAX_DELIVERIES advisory), "
            "by what became of them: forget (settled already), requeue, dead_letter.",
            ["verdict"],
            registry=registry,
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
        self.dlq_messages = Gauge(
            f"{PREFIX}_dlq_messages", "Messages in the dead-letter stream.", registry=registry
        )
        self.deferred_checks_pending = Gauge(
            f"{PREFIX}_deferred_checks_pending",
            "Charges made without a scoring verdict, not yet re-scored.",
            registry=registry,
        )
        self.processing = Timings(
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
