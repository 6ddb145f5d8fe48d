"""The worker's per-delivery figures keep the series the alerts and the dashboard read: the
same names, types, label names and buckets, whatever class counts them.
A rename here is a silent alert (tests/integration/test_exported_series.py checks the
names the rules query against a live worker; this checks every one of them, queried or not).
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from charge_worker.worker.metrics import Metrics

COUNTERS = {
    "charge_worker_messages": ("outcome", "action"),
    "charge_worker_charges": ("result",),
    "charge_worker_gateway_calls": ("result",),
    "charge_worker_declines": ("kind", "code", "decline_class"),
    "charge_worker_scoring": ("result",),
    "charge_worker_deferred_checks_resolved": ("verdict",),
    "charge_worker_dead_letters": ("reason",),
    "charge_worker_deliveries_exhausted": ("verdict",),
    "charge_worker_redeliveries": ("cause",),
    "charge_worker_duplicates_absorbed": (),
    "charge_worker_requeues": (),
    "charge_worker_heartbeats": (),
}
# the bounds the dashboard's heatmap and quantile queries read, as their `le` labels
BOUNDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
LE = [*(str(float(bound)) for bound in BOUNDS), "+Inf"]


def _counted(metrics: Metrics) -> None:
    """One update of each labelled figure, with label values the worker uses."""
    metrics.messages.labels("charged", "ack").inc()
    metrics.charges.labels("charged").inc()
    metrics.gateway_calls.labels("succeeded").inc()
    metrics.declines.labels("card_declined", "insufficient_funds", "soft").inc()
    metrics.scoring.labels("failed_defer").inc()
    metrics.deferred_checks.labels("approved").inc()
    metrics.dead_letters.labels("poison").inc()
    metrics.exhausted.labels("requeue").inc()


def test_every_counter_keeps_its_name_type_and_label_names() -> None:
    registry = CollectorRegistry()
    _counted(Metrics(registry))
    families = {f.name: f for f in registry.collect() if f.name in COUNTERS}
    assert set(families) == set(COUNTERS)
    for name, labelnames in COUNTERS.items():
        family = families[name]
        assert family.type == "counter", name
        totals = [s for s in family.samples if s.name == f"{name}_total"]
        assert totals, f"{name}_total not exported"
        assert all(tuple(s.labels) == labelnames for s in totals), (name, totals)


def test_a_labelled_series_appears_at_its_first_increment_with_its_created_time() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    assert "charge_worker_charges_total{" not in generate_latest(registry).decode()

    metrics.charges.labels("declined").inc()
    metrics.charges.labels("declined").inc()
    labels = {"result": "declined"}
    assert registry.get_sample_value("charge_worker_charges_total", labels) == 2
    assert registry.get_sample_value("charge_worker_charges_created", labels) is not None


def test_redeliveries_of_every_cause_are_exported_from_the_start() -> None:
    """At 0 before the first redelivery of a cause: `increase()` over a series born at 1
    would miss that first one, and an alert on `cause="unacked"` would read nothing."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for cause in ("nak", "unacked"):
        value = registry.get_sample_value("charge_worker_redeliveries_total", {"cause": cause})
        assert value == 0, cause
    metrics.redeliveries.labels("unacked").inc()
    assert registry.get_sample_value("charge_worker_redeliveries_total", {"cause": "unacked"}) == 1


def test_processing_time_keeps_its_buckets() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for seconds in (0.003, 0.2, 7.5, 301.0):
        metrics.processing.observe(seconds)

    def bucket(le: str) -> float | None:
        return registry.get_sample_value("charge_worker_processing_seconds_bucket", {"le": le})

    assert [bucket(le) for le in LE] == [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4]
    assert registry.get_sample_value("charge_worker_processing_seconds_count") == 4
    assert registry.get_sample_value("charge_worker_processing_seconds_sum") == pytest.approx(
        308.703
    )
