"""The printed table, the ratios against the targets, and the JSON record."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.drain import Drained
from benchmarks.latency_bound import INCIDENT_SCORING, SCORING, bound, mean_latency_s
from benchmarks.memory import MemoryResult
from benchmarks.month_start import MonthStart
from benchmarks.sliced import TURN_S, Sliced
from benchmarks.stats import Summary, Target, against_moments, median, ratio

MIB = 1024 * 1024  # RSS is reported in binary megabytes
GROUPS = ("consumer", "postgres", "gateway sim", "scoring sim", "nats-server", "harness")

TARGETS = {
    "throughput": Target("worker / bare throughput", ">=", 0.85),
    "cpu": Target("worker / bare CPU per charge", "<=", 1.25),
    # case 2b: the same targets with CHARGE_WORKER_VERIFY_SUBSCRIPTION=match
    "throughput_verified": Target("worker+check / bare throughput", ">=", 0.85),
    "cpu_verified": Target("worker+check / bare CPU/charge", "<=", 1.25),
    # case 2s: the same targets, the two pipelines taking turns of 1 s (benchmarks/sliced.py)
    "throughput_sliced": Target("worker / bare throughput, turns", ">=", 0.85),
    "cpu_sliced": Target("worker / bare CPU/charge, turns", "<=", 1.25),
    "little": Target("latency-bound / Little's law", ">=", 0.9),
    "incident": Target("incident / latency-bound", ">=", 0.8),
    "scale_out": Target("2 processes / 1 process", ">=", 1.8),
    "rss": Target("RSS growth 10k -> last step", "<", 0.10),
}


@dataclass
class Results:
    concurrency: int
    bare: list[Drained] = field(default_factory=list)
    worker: list[Drained] = field(default_factory=list)
    worker_verified: list[Drained] = field(default_factory=list)  # subscription check on
    worker_no_outbox: list[Drained] = field(default_factory=list)  # outbox triggers off
    bare_latency_bound: list[Drained] = field(default_factory=list)
    latency_bound: list[Drained] = field(default_factory=list)
    incident: list[Drained] = field(default_factory=list)
    scale_out: list[Drained] = field(default_factory=list)
    memory: MemoryResult | None = None
    month_start: MonthStart | None = None
    sliced: Sliced | None = None  # case 2s


@dataclass(frozen=True)
class Ratio:
    key: str
    value: float  # from the medians
    pairwise: list[float]  # sample k of one case against sample k of the other
    note: str = ""

    @property
    def target(self) -> Target:
        return TARGETS[self.key]

    def as_json(self) -> dict[str, Any]:
        target = self.target
        return {
            "name": target.name,
            "value": self.value,
            "pairwise": self.pairwise,
            "target": target.wanted,
            "met": target.met(self.value),
            "note": self.note,
        }


def _summary(samples: Sequence[Drained], figure: Callable[[Drained], float]) -> Summary | None:
    values = [figure(sample) for sample in samples]
    values = [value for value in values if not math.isnan(value)]
    return Summary.of(values) if values else None


def _fmt(summary: Summary | None, spec: str = ",.0f", scale: float = 1.0) -> str:
    if summary is None:
        return "-"
    mid, low, high = (summary.median / scale, summary.minimum / scale, summary.maximum / scale)
    if summary.n == 1:
        return format(mid, spec)
    return f"{mid:{spec}} ({low:{spec}}-{high:{spec}})"


def _rate(sample: Drained) -> float:
    return sample.rate


def _cpu(sample: Drained) -> float:
    return sample.cpu_us_per_charge()


def _cpu_all(sample: Drained) -> float:
    return sum(sample.cpu_us_per_charge(group) for group in GROUPS)


def _pairwise(
    top: Sequence[Drained], bottom: Sequence[Drained], figure: Callable[[Drained], float]
) -> list[float]:
    return [ratio(figure(a), figure(b)) for a, b in zip(top, bottom, strict=False)]


def _bracketed(
    top: Sequence[Drained], bottom: Sequence[Drained], figure: Callable[[Drained], float]
) -> list[float]:
    """Each sample of `top` against `bottom`'s figure at its moment: interpolated between
    the `bottom` samples drained just before and just after it (`stats.against_moments`), so
    the machine's drift over the run does not fall on one case."""
    return against_moments(
        [(sample.midpoint, figure(sample)) for sample in top],
        [(sample.midpoint, figure(sample)) for sample in bottom],
    )


def mean_slot_s(samples: Sequence[Drained]) -> float:
    """Mean delivery-to-ack time over every message of the samples (server's view)."""
    times = [t for sample in samples for t in sample.service_s]
    return sum(times) / len(times) if times else math.nan


def _worker_ratios(
    bare: Sequence[Drained],
    worker: Sequence[Drained],
    keys: tuple[str, str],
    *,
    check_off: Sequence[Drained] = (),
) -> list[Ratio]:
    """Throughput and CPU per charge of `worker` against `bare`: the median over the worker
    samples of each against the bare samples around it (`_bracketed`); with `check_off`
    (case 2b), the notes give the check's own cost against case 2 too."""
    rates = _bracketed(worker, bare, _rate)
    cpus = _bracketed(worker, bare, _cpu)
    worker_rate = median([_rate(s) for s in worker])
    worker_cpu = median([_cpu(s) for s in worker])
    bare_all = median([_cpu_all(s) for s in bare])
    worker_all = median([_cpu_all(s) for s in worker])
    rate_note = cpu_extra = ""
    if check_off:
        off_rate = median([_rate(s) for s in check_off])
        off_cpu = median([_cpu(s) for s in check_off])
        off_all = median([_cpu_all(s) for s in check_off])
        rate_note = f"subscription check on / off (case 2b / 2): {ratio(worker_rate, off_rate):.2f}"
        cpu_extra = (
            f"; check on / off: consumer {ratio(worker_cpu, off_cpu):.2f}, all processes "
            f"{ratio(worker_all, off_all):.2f}, PostgreSQL "
            f"{ratio(_median_cpu(worker, 'postgres'), _median_cpu(check_off, 'postgres')):.2f}"
        )
    return [
        Ratio(keys[0], median(rates), rates, rate_note),
        Ratio(
            keys[1],
            median(cpus),
            cpus,
            f"consumer process only; all processes (PostgreSQL, simulators, nats-server, "
            f"harness too): worker {worker_all:,.0f} vs bare {bare_all:,.0f} us/charge = "
            f"{ratio(worker_all, bare_all):.2f}{cpu_extra}",
        ),
    ]


def _sliced_ratios(sliced: Sliced) -> list[Ratio]:
    """Case 2s: the median over the worker's turns of each against the bare pipeline's
    turns around it."""
    rates, cpus = sliced.against_bare("rate"), sliced.against_bare("consumer")
    if not rates:
        return []
    turns = len(rates)
    every, postgres = sliced.against_bare("all"), sliced.against_bare("postgres")
    return [
        Ratio(
            "throughput_sliced",
            median(rates),
            rates,
            f"{turns} turns of {TURN_S:g} s each, the first left out; charges/s alone: bare "
            f"{median([t.rate for t in sliced.measured('bare')]):,.0f}, worker "
            f"{median([t.rate for t in sliced.measured('worker')]):,.0f}",
        ),
        Ratio(
            "cpu_sliced",
            median(cpus),
            cpus,
            f"consumer process only; all processes {median(every):.2f}, PostgreSQL "
            f"{median(postgres):.2f}",
        ),
    ]


def _median_cpu(samples: Sequence[Drained], group: str) -> float:
    return median([s.cpu_us_per_charge(group) for s in samples])


def ratios(results: Results) -> list[Ratio]:
    out: list[Ratio] = []
    conc = results.concurrency
    if results.bare and results.worker:
        out += _worker_ratios(results.bare, results.worker, ("throughput", "cpu"))
    if results.bare and results.worker_verified:
        out += _worker_ratios(
            results.bare,
            results.worker_verified,
            ("throughput_verified", "cpu_verified"),
            check_off=results.worker,
        )
    if results.sliced is not None:
        out += _sliced_ratios(results.sliced)
    if results.latency_bound:
        little = bound(conc, SCORING)
        rates = [_rate(s) for s in results.latency_bound]
        slot = mean_slot_s(results.latency_bound)
        note = (
            f"bound {little:.1f}/s = {conc} slots / {mean_latency_s(SCORING) * 1e3:.0f} ms "
            f"mean dependency latency; worker's mean slot time {slot * 1e3:.0f} ms"
        )
        if results.bare_latency_bound:
            bare = median([_rate(s) for s in results.bare_latency_bound])
            note += (
                f"; the bare pipeline, same case: {ratio(bare, little):.2f} of the bound, "
                f"slot time {mean_slot_s(results.bare_latency_bound) * 1e3:.0f} ms "
                f"(worker / bare {ratio(median(rates), bare):.2f})"
            )
        out.append(Ratio("little", ratio(median(rates), little), [r / little for r in rates], note))
    if results.latency_bound and results.incident:
        own = bound(conc, INCIDENT_SCORING)
        incident = median([_rate(s) for s in results.incident])
        out.append(
            Ratio(
                "incident",
                ratio(incident, median([_rate(s) for s in results.latency_bound])),
                _pairwise(results.incident, results.latency_bound, _rate),
                f"the incident's own Little bound is {own:.1f}/s (mean latency "
                f"{mean_latency_s(INCIDENT_SCORING) * 1e3:.0f} ms with the 2 s deadline): "
                f"ceiling for this ratio {ratio(own, bound(conc, SCORING)):.2f}; measured "
                f"incident / own bound {ratio(incident, own):.2f}; mean slot time "
                f"{mean_slot_s(results.incident) * 1e3:.0f} ms",
            )
        )
    if results.latency_bound and results.scale_out:
        out.append(
            Ratio(
                "scale_out",
                ratio(
                    median([_rate(s) for s in results.scale_out]),
                    median([_rate(s) for s in results.latency_bound]),
                ),
                _pairwise(results.scale_out, results.latency_bound, _rate),
                f"bound for 2 processes {bound(conc, SCORING, 2):.1f}/s",
            )
        )
    if results.memory is not None:
        mem = results.memory
        (n0, r0), (n1, r1) = mem.at_first_step, mem.at_last_step
        out.append(
            Ratio(
                "rss",
                mem.growth,
                [],
                f"RSS {r0 / MIB:.1f} MiB after {n0:,} -> {r1 / MIB:.1f} MiB after {n1:,} charges"
                + ("" if mem.plan.messages >= mem.plan.goal else f" ({mem.plan.why})"),
            )
        )
    return out


@dataclass(frozen=True)
class OutboxCost:
    """What the outbox of outcome events costs per charge: case 2 minus case 2c, pair by pair
    (sample k of each, taken one after the other), in CPU µs per charge."""

    consumer: list[float]
    postgres: list[float]
    nats: list[float]
    all: list[float]
    share: list[float]  # of the worker's CPU per charge, all processes
    rate: list[float]  # throughput, with the outbox / without

    @classmethod
    def of(cls, worker: Sequence[Drained], no_outbox: Sequence[Drained]) -> OutboxCost:
        pairs = list(zip(worker, no_outbox, strict=False))

        def extra(figure: Callable[[Drained], float]) -> list[float]:
            return [figure(w) - figure(n) for w, n in pairs]

        return cls(
            consumer=extra(_cpu),
            postgres=extra(lambda s: s.cpu_us_per_charge("postgres")),
            nats=extra(lambda s: s.cpu_us_per_charge("nats-server")),
            all=extra(_cpu_all),
            share=[ratio(_cpu_all(w) - _cpu_all(n), _cpu_all(w)) for w, n in pairs],
            rate=[ratio(_rate(w), _rate(n)) for w, n in pairs],
        )

    def as_json(self) -> dict[str, Any]:
        return {
            name: {"median": median(values), "pairwise": values}
            for name, values in dataclasses.asdict(self).items()
        }


def outbox_cost(results: Results) -> OutboxCost | None:
    if not (results.worker and results.worker_no_outbox):
        return None
    return OutboxCost.of(results.worker, results.worker_no_outbox)


def _latency(samples: Sequence[Drained], key: str) -> Summary | None:
    values = [s.latency[key] for s in samples if key in s.latency]
    return Summary.of(values) if values else None


def table(results: Results) -> list[str]:
    lines = [
        "Results: median (min-max) over the samples; rates are steady (10 %-90 % of the drain);",
        "'other': cores busy with processes outside the benchmark during the drains (median)",
        "",
        f"{'case':<22} {'n':>2} {'messages':>8} {'charges/s':>18} {'consumer CPU us/charge':>24}"
        f" {'other':>5}  notes",
    ]
    conc = results.concurrency
    cases: list[tuple[str, list[Drained], str]] = [
        ("1 bare pipeline", results.bare, "zero-latency simulators; the in-run ceiling"),
        ("2 worker", results.worker, ""),
        (
            "2b worker, sub. check",
            results.worker_verified,
            "VERIFY_SUBSCRIPTION=match: every claim inserts through the subscriptions check",
        ),
        (
            "2c worker, no outbox",
            results.worker_no_outbox,
            "the ledger's outbox triggers disabled: no outcome event written or published",
        ),
        ("3 latency-bound bare", results.bare_latency_bound, "the in-run ceiling for case 3"),
        ("3 latency-bound", results.latency_bound, f"Little bound {bound(conc, SCORING):.1f}/s"),
        ("4 incident", results.incident, f"own Little bound {bound(conc, INCIDENT_SCORING):.1f}/s"),
        ("5 scale-out x2", results.scale_out, f"Little bound {bound(conc, SCORING, 2):.1f}/s"),
    ]
    for name, samples, base_note in cases:
        if not samples:
            continue
        note = base_note
        if name == "2 worker":
            p50, p99 = _latency(samples, "p50_s"), _latency(samples, "p99_s")
            peak = _summary(samples, lambda s: float(max(s.peak_rss)))
            note = (
                f"publish->ack at 50 % load: p50 {_fmt(p50, '.1f', 1e-3)} ms, "
                f"p99 {_fmt(p99, '.1f', 1e-3)} ms; peak RSS {_fmt(peak, '.0f', MIB)} MiB"
            )
        if name == "4 incident":
            failed = _summary(samples, lambda s: s.worker_metrics.get("scoring_failed", 0.0))
            note += f"; scoring cut at 2 s: {_fmt(failed)} per run"
        lines.append(
            f"{name:<22} {len(samples):>2} {samples[0].messages:>8,} "
            f"{_fmt(_summary(samples, _rate)):>18} {_fmt(_summary(samples, _cpu)):>24} "
            f"{median([s.other_cores for s in samples]):>5.2f}  {note}"
        )
    cost = outbox_cost(results)
    if cost is not None:
        lines.append(_outbox_line(cost))
    if results.memory is not None:
        mem = results.memory
        d = mem.drained
        lines.append(
            f"{'6 memory':<22} {1:>2} {d.messages:>8,} {d.rate:>18,.0f} "
            f"{d.cpu_us_per_charge():>24,.0f} {d.other_cores:>5.2f}  RSS "
            + ", ".join(f"{n // 1000}k: {rss / MIB:.1f} MiB" for n, (rss,) in _steps(mem))
        )
    return lines


def _pairs(values: Sequence[float], spec: str) -> str:
    return ", ".join(format(value, spec) for value in values)


def _outbox_line(cost: OutboxCost) -> str:
    """The outbox's own row: case 2 minus case 2c, medians of the pairs (the pairs)."""
    consumer = f"{median(cost.consumer):+,.0f}"
    return (
        f"{'outbox (2 - 2c)':<22} {len(cost.all):>2} {'':>8} "
        f"{f'x {median(cost.rate):.2f}':>18} {consumer:>24} {'':>5}  "
        f"all processes {median(cost.all):+,.0f} us/charge ({_pairs(cost.all, '+,.0f')}), "
        f"{median(cost.share):.0%} of the worker's ({_pairs(cost.share, '.0%')}); "
        f"PostgreSQL {median(cost.postgres):+,.0f}, nats-server {median(cost.nats):+,.0f}; "
        f"consumer pairs {_pairs(cost.consumer, '+,.0f')}"
    )


def _steps(mem: MemoryResult) -> list[tuple[int, tuple[int]]]:
    return [(acked, (rss[0],)) for acked, rss in mem.drained.rss_by_acked]


def cpu_split(results: Results) -> list[str]:
    """CPU µs per charge of every process group, bare vs worker (and cases 2b and 2c) at zero
    latency; `outbox`, with case 2c, is case 2 minus case 2c, the median of the pairs."""
    lines = ["", "CPU per charge by process, zero latency (median us/charge)", ""]
    names = ["bare", "worker"]
    cases = [results.bare, results.worker]
    if not all(cases):
        return []
    if results.worker_verified:
        names.append("worker+check")
        cases.append(results.worker_verified)
    if results.worker_no_outbox:
        names.append("no outbox")
        cases.append(results.worker_no_outbox)
    outbox = bool(results.worker_no_outbox)
    lines.append(
        f"{'process':<14}"
        + "".join(f"{name:>13}" for name in names)
        + (f"{'outbox':>13}" if outbox else "")
    )
    totals = [0.0] * len(cases)
    for group in GROUPS:
        values = [median([s.cpu_us_per_charge(group) for s in samples]) for samples in cases]
        totals = [t + v for t, v in zip(totals, values, strict=True)]
        extra = ""
        if outbox:  # worker minus no outbox, the median of the pairs
            pairs = zip(results.worker, results.worker_no_outbox, strict=False)
            diff = median(
                [a.cpu_us_per_charge(group) - b.cpu_us_per_charge(group) for a, b in pairs]
            )
            extra = f"{diff:>+13,.0f}"
        lines.append(f"{group:<14}" + "".join(f"{v:>13,.0f}" for v in values) + extra)
    cost = outbox_cost(results)
    lines.append(
        f"{'all':<14}"
        + "".join(f"{v:>13,.0f}" for v in totals)
        + (f"{median(cost.all):>+13,.0f}" if cost is not None else "")
    )
    busy = [median([_cpu_all(s) * s.acked / 1e6 / s.seconds for s in samples]) for samples in cases]
    lines.append(f"{'cores busy':<14}" + "".join(f"{v:>13.2f}" for v in busy))
    other = [median([s.other_cores for s in samples]) for samples in cases]
    lines.append(f"{'other load':<14}" + "".join(f"{v:>13.2f}" for v in other))
    return lines


def ledger_lines(results: Results) -> list[str]:
    """The ledger's rows by status and its transactions per message, zero-latency cases:
    what each pipeline writes per charge, counted by PostgreSQL."""
    cases = [
        ("bare", results.bare),
        ("worker", results.worker),
        ("worker+check", results.worker_verified),
        ("no outbox", results.worker_no_outbox),
    ]
    cases = [(name, samples) for name, samples in cases if samples]
    if not cases:
        return []
    lines = [
        "",
        "Ledger, zero latency: rows by status (sample 1); transactions committed in the "
        "sample's database per message (median, range; setup and the paced phase included)",
        "",
    ]
    for name, samples in cases:
        rows = ", ".join(f"{status} {n:,}" for status, n in sorted(samples[0].statuses.items()))
        per = _summary(samples, lambda s: s.transactions_per_charge)
        lines.append(f"  {name:<14} {_fmt(per, '.3f'):>22}   {rows}")
    return lines


def _all_samples(results: Results) -> list[tuple[str, Drained]]:
    named: list[tuple[str, Drained]] = []
    for name in (
        "bare",
        "worker",
        "worker_verified",
        "worker_no_outbox",
        "bare_latency_bound",
        "latency_bound",
        "incident",
        "scale_out",
    ):
        named += [(f"{name} {k}", s) for k, s in enumerate(getattr(results, name), start=1)]
    if results.memory is not None:
        named.append(("memory", results.memory.drained))
    return named


def anomalies(results: Results) -> list[str]:
    """Anything that would make a sample's figures mean something else than intended."""
    found = []
    for name, sample in _all_samples(results):
        if name == "memory" and sample.acked < sample.messages:
            continue  # stopped by its time budget, as its own line says
        expected = sample.published
        charged = sample.sims.get("gateway", {}).get("charges")
        problems = []
        if sample.acked < sample.messages:
            problems.append(f"only {sample.acked} of {sample.messages} acked in time")
        if sample.statuses != (wanted := expected_statuses(sample)):
            problems.append(f"ledger {sample.statuses}, expected {wanted}")
        if charged is not None and charged != expected:
            problems.append(f"gateway made {charged} charges for {expected} messages")
        problems += _event_problems(sample, expected)
        if sample.worker_metrics.get("redeliveries"):
            problems.append(f"{sample.worker_metrics['redeliveries']:.0f} redeliveries")
        if any(code != 0 for code in sample.exit_codes):
            problems.append(f"exit codes {sample.exit_codes}")
        if problems:
            found.append(f"{name}: " + "; ".join(problems))
    return found


def declined_status(sample: Drained) -> str:
    """What a declined charge's row says at the end: `retry_scheduled` from the worker (a
    soft decline on try 1, its default schedule), `declined` from the bare pipeline (no
    retries), the one whose events are `direct`."""
    return "declined" if sample.events == "direct" else "retry_scheduled"


def expected_statuses(sample: Drained) -> dict[str, int]:
    """The ledger's rows by status a clean sample ends with."""
    counts = {
        "succeeded": sample.published - sample.declining,
        declined_status(sample): sample.declining,
    }
    return {status: n for status, n in counts.items() if n}


def _event_problems(sample: Drained, expected: int) -> list[str]:
    """One outcome event per charge in the stream (none with the outbox off); outbox rows
    only from the worker's outbox, one per event."""
    events = 0 if sample.events == "none" else expected
    rows = expected if sample.events == "outbox" else 0
    problems = []
    if sample.outcomes != events:
        problems.append(f"{sample.outcomes} outcome events in the stream, expected {events}")
    if sample.outbox_rows != rows:
        problems.append(f"{sample.outbox_rows} rows in the outbox, expected {rows}")
    return problems


CONTENDED_CORES = 0.2


def contended(results: Results) -> list[str]:
    """Samples during which something outside the benchmark used the CPU noticeably."""
    return [
        f"{name}: {sample.other_cores:.2f} cores busy elsewhere, "
        f"{sample.steal_cores:.2f} stolen by the hypervisor"
        for name, sample in _all_samples(results)
        if sample.other_cores > CONTENDED_CORES or sample.steal_cores > CONTENDED_CORES / 4
    ]


def check_lines(results: Results) -> list[str]:
    busy = contended(results)
    noisy = (
        [f"CONTENDED: {len(busy)} sample(s) ran while other processes used the CPU:"]
        + [f"  {line}" for line in busy]
        if busy
        else ["Quiet machine: no sample saw more than 0.2 cores used outside the benchmark."]
    )
    return [*_check_lines(results), *noisy]


def _check_lines(results: Results) -> list[str]:
    found = anomalies(results)
    if not found:
        return [
            "",
            "Checks: in every sample each message was acked once, sent once to the gateway, "
            "'succeeded' in the ledger or, its card declined, 'retry_scheduled' (the worker) "
            "or 'declined' (the bare pipeline); one outcome event each; no redelivery; every "
            "consumer exited 0.",
        ]
    return ["", "CHECKS FAILED (figures below may not mean what they say):"] + [
        f"  {line}" for line in found
    ]


def ratio_lines(found: list[Ratio]) -> list[str]:
    lines = ["", "Ratios against the targets", ""]
    for item in found:
        target = item.target
        pairs = ", ".join(f"{p:.2f}" for p in item.pairwise)
        lines.append(
            f"  {target.name:<32} {item.value:6.2f}   target {target.wanted:<7} "
            f"{'NOT MEASURED' if math.isnan(item.value) else target.verdict(item.value):<6}"
            + (f"  samples: {pairs}" if pairs else "")
        )
        if item.note:
            lines.append(f"  {'':<32} {item.note}")
    return lines
