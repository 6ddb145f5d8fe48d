"""The scenarios: which faults, which settings, how many charges in the quick suite.

The failpoint scenarios run 3 workers of concurrency 2. A worker that kills itself takes
every message in flight with it, and at concurrency 16 a 20 % chance per message means a
worker almost never survives one batch: a crash loop no consumer makes progress in, and
every message in it is collateral. At concurrency 2 each death is mostly the message's own,
which is what "this point fails 20 % of the time" is meant to test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from charge_worker.sandbox.latency import LatencyModel
from charge_worker.sandbox.scoring import INCIDENT_LATENCY
from charge_worker.worker.failpoints import POINTS
from tests.chaos import nemesis
from tests.chaos.cluster import FAILPOINT_DEATH, Shape
from tests.chaos.nemesis import Nemesis


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    workers: int = 2
    nemeses: tuple[Nemesis, ...] = ()
    gateway: dict[str, Any] = field(default_factory=dict)
    scoring: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    full_settings: dict[str, Any] = field(default_factory=dict)  # above the quick size
    poison_share: float = 0.03
    processing_share: float = 0.0  # of the valid keys: answered pending, settled later
    purge_fraction: float = 0.0  # of the published messages, deleted before any worker runs
    quick_size: int = 300
    # the most keys its faults and latencies let drain inside `quiet_within_s` on 2 cores; a
    # larger --size runs this many (a slow gateway's scenario is bounded by its latency)
    max_size: int | None = None
    fault_window_s: float = 60.0  # faults stop when the work is done or after this long
    quiet_within_s: float = 180.0
    shape: Shape = "single"  # the engines: see `Servers`
    fresh_servers: bool = False  # its faults leave the engines changed (a failover)
    ledger_forgets: bool = False  # lost commits: repaired doubles and reported conflicts are fine
    produce_after_faults: bool = False  # the runbook's step after a database failover
    # conflicting copies (same key, another amount): without gateway idempotency, one that
    # arrives after a failover lost its key's row is charged too, and only a person can
    # tell which amount was right (reconcile reports it): a limit, stated in
    # docs/reliability.md, not what a failover scenario measures
    conflicts: bool = True
    # `charge-worker produce` runs this many at once, again every 0.5-1 s from the first
    # run until quiet (0: once, as the daily CronJob), starting the due tries and
    # publishing them
    producers: int = 0

    @property
    def failpoints(self) -> str:
        return str(self.settings.get("failpoints", ""))

    @property
    def retry_schedule(self) -> tuple[float, ...]:
        """The waits before tries 2, 3, ...: none (a decline is final) unless the scenario
        sets them; the generator draws the retries family's keys when there are some."""
        return tuple(self.settings.get("retry_schedule", ()))

    def attacks(self, usual: int) -> dict[str, int]:
        """What must have struck, and how often (see `Chronicle.attacks`), for the run to
        prove anything: `usual` times, or as often as a nemesis can strike at all."""
        needed = {n.name: min(usual, n.at_most or usual) for n in self.nemeses}
        return needed | ({FAILPOINT_DEATH: usual} if ":exit" in self.failpoints else {})


# every charge takes 0.4 s at the gateway: charges still flow when the faults strike
FLOWING = {"latency": LatencyModel(fixed_s=0.4)}
# every charge takes 2-8 s at the gateway
SLOW_GATEWAY = {"latency": LatencyModel(slow_fraction=1.0, slow_min_s=2.0, slow_max_s=8.0)}

# between the relay's publish and its mark: the next relay publishes the batch again, under
# the same `Nats-Msg-Id`, and the stream must keep one message per event
OUTBOX_POINT = "after_outcome_publish_before_mark"


def _failpoint(point: str) -> Scenario:
    """The worker kills itself at `point` with probability 0.2 (3 workers of concurrency 2)."""
    shape: dict[str, Any] = {"quick_size": 50}
    what = f"the worker kills itself at {point} with probability 0.2"
    if "dead_letter" in point:  # only poison reaches it: enough that the worker dies
        shape = {"quick_size": 100, "poison_share": 0.6}
    elif point == OUTBOX_POINT:
        # the relay takes a batch per poll (0.5 s) while events come: charges of 0.4 s keep
        # them coming long enough for the point to strike, and at 10,000 keys the fleet
        # still drains inside the quiet bound once the point is off
        shape = {"quick_size": 100, "gateway": FLOWING, "full_settings": {"concurrency": 16}}
        what += ", charges 0.4 s at the gateway"
    return Scenario(
        f"failpoint_{point}",
        what,
        workers=3,
        settings={"failpoints": f"{point}:exit:0.2", "concurrency": 2},
        **shape,
    )


# The retries family (issue 37): a declined period's next tries 1 s apart, started and
# published by the producer's own runs (`producers`), with keys whose cards succeed on a
# later try, never succeed, are declined hard or want the customer to act.
RETRY_SCHEDULE = (1.0, 1.0, 1.0)


def _retries(name: str, what: str, *, producers: int = 1, **shape: Any) -> Scenario:
    return Scenario(
        f"retries_{name}",
        f"retries 1 s apart (4 tries), produce every 0.5-1 s: {what}",
        settings={"retry_schedule": RETRY_SCHEDULE},
        producers=producers,
        quick_size=200,
        **shape,
    )


RETRIES_BASELINE = _retries("baseline", "no faults")
RETRIES_KILL = _retries(
    "kill",
    "3 workers, one killed (kill -9) every 2 s, charges 0.4 s at the gateway",
    workers=3,
    nemeses=(nemesis.KILL_WORKER,),
    gateway=FLOWING,
)
RETRIES_LOST_ANSWERS = _retries(
    "lost_answers",
    "30 % timeouts / 10 % 5xx after commit, on every try",
    nemeses=(nemesis.LOST_ANSWERS,),
    gateway={"lost_answer_rate": 0.3},
)
RETRIES_NO_IDEMPOTENCY = _retries(
    "no_idempotency",
    "idempotency off and 30 % lost answers: the ledger alone, across every try's key",
    gateway={"idempotency_enabled": False, "lost_answer_rate": 0.3},
)
RETRIES_DOUBLE_PRODUCER = _retries(
    "double_producer", "two produce runs at once, every time", producers=2
)

STRIPE = {"flavour": "stripe"}
STRIPE_QUICK_SIZE = 150  # three scenarios inside `make test`: about 2 minutes of CI in all

# The YooKassa flavour (`GATEWAY_KIND=yookassa`, the simulator speaking API v3 with the
# sandbox's Basic credentials); the money counted the same way, at `/_sim/charges`.
YOOKASSA = {"flavour": "yookassa"}
YOOKASSA_SETTINGS: dict[str, Any] = {
    "kind": "yookassa",
    "api_key": SecretStr("100500:test_sandbox"),
}
YOOKASSA_QUICK_SIZE = 100
# `cus_processing_…` payments settle this long after they were answered `pending`: longer
# than reconcile's quiet time, so a sweep meets some still pending and looks again later
PENDING_SETTLE_S = 4.0

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("baseline", "no faults"),
    Scenario(
        "crash_storm",
        "3 workers, one killed (kill -9) every 2 s",
        workers=3,
        nemeses=(nemesis.KILL_WORKER,),
    ),
    *(_failpoint(point) for point in sorted(POINTS)),
    Scenario(
        "redelivery_storm",
        "ack_wait 1 s, gateway 2-8 s, NATS latency bursts past ack_wait (late acks)",
        workers=3,
        nemeses=(nemesis.NATS_LATENCY,),
        gateway=SLOW_GATEWAY,
        settings={
            "ack_wait_s": 1.0,
            "backoff_s": (1.0, 2.0, 3.0),
            "gateway_timeout_s": 10.0,
            "lease_s": 16.0,
            "concurrency": 64,
            "processing_budget_s": 60.0,
        },
        quick_size=200,
    ),
    Scenario(
        "nats_restart",
        "nats-server killed (SIGKILL or SIGTERM) and restarted",
        nemeses=(nemesis.RESTART_NATS,),
    ),
    Scenario(
        "postgres_crash_pause",
        "PostgreSQL immediate stop + start, and SIGSTOP 1-4 s",
        nemeses=(nemesis.CRASH_POSTGRES, nemesis.PAUSE_POSTGRES),
    ),
    Scenario(
        "scoring_slow",
        "scoring p99 6-8 s, 10 % errors, 5 % hangs",
        scoring={"latency": INCIDENT_LATENCY, "error_rate": 0.1, "hang_rate": 0.05, "hang_s": 30.0},
        quick_size=200,
    ),
    Scenario(
        "gateway_unknown",
        "30 % timeouts / 10 % 5xx after commit, 10 % 503 before",
        nemeses=(nemesis.LOST_ANSWERS,),
        gateway={"lost_answer_rate": 0.3, "error_rates": {503: 0.1}},
    ),
    Scenario(
        "gateway_forgets_keys",
        "key retention 1 s (< every backoff) and 30 % lost answers",
        gateway={"key_retention_s": 1.0, "lost_answer_rate": 0.3},
    ),
    Scenario(
        "gateway_no_idempotency",
        "idempotency off and 30 % lost answers: the ledger alone",
        gateway={"idempotency_enabled": False, "lost_answer_rate": 0.3},
    ),
    # The Stripe flavour (`GATEWAY_KIND=stripe`, the simulator speaking Stripe's wire format):
    # the money counted the same way, at `/_sim/charges`.
    Scenario(
        "stripe_baseline",
        "GATEWAY_KIND=stripe, no faults",
        gateway=STRIPE,
        settings={"kind": "stripe"},
        quick_size=STRIPE_QUICK_SIZE,
    ),
    Scenario(
        "stripe_gateway_unknown",
        "GATEWAY_KIND=stripe, 30 % timeouts / 10 % 5xx after commit, 10 % 503 before",
        nemeses=(nemesis.LOST_ANSWERS,),
        gateway=STRIPE | {"lost_answer_rate": 0.3, "error_rates": {503: 0.1}},
        settings={"kind": "stripe"},
        quick_size=STRIPE_QUICK_SIZE,
    ),
    Scenario(
        "stripe_no_idempotency",
        "GATEWAY_KIND=stripe, idempotency off and 30 % lost answers: the ledger alone",
        gateway=STRIPE | {"idempotency_enabled": False, "lost_answer_rate": 0.3},
        settings={"kind": "stripe"},
        quick_size=STRIPE_QUICK_SIZE,
    ),
    # The YooKassa flavour
    Scenario(
        "yookassa_baseline",
        "GATEWAY_KIND=yookassa, no faults",
        gateway=YOOKASSA,
        settings=YOOKASSA_SETTINGS,
        quick_size=YOOKASSA_QUICK_SIZE,
    ),
    Scenario(
        "yookassa_gateway_unknown",
        "GATEWAY_KIND=yookassa, 30 % timeouts / 10 % 5xx after commit, 10 % 503 before",
        nemeses=(nemesis.LOST_ANSWERS,),
        gateway=YOOKASSA | {"lost_answer_rate": 0.3, "error_rates": {503: 0.1}},
        settings=YOOKASSA_SETTINGS,
        quick_size=YOOKASSA_QUICK_SIZE,
    ),
    Scenario(
        "yookassa_pending",
        f"GATEWAY_KIND=yookassa, 20 % of the keys answered pending and settled "
        f"{PENDING_SETTLE_S:g} s later: recorded processing, settled by reconcile",
        gateway=YOOKASSA | {"processing_settle_s": PENDING_SETTLE_S},
        # a processing row is swept once it is this quiet (the cron runs every 5 s)
        settings=YOOKASSA_SETTINGS | {"reconcile_quiet_s": 3.0},
        processing_share=0.2,
        quick_size=YOOKASSA_QUICK_SIZE,
    ),
    Scenario(
        "purged_stream",
        "20 % of published messages deleted before any worker ran",
        purge_fraction=0.2,
    ),
    Scenario(
        "network",
        "latency, blackhole and resets on the NATS, PostgreSQL, gateway proxies",
        workers=3,
        nemeses=(nemesis.NETWORK,),
    ),
    # two of the retries family in the quick tier (~30 s each); the other three, whose lost
    # answers cost a lease (7 s) each along chains of tries, in `make chaos` only
    RETRIES_KILL,
    RETRIES_DOUBLE_PRODUCER,
)

# Only in `make chaos` (its quick size takes over a minute with the fleet's rate at 3/s:
# more than CI's budget for one scenario); `--size 100` is its quick size.
# Issue 34 item 1: the request that can move money must start under a lease that outlives
# it, however long the rate-limit tokens took. With no idempotency at the gateway the lease
# is the only barrier, and the NATS cut makes JetStream redeliver what a worker is still
# charging.
LEASE_OUTLIVED = Scenario(
    "lease_outlived",
    "gateway 1-3.5 s without idempotency, fleet rate limit 3/s (token waits near the "
    "lease), NATS blackholed 1.5-2.5x ack_wait mid-call: redelivered while still charging",
    workers=3,
    nemeses=(nemesis.HEARTBEATS_CUT,),
    gateway={
        "idempotency_enabled": False,
        "latency": LatencyModel(slow_fraction=1.0, slow_min_s=1.0, slow_max_s=3.5),
    },
    settings={
        "gateway_timeout_s": 3.0,
        "lease_s": 9.0,  # the least the settings accept: timeout + margin + renewal
        "gateway_rate_limit": 3.0,
        "concurrency": 8,
    },
    # 10,000 keys at 3/s would take an hour: a rate the fleet still outruns, and as many keys
    # as it drains (at ~85 a second, 192 calls of 2.25 s in flight) well inside the window
    full_settings={"gateway_rate_limit": 100.0, "concurrency": 64},
    quick_size=100,
    max_size=3_000,
)

# The same promise where the old arithmetic was wrong: a Stripe charge of three requests
# (no invoice default: the customer, its cards, then the intent), each just under the
# timeout, and token waits on top. The lease runs out while the charge still reads, so a
# redelivery takes it over, looks up (fast: before the first intent lands), finds nothing
# and charges. Only a lease checked and renewed right before the intent (`before_send`)
# keeps that takeover from charging a second time; a pipeline that checks the lease once,
# before the reads, double-charges here.
NEAR_TIMEOUT = LatencyModel(slow_fraction=1.0, slow_min_s=5.2, slow_max_s=5.7)
LEASE_OUTLIVED_STRIPE = Scenario(
    "lease_outlived_stripe",
    "GATEWAY_KIND=stripe without idempotency, no invoice default (3 requests a charge, each "
    "5.2-5.7 s of a 6 s timeout; lookups fast), fleet rate limit 4/s, NATS blackholed "
    "1.5-2.5x ack_wait mid-call: the lease runs out before the intent is sent",
    workers=3,
    nemeses=(nemesis.HEARTBEATS_CUT,),
    gateway=STRIPE
    | {
        "idempotency_enabled": False,
        "invoice_default": False,
        "endpoint_latency": {
            "GET /v1/customers/{id}": NEAR_TIMEOUT,
            "GET /v1/payment_methods": NEAR_TIMEOUT,
            "POST /v1/payment_intents": NEAR_TIMEOUT,
        },
        "latency": LatencyModel(slow_fraction=1.0, slow_min_s=0.1, slow_max_s=0.3),
    },
    settings={
        "kind": "stripe",
        "gateway_timeout_s": 6.0,
        "lease_s": 12.0,  # the least the settings accept: timeout + margin + renewal
        "gateway_rate_limit": 4.0,
        "concurrency": 8,
        "processing_budget_s": 60.0,
    },
    # three requests of ~5.5 s a charge: ~12 charges a second with 192 in flight, so 1,000
    # keys drain in ~90 s of the 180 s window (10,000 would need a quarter of an hour)
    full_settings={"gateway_rate_limit": 40.0, "concurrency": 64},
    quick_size=100,
    max_size=1_000,
)

# with the three of the retries family CI does not run (`SCENARIOS` has the other two)
FULL_ONLY: tuple[Scenario, ...] = (
    LEASE_OUTLIVED,
    LEASE_OUTLIVED_STRIPE,
    RETRIES_BASELINE,
    RETRIES_LOST_ANSWERS,
    RETRIES_NO_IDEMPOTENCY,
)

# The clustered engines. The gateway is slow and the workers few, so charges are still
# flowing when the faults strike.
CLUSTERED: dict[str, Any] = {
    "shape": "cluster",
    "gateway": FLOWING,
    "quick_size": 200,
    "settings": {"concurrency": 4},  # a quick run flows for ~20 s, the full one as fast
    "full_settings": {"concurrency": 16},  # as the latency allows
    "fault_window_s": 120.0,
}

CLUSTER_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "stream_leader_killed",
        "3-node cluster: the stream leader killed (kill -9), restarted seconds later",
        nemeses=(nemesis.KILL_STREAM_LEADER,),
        **CLUSTERED,
    ),
    Scenario(
        "consumer_leader_killed",
        "3-node cluster: the consumer leader killed (kill -9), restarted seconds later",
        nemeses=(nemesis.KILL_CONSUMER_LEADER,),
        **CLUSTERED,
    ),
    Scenario(
        "rolling_restart",
        "3-node cluster: every server restarted in turn, as an upgrade does",
        nemeses=(nemesis.ROLLING_RESTART,),
        **CLUSTERED,
    ),
    Scenario(
        "partition",
        "3-node cluster: one server cut from its peers for 10-14 s, then healed",
        nemeses=(nemesis.PARTITION,),
        **CLUSTERED,
    ),
    Scenario(
        "failover_async",
        "PostgreSQL async standby promoted after WAL shipping was held 2-4 s",
        nemeses=(nemesis.FAILOVER,),
        fresh_servers=True,
        produce_after_faults=True,
        ledger_forgets=True,
        **CLUSTERED,
    ),
    Scenario(
        "failover_async_no_idempotency",
        "the same failover with a gateway that keeps no idempotency keys",
        nemeses=(nemesis.FAILOVER,),
        fresh_servers=True,
        produce_after_faults=True,
        ledger_forgets=True,
        conflicts=False,
        **(CLUSTERED | {"gateway": FLOWING | {"idempotency_enabled": False}}),
    ),
    Scenario(
        "failover_sync",
        "PostgreSQL synchronous standby promoted after WAL shipping was held 2-4 s",
        nemeses=(nemesis.FAILOVER,),
        fresh_servers=True,
        produce_after_faults=True,
        **(CLUSTERED | {"shape": "cluster_sync"}),
    ),
)

COMBINED = Scenario(
    "combined",
    "every nemesis at once, slow scoring, lost answers, every failpoint at 0.005",
    workers=3,
    nemeses=(
        nemesis.KILL_WORKER,
        nemesis.RESTART_NATS,
        nemesis.CRASH_POSTGRES,
        nemesis.PAUSE_POSTGRES,
        nemesis.NETWORK,
        nemesis.NATS_LATENCY,
        nemesis.LOST_ANSWERS,
    ),
    scoring={"latency": INCIDENT_LATENCY, "error_rate": 0.05, "hang_rate": 0.02, "hang_s": 30.0},
    gateway={"lost_answer_rate": 0.3, "error_rates": {503: 0.05}},
    settings={"failpoints": ",".join(f"{p}:exit:0.005" for p in sorted(POINTS))},
    purge_fraction=0.05,
    fault_window_s=120.0,
    quiet_within_s=300.0,
)

BY_NAME = {s.name: s for s in (*SCENARIOS, *FULL_ONLY, *CLUSTER_SCENARIOS, COMBINED)}
