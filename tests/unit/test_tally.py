"""`Tally` and `Timings` (the worker's per-delivery counters and processing time, kept in
plain integers) expose exactly what prometheus_client's `Counter` and `Histogram` expose for
the same updates: names, types, labels, buckets, values, and a `_created` per series."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from charge_worker.worker.metrics import Tally, Timings

Render = Callable[[CollectorRegistry], bytes]
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
OBSERVED = (0.0, 0.003, 0.01, 0.0100001, 0.2, 1.0, 7.5, 299.0, 300.0, 301.0, 1e9)


def _without_created(text: str) -> str:
    """The exposition with each `_created` value masked: the two sides are created apart."""
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 <time>", text)


def _both() -> tuple[CollectorRegistry, CollectorRegistry]:
    return CollectorRegistry(), CollectorRegistry()


@pytest.mark.parametrize("render", [generate_latest, generate_openmetrics])
def test_a_tally_exposes_what_a_counter_does(render: Render) -> None:
    ours, theirs = _both()
    tally = Tally("cw_messages", "Deliveries.", ["outcome", "action"], registry=ours)
    counter = Counter("cw_messages", "Deliveries.", ["outcome", "action"], registry=theirs)
    for labels in [("charged", "ack"), ("charged", "ack"), ("crashed", "nak"), ('a"b', "\n")]:
        tally.inc(*labels)
        counter.labels(*labels).inc()

    assert _without_created(render(ours).decode()) == _without_created(render(theirs).decode())
    assert ours.get_sample_value("cw_messages_total", {"outcome": "charged", "action": "ack"}) == 2


@pytest.mark.parametrize("render", [generate_latest, generate_openmetrics])
def test_timings_expose_what_a_histogram_does(render: Render) -> None:
    ours, theirs = _both()
    timings = Timings("cw_processing_seconds", "Fetch to settle.", buckets=BUCKETS, registry=ours)
    histogram = Histogram(
        "cw_processing_seconds", "Fetch to settle.", buckets=BUCKETS, registry=theirs
    )
    for seconds in OBSERVED:
        timings.observe(seconds)
        histogram.observe(seconds)

    assert _without_created(render(ours).decode()) == _without_created(render(theirs).decode())


def test_an_unused_tally_exposes_no_series_and_a_wrong_label_count_is_refused() -> None:
    registry = CollectorRegistry()
    tally = Tally("cw_charges", "Charges.", ["result"], registry=registry)
    assert "cw_charges_total{" not in generate_latest(registry).decode()

    with pytest.raises(ValueError, match="cw_charges"):
        tally.inc("charged", "extra")
    assert registry.get_sample_value("cw_charges_total", {"result": "charged"}) is None


def test_a_name_is_registered_once() -> None:
    registry = CollectorRegistry()
    Tally("cw_charges", "Charges.", ["result"], registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("cw_charges", "Charges.", ["result"], registry=registry)
