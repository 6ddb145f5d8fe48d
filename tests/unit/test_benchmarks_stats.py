"""The benchmark harness's pure helpers: statistics, Little's law, targets, sizing."""

from __future__ import annotations

import datetime as dt
import math
import random

import pytest
from benchmarks.drain import Drained, Events
from benchmarks.load import customer_id, declining, due_body, parse_timestamp
from benchmarks.memory import plan_size
from benchmarks.processes import OTHER, STEAL
from benchmarks.report import (
    Results,
    anomalies,
    cpu_split,
    ledger_lines,
    outbox_cost,
    ratios,
    table,
)
from benchmarks.sliced import Sliced, Turn
from benchmarks.stats import (
    Summary,
    Target,
    capped_lognormal_mean,
    capped_uniform_mean,
    crossing_time,
    growth,
    interpolated,
    littles_law_bound,
    median,
    model_mean,
    model_quantile,
    per_item_us,
    percentile,
    ratio,
    steady_rate,
)

from charge_worker.declines import GENERIC_DECLINE, decline_class
from charge_worker.sandbox.gateway.cards import decline_code
from charge_worker.sandbox.latency import LatencyModel


def test_median_of_odd_and_even_counts() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_percentile_interpolates_between_ranks() -> None:
    samples = [float(n) for n in range(1, 101)]  # 1..100
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 100) == 100.0
    assert percentile(samples, 50) == pytest.approx(50.5)
    assert percentile(samples, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("bad", [-1.0, 100.5])
def test_percentile_rejects_out_of_range(bad: float) -> None:
    with pytest.raises(ValueError, match=r"not in 0\.\.100"):
        percentile([1.0], bad)


def test_percentile_and_summary_need_samples() -> None:
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)
    with pytest.raises(ValueError, match="no samples"):
        Summary.of([])


def test_summary() -> None:
    summary = Summary.of([10.0, 30.0, 20.0])
    assert (summary.median, summary.minimum, summary.maximum, summary.n) == (20.0, 10.0, 30.0, 3)
    assert summary.spread == pytest.approx(1.0)


def test_ratio_growth_and_per_item() -> None:
    assert ratio(3.0, 4.0) == 0.75
    assert math.isnan(ratio(1.0, 0.0))
    assert growth(100.0, 108.0) == pytest.approx(0.08)
    assert per_item_us(2.5, 1000) == pytest.approx(2500.0)


def test_littles_law_bound() -> None:
    assert littles_law_bound(16, 0.2) == pytest.approx(80.0)
    with pytest.raises(ValueError, match="concurrency"):
        littles_law_bound(0, 0.2)
    with pytest.raises(ValueError, match="latency"):
        littles_law_bound(16, 0.0)


def _monte_carlo(model: LatencyModel, cap_s: float | None, n: int = 60_000) -> float:
    rng = random.Random(42)
    draws = (model.sample(rng) for _ in range(n))
    return sum(d if cap_s is None else min(d, cap_s) for d in draws) / n


@pytest.mark.parametrize(
    ("model", "cap_s"),
    [
        (LatencyModel.fixed(0.15), None),
        (LatencyModel.fixed(0.15), 0.1),
        (LatencyModel.quantiles(0.05, 0.15), None),
        (LatencyModel.quantiles(0.05, 1.2), 2.0),
        (LatencyModel.quantiles(0.05, 1.2, slow_fraction=0.02, slow_min_s=6, slow_max_s=8), 2.0),
        (LatencyModel.quantiles(0.05, 1.2, slow_fraction=0.02, slow_min_s=6, slow_max_s=8), 7.0),
        (LatencyModel.quantiles(0.05, 1.2, slow_fraction=0.02, slow_min_s=6, slow_max_s=8), None),
    ],
)
def test_model_mean_agrees_with_the_simulators_sampling(
    model: LatencyModel, cap_s: float | None
) -> None:
    assert model_mean(model, cap_s) == pytest.approx(_monte_carlo(model, cap_s), rel=0.03)


def test_capped_means_at_their_edges() -> None:
    assert capped_lognormal_mean(0.05, 0.05) == pytest.approx(0.05)
    assert capped_lognormal_mean(0.05, 0.05, cap_s=0.01) == pytest.approx(0.01)
    assert capped_lognormal_mean(0.05, 1.0, cap_s=0.0) == 0.0
    assert capped_uniform_mean(6.0, 8.0) == 7.0
    assert capped_uniform_mean(6.0, 8.0, cap_s=2.0) == 2.0
    assert capped_uniform_mean(6.0, 8.0, cap_s=9.0) == 7.0
    # half the draws are cut at 7 s: 0.5 * 6.5 + 0.5 * 7
    assert capped_uniform_mean(6.0, 8.0, cap_s=7.0) == pytest.approx(6.75)


def test_model_quantile() -> None:
    body = LatencyModel.quantiles(0.05, 1.2)
    assert model_quantile(body, 0.5) == pytest.approx(0.05, rel=1e-6)
    assert model_quantile(body, 0.99) == pytest.approx(1.2, rel=1e-6)
    assert model_quantile(LatencyModel.fixed(0.15), 0.99) == pytest.approx(0.15)
    incident = LatencyModel.quantiles(0.05, 1.2, slow_fraction=0.02, slow_min_s=6, slow_max_s=8)
    # the 2 % tail at 6-8 s holds the p99: the incident's "scoring p99 7 s"
    assert model_quantile(incident, 0.99) == pytest.approx(7.0, abs=0.05)
    with pytest.raises(ValueError, match="q must be"):
        model_quantile(body, 1.0)


@pytest.mark.parametrize(
    ("op", "threshold", "value", "met"),
    [
        (">=", 0.85, 0.85, True),
        (">=", 0.85, 0.84, False),
        ("<=", 1.25, 1.25, True),
        ("<=", 1.25, 1.3, False),
        ("<", 0.10, 0.10, False),
        ("<", 0.10, 0.02, True),
        (">=", 0.85, math.nan, False),
    ],
)
def test_target(op: str, threshold: float, value: float, met: bool) -> None:
    target = Target("t", op, threshold)  # type: ignore[arg-type]
    assert target.met(value) is met
    assert target.verdict(value) == ("MET" if met else "MISSED")
    assert target.wanted == f"{op} {threshold:g}"


def test_crossing_time_interpolates_between_polls() -> None:
    series = [(0.0, 0), (1.0, 0), (2.0, 100), (3.0, 200)]
    assert crossing_time(series, 50) == pytest.approx(1.5)
    assert crossing_time(series, 200) == 3.0
    with pytest.raises(ValueError, match="never reached"):
        crossing_time(series, 201)


def test_steady_rate_leaves_out_ramp_up_and_tail() -> None:
    # a second of nothing (first fetch), then 100/s, then a slow tail
    series = [(0.0, 0), (1.0, 0), *((1.0 + t / 10, 10 * t) for t in range(1, 91)), (12.0, 1000)]
    assert steady_rate(series, 1000) == pytest.approx(100.0)


def test_parse_timestamp_keeps_nanoseconds_to_the_microsecond() -> None:
    assert parse_timestamp("1970-01-01T00:00:01.5Z") == pytest.approx(1.5)
    expected = dt.datetime(2026, 11, 29, 23, 26, 4, 608433, tzinfo=dt.UTC).timestamp()
    assert parse_timestamp("2026-11-29T23:26:04.608432879Z") == pytest.approx(expected, abs=1e-6)
    assert parse_timestamp("1970-01-01T00:00:02Z") == 2.0


def test_memory_plan_size() -> None:
    fits = plan_size(100_000, budget_s=600.0, rate_per_s=300.0)
    assert fits.messages == 100_000
    assert "fit" in fits.why
    cut = plan_size(100_000, budget_s=200.0, rate_per_s=300.0)  # 0.85 * 60,000 -> 50,000
    assert cut.messages == 50_000
    assert "measuring 50,000" in cut.why
    assert plan_size(100_000, budget_s=10.0, rate_per_s=300.0).messages == 20_000


def _drained(
    seconds: float,
    consumer_s: float,
    postgres_s: float,
    *,
    events: Events = "outbox",
    outcomes: int | None = None,
    outbox_rows: int | None = None,
    statuses: dict[str, int] | None = None,
    declined: int = 0,
    started_at: float = 0.0,
) -> Drained:
    """A clean sample of 100 charges: one outcome event each, as `events` makes them; of
    them `declined` declined and settled as the pipeline settles a soft decline."""
    soft = "declined" if events == "direct" else "retry_scheduled"
    clean = {"succeeded": 100 - declined} | ({soft: declined} if declined else {})
    return Drained(
        messages=100,
        acked=100,
        seconds=seconds,
        progress=[(0.0, 0), (seconds, 100)],
        cpu_s={"consumer": consumer_s, "postgres": postgres_s},
        peak_rss=[1],
        rss=[1],
        statuses=clean if statuses is None else statuses,
        declining=declined,
        transactions=210,
        events=events,
        outcomes=(0 if events == "none" else 100) if outcomes is None else outcomes,
        outbox_rows=(100 if events == "outbox" else 0) if outbox_rows is None else outbox_rows,
        started_at=started_at,
    )


def test_a_figure_is_interpolated_between_the_measurements_around_a_moment() -> None:
    series = [(30.0, 300.0), (10.0, 100.0), (20.0, 150.0)]
    assert interpolated(series, 15.0) == pytest.approx(125.0)
    assert interpolated(series, 25.0) == pytest.approx(225.0)
    assert interpolated(series, 20.0) == pytest.approx(150.0)
    assert interpolated(series, 5.0) == 100.0  # before the first: the first
    assert interpolated(series, 35.0) == 300.0  # after the last: the last
    with pytest.raises(ValueError, match="no measurements"):
        interpolated([], 1.0)


def test_each_worker_sample_is_set_against_the_bare_samples_taken_before_and_after_it() -> None:
    # The machine slows down through the run: the bare pipeline drains 100 charges in 1 s,
    # then 1.5 s, then 2 s. Each worker sample, its drain half-way between two bare ones,
    # runs at 0.8x the bare rate of its moment; set against the bare sample before it
    # alone, it would look slower.
    bare = [
        _drained(seconds, 0.10 * seconds / 1.5, 0.05, events="direct", started_at=at)
        for at, seconds in [(0.0, 1.0), (100.0, 1.5), (200.0, 2.0)]
    ]

    def worker_at(midpoint: float, bare_rate: float) -> Drained:
        seconds = 100 / (0.8 * bare_rate)
        return _drained(seconds, 0.12, 0.06, started_at=midpoint - seconds / 2)

    worker = [
        worker_at((bare[0].midpoint + bare[1].midpoint) / 2, (100 + 100 / 1.5) / 2),
        worker_at((bare[1].midpoint + bare[2].midpoint) / 2, (100 / 1.5 + 50) / 2),
    ]
    found = {item.key: item for item in ratios(Results(concurrency=16, bare=bare, worker=worker))}
    assert found["throughput"].pairwise == pytest.approx([0.8, 0.8])
    assert found["throughput"].value == pytest.approx(0.8)
    assert worker[0].rate / bare[0].rate == pytest.approx(2 / 3)  # the naive pair
    # the CPU per charge is bracketed too: the bare pipeline's 0.067, 0.1, 0.133 ms
    assert found["cpu"].pairwise == pytest.approx([0.12 / (0.25 / 3), 0.12 / (0.35 / 3)])


def test_the_subscription_check_row_is_its_own_pair_of_ratios_against_the_same_bare() -> None:
    results = Results(
        concurrency=16,
        bare=[_drained(1.0, 0.10, 0.05)],
        worker=[_drained(1.25, 0.12, 0.06)],
        worker_verified=[_drained(1.5, 0.13, 0.07)],
    )
    found = {item.key: item for item in ratios(results)}
    assert found["throughput"].value == pytest.approx(0.8)
    assert found["cpu"].value == pytest.approx(1.2)
    assert found["throughput_verified"].value == pytest.approx(1.0 / 1.5)
    assert found["cpu_verified"].value == pytest.approx(1.3)
    assert "check on / off (case 2b / 2): 0.83" in found["throughput_verified"].note
    assert any(line.startswith("2b worker, sub. check") for line in table(results))
    assert "worker+check" in cpu_split(results)[3]
    # without case 2b's samples (a run cut short before any), only case 2's pair
    results.worker_verified = []
    assert [item.key for item in ratios(results)] == ["throughput", "cpu"]


def test_the_outbox_row_is_case_2_minus_case_2c_pair_by_pair() -> None:
    results = Results(
        concurrency=16,
        bare=[_drained(1.0, 0.10, 0.04, events="direct")] * 3,
        worker=[
            _drained(1.25, 0.120, 0.060),
            _drained(1.30, 0.130, 0.070),
            _drained(1.20, 0.110, 0.050),
        ],
        worker_no_outbox=[
            _drained(1.20, 0.115, 0.050, events="none"),
            _drained(1.20, 0.120, 0.050, events="none"),
            _drained(1.20, 0.110, 0.045, events="none"),
        ],
    )
    cost = outbox_cost(results)
    assert cost is not None
    # per charge: consumer +50, +100, +0 us; PostgreSQL +100, +200, +50 us
    assert cost.consumer == pytest.approx([50.0, 100.0, 0.0])
    assert cost.postgres == pytest.approx([100.0, 200.0, 50.0])
    assert cost.all == pytest.approx([150.0, 300.0, 50.0])
    assert cost.share == pytest.approx([150 / 1800, 300 / 2000, 50 / 1600])
    assert cost.rate == pytest.approx([1.20 / 1.25, 1.20 / 1.30, 1.0])
    row = next(line for line in table(results) if line.startswith("outbox (2 - 2c)"))
    assert "+50" in row  # the consumer's median
    assert "all processes +150 us/charge (+150, +300, +50), 8% of the worker's" in row
    split = cpu_split(results)
    assert split[3].split()[-3:] == ["no", "outbox", "outbox"]
    assert split[-3].split()[-1] == "+150"  # all processes, the median of the pairs
    assert ratios(results)[0].key == "throughput"  # the targets stay worker against bare
    assert not anomalies(results)
    results.worker_no_outbox = []
    assert outbox_cost(results) is None
    assert not any(line.startswith("outbox") for line in table(results))


@pytest.mark.parametrize(
    ("events", "outcomes", "outbox_rows", "problem"),
    [
        ("outbox", 99, 100, "99 outcome events in the stream, expected 100"),
        ("outbox", 100, 99, "99 rows in the outbox, expected 100"),
        ("direct", 100, 100, "100 rows in the outbox, expected 0"),  # the triggers fired
        ("none", 1, 0, "1 outcome events in the stream, expected 0"),
        ("none", 0, 100, "100 rows in the outbox, expected 0"),
    ],
)
def test_a_sample_is_checked_for_one_outcome_event_per_charge(
    events: Events, outcomes: int, outbox_rows: int, problem: str
) -> None:
    sample = _drained(1.0, 0.1, 0.05, events=events, outcomes=outcomes, outbox_rows=outbox_rows)
    assert anomalies(Results(concurrency=16, worker=[sample])) == [f"worker 1: {problem}"]


def test_one_customer_in_ten_has_a_card_the_simulator_declines_soft() -> None:
    customers = {customer_id(n, 10) for n in range(1, 10_001)}
    declined = {c for c in customers if decline_code(c) is not None}
    assert len(customers) == 1000
    assert len(declined) == 100
    assert {decline_code(c) for c in declined} == {GENERIC_DECLINE}
    assert decline_class(GENERIC_DECLINE) == "soft"
    assert declining(range(1, 10_001), 10) == 1000
    assert declining(range(1, 10_001), 0) == 0
    assert all(decline_code(customer_id(n)) is None for n in range(1, 1001))
    assert b'"customer_id":"cus_decline_10"' in due_body(10, 10)
    assert b'"customer_id":"cus_bench_10"' in due_body(10)


@pytest.mark.parametrize(
    ("events", "statuses", "problem"),
    [
        ("outbox", {"succeeded": 90, "retry_scheduled": 10}, None),
        ("direct", {"succeeded": 90, "declined": 10}, None),  # the bare pipeline: no retries
        ("none", {"succeeded": 90, "retry_scheduled": 10}, None),
        (
            "outbox",
            {"succeeded": 90, "declined": 10},  # the worker ended a soft decline's period
            "ledger {'succeeded': 90, 'declined': 10}, expected "
            "{'succeeded': 90, 'retry_scheduled': 10}",
        ),
        (
            "outbox",
            {"succeeded": 100},  # a declining card was charged
            "ledger {'succeeded': 100}, expected {'succeeded': 90, 'retry_scheduled': 10}",
        ),
    ],
)
def test_a_sample_with_declines_is_checked_for_its_rows_by_status(
    events: Events, statuses: dict[str, int], problem: str | None
) -> None:
    sample = _drained(1.0, 0.1, 0.05, events=events, statuses=statuses, declined=10)
    found = anomalies(Results(concurrency=16, worker=[sample]))
    assert found == ([] if problem is None else [f"worker 1: {problem}"])


def test_the_ledger_lines_give_rows_by_status_and_transactions_per_message() -> None:
    results = Results(
        concurrency=16,
        bare=[_drained(1.0, 0.1, 0.05, events="direct", declined=10)],
        worker=[_drained(1.2, 0.12, 0.06, declined=10)],
    )
    lines = ledger_lines(results)
    bare = next(line for line in lines if line.strip().startswith("bare"))
    worker = next(line for line in lines if line.strip().startswith("worker"))
    assert "2.100" in bare  # 210 transactions for 100 messages
    assert "declined 10, succeeded 90" in bare
    assert "retry_scheduled 10, succeeded 90" in worker
    assert ledger_lines(Results(concurrency=16)) == []


def test_each_worker_turn_is_set_against_the_bare_turns_around_it() -> None:
    # Turns of 1 s, bare first and last: the bare pipeline acks 1,000, 900, 800, ... a turn as the
    # machine slows down, the worker 80 % of the bare figure at its moment. The first turn
    # of each is left out (it pays for the first fetch): the worker's first turn, 50 acks,
    # would be a ratio of 0.05.
    turns = []
    for n in range(9):
        bare_rate = 1000.0 - 50.0 * n
        if n % 2 == 0:
            turns.append(
                Turn("bare", float(n), 1.0, int(bare_rate), {"consumer": 0.5, "postgres": 0.2})
            )
        else:
            acked = 50 if n == 1 else int(0.8 * bare_rate)
            turns.append(Turn("worker", float(n), 1.0, acked, {"consumer": 0.6, "postgres": 0.3}))
    sliced = Sliced(turns)
    assert [turn.acked for turn in sliced.measured("worker")] == [680, 600, 520]
    assert sliced.against_bare("rate") == pytest.approx([0.8, 0.8, 0.8], abs=0.002)
    found = {item.key: item for item in ratios(Results(concurrency=16, sliced=sliced))}
    assert found["throughput_sliced"].value == pytest.approx(0.8, abs=0.002)
    # consumer CPU per charge: 0.6 s / 680 against the bare's 0.5 s / 850 (interpolated)
    assert found["cpu_sliced"].pairwise[0] == pytest.approx((0.6 / 680) / (0.5 / 850), rel=0.01)
    assert "3 turns of 1 s each" in found["throughput_sliced"].note
    # every group of the benchmark's, not the machine's other load nor stolen time
    busy = Turn("bare", 0.0, 1.0, 100, {"consumer": 0.1, "postgres": 0.05, OTHER: 1.0, STEAL: 1.0})
    assert busy.cpu_us_per_charge() == pytest.approx(1500.0)
    assert not found["throughput_sliced"].target.met(found["throughput_sliced"].value)
