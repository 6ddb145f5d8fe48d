"""Idempotent provisioning of the `CHARGES`, `CHARGES_DLQ` and `CHARGE_OUTCOMES` streams and the
durable consumer.

Missing pieces are created as configured. Pieces that exist with another configuration are
never overwritten silently: each difference is reported as a `Drift`, and only with
`apply=True` are the fields JetStream lets us change updated in place. (`pull_subscribe`
ignores the config of an existing durable, which is why this module exists at all.)
"""

from __future__ import annotations

import dataclasses
import json
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from charge_worker.display import without_credentials
from charge_worker.errors import DependencyUnavailable, ProvisioningError, SettingsError
from charge_worker.settings import NatsSettings, require

DLQ_DUPLICATE_WINDOW_S = 86400.0
CONNECT_TIMEOUT_S = 5.0
log = structlog.get_logger(__name__)
# Fields JetStream refuses to change on an existing stream or consumer.
_FIXED_STREAM_FIELDS = frozenset({"storage", "retention"})
_FIXED_CONSUMER_FIELDS = frozenset({"ack_policy", "deliver_policy"})


@dataclass(frozen=True)
class Drift:
    """One field of a stream or consumer that differs from the configuration."""

    kind: str  # "stream" | "consumer"
    name: str
    field: str
    actual: object
    wanted: object

    @property
    def changeable(self) -> bool:
        fixed = _FIXED_STREAM_FIELDS if self.kind == "stream" else _FIXED_CONSUMER_FIELDS
        return self.field not in fixed

    def __str__(self) -> str:
        how = "" if self.changeable else " (JetStream cannot change it: recreate by hand)"
        where = f"{self.kind} {self.name}: {self.field}"
        return f"{where} is {self.actual!r}, configured {self.wanted!r}{how}"


@dataclass
class ProvisionReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    drift: list[Drift] = field(default_factory=list)


def charges_stream(cfg: NatsSettings) -> StreamConfig:
    return StreamConfig(
        name=cfg.stream,
        subjects=[cfg.subject],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        # a bound on the store: longer than any message may wait (a month start's queue,
        # an outage, every redelivery); one older than it is re-published by reconcile
        max_age=cfg.stream_max_age_s,
        duplicate_window=cfg.duplicate_window_s,
        num_replicas=cfg.stream_replicas,
    )


def dlq_stream(cfg: NatsSettings) -> StreamConfig:
    return StreamConfig(
        name=cfg.dlq_stream,
        subjects=[cfg.dlq_subject],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        max_age=cfg.dlq_max_age_s,
        duplicate_window=DLQ_DUPLICATE_WINDOW_S,
        num_replicas=cfg.stream_replicas,
    )


def outcomes_stream(cfg: NatsSettings) -> StreamConfig:
    """Outcome events for the rest of the business: kept for their consumers, not ours."""
    return StreamConfig(
        name=cfg.outcomes_stream,
        subjects=[f"{cfg.outcomes_subject}.>"],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        max_age=cfg.outcomes_max_age_s,
        duplicate_window=cfg.outcomes_duplicate_window_s,
        num_replicas=cfg.stream_replicas,
    )


def worker_consumer(cfg: NatsSettings) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=cfg.durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=cfg.ack_wait_s,
        max_deliver=cfg.max_deliver,
        backoff=list(cfg.backoff_s) or None,
        max_ack_pending=cfg.max_ack_pending,
        filter_subject=cfg.subject,
    )


_STREAM_FIELDS = ("subjects", "storage", "retention", "duplicate_window", "max_age", "num_replicas")
_CONSUMER_FIELDS = (
    "ack_policy",
    "deliver_policy",
    "ack_wait",
    "max_deliver",
    "backoff",
    "max_ack_pending",
    "filter_subject",
)


def _norm(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_norm(v) for v in value]
    return getattr(value, "value", value)  # enums compare by their wire value


def diff(
    kind: str, name: str, actual: object, wanted: object, fields: Iterable[str]
) -> list[Drift]:
    """The configured fields whose values differ; unset (None) wanted fields are skipped."""
    drift = []
    for name_ in fields:
        want = _norm(getattr(wanted, name_))
        have = _norm(getattr(actual, name_))
        if name_ == "max_age" and want is None:
            want = 0  # JetStream reports "no limit" as 0
        if want is not None and have != want:
            drift.append(Drift(kind, name, name_, have, want))
    return drift


async def _ensure_stream(
    js: JetStreamContext, wanted: StreamConfig, apply: bool, report: ProvisionReport
) -> None:
    assert wanted.name is not None
    try:
        info = await js.stream_info(wanted.name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(wanted)
        report.created.append(f"stream {wanted.name}")
        return
    drift = diff("stream", wanted.name, info.config, wanted, _STREAM_FIELDS)
    report.drift.extend(drift)
    if apply and drift and all(d.changeable for d in drift):
        await js.update_stream(wanted)
        report.updated.append(f"stream {wanted.name}")


async def _ensure_consumer(
    js: JetStreamContext, stream: str, wanted: ConsumerConfig, apply: bool, report: ProvisionReport
) -> None:
    assert wanted.durable_name is not None
    try:
        info = await js.consumer_info(stream, wanted.durable_name)
    except nats.js.errors.NotFoundError:
        await js.add_consumer(stream, wanted)
        report.created.append(f"consumer {stream}/{wanted.durable_name}")
        return
    drift = diff("consumer", wanted.durable_name, info.config, wanted, _CONSUMER_FIELDS)
    report.drift.extend(drift)
    if apply and drift and all(d.changeable for d in drift):
        # create-or-update on an existing durable, which replaces the metadata: keep what
        # others put there (`charge-worker pause` records who paused, when, why), and the
        # pause itself (the server keeps it on any update; said anyway)
        kept = dataclasses.replace(
            wanted,
            metadata=kept_metadata(info.config.metadata),
            pause_until=info.config.pause_until,
        )
        await js.add_consumer(stream, kept)
        report.updated.append(f"consumer {stream}/{wanted.durable_name}")


def kept_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    """A consumer's metadata but the keys the server writes itself (`_nats.*`)."""
    kept = {k: v for k, v in (metadata or {}).items() if not k.startswith("_nats.")}
    return kept or None


async def provision(
    js: JetStreamContext, cfg: NatsSettings, *, apply: bool = False
) -> ProvisionReport:
    """Create what is missing; report (and with `apply`, update) what differs."""
    report = ProvisionReport()
    try:
        await _ensure_stream(js, charges_stream(cfg), apply, report)
        await _ensure_stream(js, dlq_stream(cfg), apply, report)
        await _ensure_stream(js, outcomes_stream(cfg), apply, report)
        await _ensure_consumer(js, cfg.stream, worker_consumer(cfg), apply, report)
    except nats.js.errors.APIError as error:
        raise ProvisioningError(
            f"JetStream refused the configuration: {error.description}"
        ) from error
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as error:
        raise DependencyUnavailable(f"JetStream did not answer: {error!r}") from error
    return report


@dataclass(frozen=True)
class Position:
    """Where the durable consumer stands in the charges stream: the oldest message kept,
    the ack floor (every message at or below it was acked or terminated), and the
    messages deleted from the middle of the stream."""

    first_seq: int
    ack_floor: int
    deleted: frozenset[int]

    def waiting(self, seq: int) -> bool:
        """Whether the message at `seq` may still be delivered: kept, not deleted, and above
        the ack floor (a message acked out of order above the floor also counts, until the
        floor passes it)."""
        return seq > self.ack_floor and seq >= self.first_seq and seq not in self.deleted


NOTHING_WAITS = Position(first_seq=2**63 - 1, ack_floor=2**63 - 1, deleted=frozenset())


# The kill switch's record in the durable consumer's metadata (`charge-worker pause`): who
# paused it, when and why; the pause itself is the consumer's (JetStream's consumer pause).
REASON_KEY = "charge-worker.paused_reason"
AT_KEY = "charge-worker.paused_at"
BY_KEY = "charge-worker.paused_by"
RECORD_KEYS = (REASON_KEY, AT_KEY, BY_KEY)


@dataclass(frozen=True)
class PauseState:
    """The durable consumer as the kill switch sees it."""

    stream: str
    consumer: str
    paused: bool
    paused_until: str | None
    reason: str | None
    paused_at: str | None
    paused_by: str | None
    pending: int
    ack_pending: int

    @classmethod
    def of(cls, info: ConsumerInfo) -> PauseState:
        metadata = info.config.metadata or {}
        paused = bool(info.paused)
        return cls(
            stream=info.stream_name,
            consumer=info.name,
            paused=paused,
            paused_until=info.config.pause_until if paused else None,
            reason=metadata.get(REASON_KEY),
            paused_at=metadata.get(AT_KEY),
            paused_by=metadata.get(BY_KEY),
            pending=info.num_pending or 0,
            ack_pending=info.num_ack_pending or 0,
        )

    def line(self) -> str:
        """One line for the operator: paused or delivering, since when, by whom, why."""
        where = f"{self.stream}/{self.consumer}"
        counts = f"{self.pending} waiting, {self.ack_pending} ack pending"
        if not self.paused:
            return f"{where} delivers; {counts}"
        told = [
            f"since {self.paused_at or 'unknown'}",
            f"by {self.paused_by or 'unknown'}",
            f"reason: {self.reason or 'none given'}",
        ]
        return f"{where} is paused, delivers nothing until resumed ({', '.join(told)}); {counts}"


async def pause_state(js: JetStreamContext, cfg: NatsSettings) -> PauseState | None:
    """The durable consumer's pause as it is now; None when there is no consumer."""
    try:
        return PauseState.of(await js.consumer_info(cfg.stream, cfg.durable, timeout=10))
    except nats.js.errors.NotFoundError:
        return None
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as error:
        raise DependencyUnavailable(
            f"JetStream did not say whether {cfg.durable} is paused: {error!r}"
        ) from error


async def position(nc: Client, cfg: NatsSettings) -> Position:
    """The consumer's position now (STREAM.INFO with its deleted details, CONSUMER.INFO)."""
    try:
        consumer = await nc.jetstream().consumer_info(cfg.stream, cfg.durable, timeout=10)
        answer = await nc.request(
            f"$JS.API.STREAM.INFO.{cfg.stream}", b'{"deleted_details": true}', timeout=10
        )
    except nats.js.errors.NotFoundError:
        return NOTHING_WAITS  # no stream or no consumer: no message waits anywhere
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as error:
        where = f"JetStream did not say where the consumer is: {error!r}"
        raise DependencyUnavailable(where) from error
    state = json.loads(answer.data).get("state") or {}
    floor = consumer.ack_floor.stream_seq if consumer.ack_floor else 0
    deleted = frozenset(int(seq) for seq in state.get("deleted") or ())
    return Position(int(state.get("first_seq", 0)), floor, deleted)


async def connect(cfg: NatsSettings, *, name: str, reconnect: bool = True) -> Client:
    """Connect to NATS_URL, failing within seconds if none of its servers answers.

    NATS_URL may list several servers, comma-separated (a cluster): any that answers will
    do, and the others are where a lost connection goes. With `reconnect`, a connection
    lost later is re-established forever (a worker rides out a nats-server restart or a
    node's loss); without, an operator command just fails.
    """
    url = require(cfg.url, "NATS_URL")
    servers = [server.strip() for server in url.split(",") if server.strip()]
    tls = tls_context(cfg)
    try:
        nc = await nats.connect(
            servers=servers,
            name=name,
            user_credentials=str(cfg.nats_creds_file) if cfg.nats_creds_file else None,
            tls=tls,
            connect_timeout=CONNECT_TIMEOUT_S,
            allow_reconnect=reconnect,
            # nats-py applies this to the first connect too, where -1 would retry forever
            max_reconnect_attempts=1,
            error_cb=_log_error if reconnect else _ignore_error,
        )
    except (OSError, TimeoutError, nats.errors.Error) as error:
        cause = str(error) or type(error).__name__
        where = without_credentials(url)
        raise DependencyUnavailable(f"cannot connect to NATS at {where}: {cause}") from error
    if reconnect:
        nc.options["max_reconnect_attempts"] = -1  # from now on: forever
    return nc


def tls_context(cfg: NatsSettings) -> ssl.SSLContext | None:
    """The client's TLS: the server checked against NATS_TLS_CA (else the system's CAs),
    and our certificate (NATS_TLS_CERT, NATS_TLS_KEY) when the server asks for one. None
    when none is set: a `tls://` URL or a server that requires TLS still gets the default.
    Raises `SettingsError` naming the file that cannot be loaded."""
    if cfg.tls_ca is None and cfg.tls_cert is None:
        return None
    try:
        context = ssl.create_default_context(cafile=cfg.tls_ca)
    except (OSError, ssl.SSLError) as error:
        raise SettingsError(f"NATS_TLS_CA: cannot load {cfg.tls_ca}: {error}") from error
    if cfg.tls_cert is not None:
        try:
            context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        except (OSError, ssl.SSLError) as error:
            raise SettingsError(
                f"NATS_TLS_CERT: cannot load {cfg.tls_cert} with its key: {error}"
            ) from error
    return context


async def _log_error(error: Exception) -> None:
    """One line per connection error; nats-py's default logs a traceback for each."""
    log.warning("nats.error", error=repr(error))


async def _ignore_error(_error: Exception) -> None:
    """A command's connection: its errors reach the command as exceptions."""
