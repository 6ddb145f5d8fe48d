"""Cases 3, 4 and 5: throughput when the dependencies, not the CPU, set the pace.

* latency-bound: gateway 150 ms fixed, scoring lognormal p50 50 ms / p99 150 ms. The ceiling
  is Little's law: `concurrency` slots, each busy for the mean dependency latency.
* incident: the same gateway; scoring p50 50 ms, p99 1.2 s and 2 % of calls at 6-8 s,
  with the worker's 2 s scoring deadline (`CHARGE_WORKER_SCORING_TIMEOUT_S=2`, policy
  `defer`): a call past 2 s is cut, the charge goes ahead and a deferred check is recorded.
* scale-out: the latency-bound case with two worker processes and twice the messages.
* bare latency-bound: the bare pipeline in the latency-bound case, the in-run ceiling there
  (what the stack itself, simulators and event loops included, adds to the dependencies'
  latency shows as a gap to Little's bound that the bare pipeline has too).

During these drains the harness also collects the ack advisories: the server's
delivery-to-ack time of every message, i.e. how long each slot was really held.
"""

from __future__ import annotations

from benchmarks.bench import Bench
from benchmarks.drain import Drained, Events, Plan, Workers
from benchmarks.stats import littles_law_bound, model_mean
from benchmarks.throughput import bare_consumer
from charge_worker.sandbox.latency import LatencyModel

GATEWAY = LatencyModel.fixed(0.150)
SCORING = LatencyModel.quantiles(0.050, 0.150)
INCIDENT_SCORING = LatencyModel.quantiles(
    0.050, 1.2, slow_fraction=0.02, slow_min_s=6.0, slow_max_s=8.0
)
SCORING_TIMEOUT_S = 2.0


def mean_latency_s(scoring: LatencyModel) -> float:
    """The mean time one message holds a slot waiting for its dependencies."""
    return model_mean(GATEWAY) + model_mean(scoring, SCORING_TIMEOUT_S)


def bound(concurrency: int, scoring: LatencyModel, processes: int = 1) -> float:
    """Little's-law ceiling for `processes` workers of `concurrency` slots each."""
    return processes * littles_law_bound(concurrency, mean_latency_s(scoring))


def _plan(bench: Bench, messages: int, scoring: LatencyModel, events: Events = "outbox") -> Plan:
    return Plan(
        messages=messages,
        gateway=GATEWAY,
        scoring=scoring,
        timeout_s=max(180.0, messages / 5),
        watch_acks=True,
        events=events,
    )


async def _sample(
    bench: Bench, label: str, scoring: LatencyModel, processes: int, k: int
) -> Drained:
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url, scoring_timeout_s=SCORING_TIMEOUT_S)
    plan = _plan(bench, bench.sizes.latency_messages * processes, scoring)
    log_dir = bench.log_dir / f"{label.replace(' ', '-')}-{k}"
    log_dir.mkdir(exist_ok=True)
    workers = Workers(settings, log_dir, count=processes)
    return await bench.sample(f"{label} {k}/{bench.sizes.repeats}", plan, settings, workers)


async def bare_latency_bound_sample(bench: Bench, k: int) -> Drained:
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url, scoring_timeout_s=SCORING_TIMEOUT_S)
    plan = _plan(bench, bench.sizes.latency_messages, SCORING, events="direct")
    consumer = bare_consumer(bench, settings, f"bare-latency-bound-{k}")
    return await bench.sample(
        f"bare latency-bound {k}/{bench.sizes.repeats}", plan, settings, consumer
    )


async def latency_bound_sample(bench: Bench, k: int) -> Drained:
    return await _sample(bench, "latency-bound", SCORING, 1, k)


async def incident_sample(bench: Bench, k: int) -> Drained:
    return await _sample(bench, "incident", INCIDENT_SCORING, 1, k)


async def scale_out_sample(bench: Bench, k: int) -> Drained:
    return await _sample(bench, "scale-out x2", SCORING, 2, k)
