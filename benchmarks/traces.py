"""Case 7: the worker with tracing on against tracing off, in one run.

Two kinds of worker sample drain the same number of messages at zero latency, interleaved
(off, on, off, on, ...) so drift of the machine falls on both alike:

* off: no `OTEL_*` variable asks for spans (`OTEL_SDK_DISABLED=true` besides, so a variable
  the harness inherited cannot turn them on): the SDK is not even imported;
* on: every span sampled (`OTEL_TRACES_SAMPLER=always_on`) and exported over OTLP/HTTP with
  the SDK's default batching to a receiver in this process (`tests/support/otlp.py`), which
  decodes every request as a collector would and counts the spans.

A first delivery that charges makes seven spans (the delivery; its claim, scoring, gateway
call and settle; the HTTP calls to scoring and the gateway). Besides, the off path is timed
on its own, in this process: the tracing calls one delivery makes when tracing is off,
against the worker's CPU per charge.
"""

from __future__ import annotations

import timeit
from dataclasses import dataclass, field
from typing import Any

from tests.support.otlp import OtlpReceiver

from benchmarks.bench import Bench
from benchmarks.drain import Drained, Workers
from benchmarks.stats import Summary, median
from benchmarks.throughput import zero_latency_plan
from charge_worker import logs, tracing

# process; charge.claim, .score, .gateway, .settle; the HTTP client spans of the last two
SPANS_PER_CHARGE = 7
OFF = {"OTEL_SDK_DISABLED": "true"}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
HOOK_CALLS = 200_000


def on_env(receiver: OtlpReceiver) -> dict[str, str]:
    """Every span, exported over OTLP/HTTP to `receiver` with the SDK's default batching."""
    return {
        "OTEL_SDK_DISABLED": "false",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SERVICE_NAME": "charge-worker-bench",
    }


@dataclass
class TracingCost:
    """The samples of both kinds, the spans each traced sample exported, the off path's cost."""

    off: list[Drained] = field(default_factory=list)
    on: list[Drained] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    off_hooks_ns: float = 0.0  # the tracing calls of one delivery, tracing off

    def _summary(self, samples: list[Drained], cpu: bool) -> Summary:
        return Summary.of([s.cpu_us_per_charge() if cpu else s.rate for s in samples])

    def lines(self) -> list[str]:
        """The case's table, the on/off ratios, and the off path's share."""
        if not self.off or not self.on:
            return []
        lines = ["", "Tracing: the worker with tracing on (every span exported) and off", ""]
        for name, samples in (("7 tracing off", self.off), ("7 tracing on", self.on)):
            rate, cpu = self._summary(samples, cpu=False), self._summary(samples, cpu=True)
            lines.append(
                f"{name:<22} {len(samples):>2} {samples[0].messages:>8,}"
                f" {_fmt(rate):>18} {_fmt(cpu):>24}"
            )
        per_charge = [n / s.acked for n, s in zip(self.spans, self.on, strict=True) if s.acked]
        off_cpu = median([s.cpu_us_per_charge() for s in self.off])
        lines += [
            "",
            f"  on / off throughput            {self.ratio(cpu=False):6.2f}"
            f"   samples: {_pairs(self.pairwise(cpu=False))}",
            f"  on / off CPU per charge        {self.ratio(cpu=True):6.2f}"
            f"   samples: {_pairs(self.pairwise(cpu=True))}",
            f"  spans received per charge, on  {median(per_charge):6.1f}"
            f"   ({SPANS_PER_CHARGE} made; fewer: the SDK's queue dropped some)",
            f"  tracing off, its calls per delivery: {self.off_hooks_ns / 1000:.2f} us"
            f" = {100 * self.off_hooks_ns / 1000 / off_cpu:.3f} % of the worker's"
            f" {off_cpu:,.0f} us CPU per charge",
        ]
        return lines

    def ratio(self, *, cpu: bool) -> float:
        """On against off, from the medians."""
        on, off = self._summary(self.on, cpu).median, self._summary(self.off, cpu).median
        return on / off if off else float("nan")

    def pairwise(self, *, cpu: bool) -> list[float]:
        """Sample k on against sample k off."""
        pairs = zip(self.on, self.off, strict=True)
        if cpu:
            return [on.cpu_us_per_charge() / off.cpu_us_per_charge() for on, off in pairs]
        return [on.rate / off.rate for on, off in pairs]

    def as_json(self) -> dict[str, Any]:
        return {
            "off": [s.as_json() for s in self.off],
            "on": [s.as_json() for s in self.on],
            "spans_received": self.spans,
            "off_hooks_ns": self.off_hooks_ns,
            "on_off_throughput": self.ratio(cpu=False),
            "on_off_cpu_per_charge": self.ratio(cpu=True),
        }


def _fmt(summary: Summary) -> str:
    return f"{summary.median:,.0f} ({summary.minimum:,.0f}-{summary.maximum:,.0f})"


def _pairs(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


async def tracing_case(bench: Bench) -> TracingCost:
    """`repeats` samples of each kind, interleaved; then the off path timed alone."""
    cost = TracingCost()
    repeats = bench.sizes.repeats
    with OtlpReceiver() as receiver:
        for k in range(1, repeats + 1):
            cost.off.append(await _sample(bench, f"tracing off {k}/{repeats}", OFF))
            before = len(receiver.spans())
            on = await _sample(bench, f"tracing on {k}/{repeats}", on_env(receiver))
            cost.on.append(on)
            cost.spans.append(len(receiver.spans()) - before)
            bench.say(f"tracing on {k}/{repeats}: {cost.spans[-1]:,} spans received")
    cost.off_hooks_ns = off_hooks_ns()
    bench.say(f"tracing off: its calls cost {cost.off_hooks_ns:,.0f} ns per delivery")
    return cost


async def _sample(bench: Bench, label: str, env: dict[str, str]) -> Drained:
    database_url = await bench.stack.new_database()
    settings = bench.settings(database_url)
    plan = zero_latency_plan(bench, bench.sizes.throughput_messages)
    log_dir = bench.log_dir / label.split("/", maxsplit=1)[0].replace(" ", "-")
    log_dir.mkdir(exist_ok=True)
    return await bench.sample(label, plan, settings, Workers(settings, log_dir, env=env))


def off_hooks_ns() -> float:
    """What the tracing calls of one delivery cost with tracing off, in ns: the ones the
    consumer, the pipeline, scoring and the delivery's log line make (the same functions,
    called as they are)."""
    assert not tracing.enabled(), "the harness itself must not trace"

    def delivery() -> None:
        attributes = {"a": 1} if tracing.enabled() else None
        with tracing.continued("process charges.due", TRACEPARENT, attributes) as span:
            with tracing.span("charge.claim"):
                pass
            with tracing.span("charge.score") as score:
                score.set_attribute("charge_worker.scoring", "approve")
            with tracing.span("charge.gateway"):
                pass
            with tracing.span("charge.settle"):
                pass
            logs.add_trace_ids(None, "info", {"event": "charge.settled"})
            if span.is_recording():
                span.set_attributes({})

    return timeit.timeit(delivery, number=HOOK_CALLS) / HOOK_CALLS * 1e9
