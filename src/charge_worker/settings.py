"""The one settings object, read from the environment (then an optional `.env`) once at start.

Groups mirror the parts they configure: `nats`, `db`, `worker`, `scoring`, `gateway`, `http`,
`log`. Server addresses and the API key keep their conventional names (`NATS_URL`,
`DATABASE_URL`, `GATEWAY_URL`, `GATEWAY_API_KEY`, `SCORING_URL`); everything else is
`CHARGE_WORKER_<FIELD>`, with the unit in the name. `load_settings()` turns any invalid value,
alone or in combination, into one `SettingsError` line that names the environment variable.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import AliasChoices, BaseModel, Field, SecretStr, ValidationError, field_validator
from pydantic import model_validator as _model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from charge_worker.errors import SettingsError

ENV_PREFIX = "CHARGE_WORKER_"
# A lease outlives the request that can move money by this much: time for the gateway to
# finish a request whose client gave up, and for the deadline's own timer to fire.
LEASE_MARGIN_S = 5.0
# ... and leaves this much for renewing the lease right before that request (one fenced
# UPDATE); a renewal slower than that sends nothing.
LEASE_RENEWAL_S = 1.0
GatewayKind = Literal["contract", "stripe", "yookassa"]
SslMode = Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
KEY_PREFIX_MAX = 32
MAX_TRIES = 1000  # of one period: far beyond any schedule, a bound on what a message may ask
_KEY_PREFIX = re.compile(rf"[A-Za-z0-9_.:-]{{0,{KEY_PREFIX_MAX}}}")
# The most requests one charge makes, per adapter: Stripe reads the customer's saved card
# (its invoice default, else a list of its cards) before the PaymentIntent.
REQUESTS_PER_CHARGE: dict[GatewayKind, int] = {"contract": 1, "stripe": 3, "yookassa": 1}


def _alias(env: str, field: str) -> Any:
    """Unset by default; read from `env`, and code may pass the field by its own name."""
    return Field(None, validation_alias=AliasChoices(env, field))


class _EnvGroup(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        extra="ignore",
        populate_by_name=True,
        frozen=True,
    )


class NatsSettings(_EnvGroup):
    """Where the broker is and how the streams and the durable consumer are shaped."""

    url: str | None = _alias("NATS_URL", "url")
    nats_creds_file: Path | None = None
    # mutual TLS: the client certificate and key, and the CA the server's certificate is
    # checked against (default: the system's); read when connecting (streams.tls_context),
    # where a missing or unreadable file fails naming its variable
    tls_cert: Path | None = _alias("NATS_TLS_CERT", "tls_cert")
    tls_key: Path | None = _alias("NATS_TLS_KEY", "tls_key")
    tls_ca: Path | None = _alias("NATS_TLS_CA", "tls_ca")
    stream: str = "CHARGES"
    subject: str = "charges.due"
    durable: str = "charges-worker"
    dlq_stream: str = "CHARGES_DLQ"
    dlq_subject: str = "charges.dlq"
    ack_wait_s: float = Field(30.0, gt=0)
    max_deliver: int = Field(5, ge=1)
    backoff_s: Annotated[tuple[float, ...], NoDecode] = (30.0, 60.0, 300.0, 900.0)
    max_ack_pending: int = Field(1000, ge=1)
    duplicate_window_s: float = Field(7200.0, gt=0)
    publish_retry_horizon_s: float = Field(600.0, ge=0)
    stream_max_age_s: float = Field(7 * 86400.0, ge=86400.0)
    dlq_max_age_s: float = Field(30 * 86400.0, gt=0)
    stream_replicas: int = Field(1, ge=1, le=5)
    # outcome events (docs/contracts/charge-outcome.md): `<subject>.<kind>`
    outcomes_stream: str = "CHARGE_OUTCOMES"
    outcomes_subject: str = "charges.outcome"
    outcomes_max_age_s: float = Field(30 * 86400.0, ge=86400.0)
    outcomes_duplicate_window_s: float = Field(7200.0, gt=0)

    @field_validator("backoff_s", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip().removeprefix("[").removesuffix("]")
            return tuple(part.strip() for part in text.split(",") if part.strip())
        return value

    @field_validator("backoff_s")
    @classmethod
    def _positive(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(step <= 0 for step in value):
            raise ValueError("every backoff step must be > 0 seconds")
        return value


class DbSettings(_EnvGroup):
    """The PostgreSQL ledger."""

    url: SecretStr | None = _alias("DATABASE_URL", "url")  # a DSN may hold a password
    db_pool_min: int = Field(1, ge=0)
    db_pool_max: int = Field(10, ge=1)
    db_command_timeout_s: float = Field(10.0, gt=0)
    events_retention_months: int = Field(13, ge=2)  # `maintain` drops charge_events past it
    # TLS to PostgreSQL by libpq's names: `verify-full` checks the server's certificate
    # against PGSSLROOTCERT and its name against the host. A DATABASE_URL's own `sslmode` /
    # `sslrootcert` win; unset, asyncpg's default (`prefer`: encrypted if offered, unchecked).
    sslmode: SslMode | None = _alias("PGSSLMODE", "sslmode")
    sslrootcert: Path | None = _alias("PGSSLROOTCERT", "sslrootcert")

    @property
    def dsn(self) -> str:
        """The address to connect to, with PGSSLMODE and PGSSLROOTCERT where the URL says
        none of its own; fails naming DATABASE_URL when it is not set."""
        url = require(self.url.get_secret_value() if self.url else None, "DATABASE_URL")
        return with_tls(url, self.sslmode, self.sslrootcert)


def with_tls(url: str, sslmode: str | None, sslrootcert: Path | None) -> str:
    """`url` with `sslmode` and `sslrootcert` added to its query, each unless it has one."""
    parts = urlsplit(url)
    names = {name for name, _ in parse_qsl(parts.query, keep_blank_values=True)}
    added = [
        (name, str(value))
        for name, value in (("sslmode", sslmode), ("sslrootcert", sslrootcert))
        if value and name not in names
    ]
    if not added:
        return url
    query = "&".join(filter(None, (parts.query, urlencode(added))))
    return urlunsplit(parts._replace(query=query))


class WorkerSettings(_EnvGroup):
    """The pull loop: concurrency, heartbeats, leases, shutdown."""

    concurrency: int = Field(16, ge=1, le=4096)
    heartbeat_s: float | None = Field(None, gt=0)
    processing_budget_s: float = Field(300.0, gt=0)
    lease_s: float = Field(30.0, gt=0)
    drain_s: float = Field(20.0, gt=0)
    fetch_wait_s: float = Field(1.0, gt=0)
    deferred_check_interval_s: float = Field(10.0, gt=0)
    stats_interval_s: float = Field(15.0, gt=0)
    failpoints: str = ""  # for the reliability suite only; checked by worker/failpoints.py
    # `match`: a message with no ledger row is charged only when its subscription agrees
    verify_subscription: Literal["off", "match"] = "off"
    # the relay of outcome events (outcomes/relay.py), in every worker pod
    outbox_poll_s: float = Field(0.5, gt=0)
    outbox_batch: int = Field(200, ge=1, le=10000)
    outbox_publish_timeout_s: float = Field(5.0, gt=0)
    outbox_retry_max_s: float = Field(60.0, gt=0)
    outbox_retention_s: float = Field(7 * 86400.0, ge=3600.0)

    @property
    def outbox_retry_horizon_s(self) -> float:
        """The longest an event the stream may hold already waits for its next publish:
        an answer not heard within the timeout, then the longest gap between tries."""
        return self.outbox_publish_timeout_s + self.outbox_retry_max_s


class ScoringSettings(_EnvGroup):
    """The anti-fraud scoring client."""

    url: str | None = _alias("SCORING_URL", "url")
    scoring_timeout_s: float = Field(2.0, gt=0)
    scoring_policy: Literal["defer", "hold"] = "defer"
    scoring_breaker_failures: int = Field(5, ge=1)
    scoring_breaker_reset_s: float = Field(30.0, gt=0)


class GatewaySettings(_EnvGroup):
    """The payment gateway client: which adapter (`GATEWAY_KIND`), where, and how hard."""

    # `contract`: the project's own API (docs/contracts/gateway.md); `stripe`: Stripe's
    kind: GatewayKind = Field("contract", validation_alias=AliasChoices("GATEWAY_KIND", "kind"))
    url: str | None = _alias("GATEWAY_URL", "url")
    api_key: SecretStr | None = _alias("GATEWAY_API_KEY", "api_key")
    gateway_timeout_s: float = Field(10.0, gt=0)
    gateway_breaker_failures: int = Field(5, ge=1)
    gateway_breaker_reset_s: float = Field(30.0, gt=0)
    gateway_max_connections: int = Field(100, ge=1)
    gateway_rate_limit: float = Field(0.0, ge=0)  # requests per second, the whole fleet; 0: off

    def required_api_key(self) -> str:
        """The key an adapter authenticates with; `SettingsError` naming the variable when
        it is not set."""
        return require(self.api_key.get_secret_value() if self.api_key else "", "GATEWAY_API_KEY")

    @field_validator("url")
    @classmethod
    def _tls_unless_loopback(cls, value: str | None) -> str | None:
        if value and not _tls_or_loopback(value):
            raise ValueError(
                "http:// sends the API key and every charge in clear text; use https://"
                " (plain http only to a loopback host: 127.0.0.0/8, ::1, localhost)"
            )
        return value

    # put before every Idempotency-Key sent (charges and refunds), for an account shared with
    # other integrations; empty: the contract's keys exactly. The ledger's keys stay bare.
    idempotency_key_prefix: str = ""

    @field_validator("idempotency_key_prefix")
    @classmethod
    def _key_prefix(cls, value: str) -> str:
        if not _KEY_PREFIX.fullmatch(value):
            raise ValueError(
                f"must be at most {KEY_PREFIX_MAX} characters of A-Z a-z 0-9 _ . : -"
                f" (got {len(value)} characters)"
            )
        return value


def _tls_or_loopback(url: str) -> bool:
    """Not `http://`, or `http://` to this host only (nothing leaves it in clear text)."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() != "http":
        return True
    host = (parts.hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


class ReconcileSettings(_EnvGroup):
    """The reconcile sweeps (a CronJob, every 15 min by default; `--full` daily)."""

    reconcile_window_s: float = Field(48 * 3600.0, gt=0)
    reconcile_quiet_s: float = Field(900.0, gt=0)
    # each run re-reads this much history before its checkpoint: the gateway's clock skew
    # and listing lag
    reconcile_overlap_s: float = Field(60.0, ge=0)

    @_model_validator(mode="after")
    def _overlap_inside_window(self) -> Self:
        if self.reconcile_overlap_s >= self.reconcile_window_s:
            raise _Rule(
                "CHARGE_WORKER_RECONCILE_OVERLAP_S",
                f"is {self.reconcile_overlap_s:g}s but must be shorter than "
                f"CHARGE_WORKER_RECONCILE_WINDOW_S ({self.reconcile_window_s:g}s)",
            )
        return self


class WebhookSettings(_EnvGroup):
    """The gateway-webhook receiver (`charge-worker webhooks`) and its journal."""

    webhook_host: str = "0.0.0.0"  # noqa: S104  # the gateway calls in from outside the pod
    webhook_port: int = Field(8081, ge=0, le=65535)
    webhook_secrets: Annotated[tuple[SecretStr, ...], NoDecode] = ()
    webhook_max_bytes: int = Field(256 * 1024, ge=1024)
    webhook_tolerance_s: float = Field(300.0, gt=0, le=300.0)  # the contract's 5 min at most
    # the gateway retries a delivery for up to 3 days: keep the journal at least that long
    webhook_retention_s: float = Field(3 * 86400.0, ge=3 * 86400.0)
    # slow clients: the gateway gives up on an answer after 5 s, so nothing slower is real
    webhook_header_timeout_s: float = Field(5.0, gt=0, le=60.0)
    webhook_body_timeout_s: float = Field(5.0, gt=0, le=60.0)
    webhook_keep_alive_s: int = Field(5, ge=1, le=600)
    webhook_max_connections: int = Field(100, ge=2, le=10_000)
    # unsigned notifications (GATEWAY_KIND=yookassa) are taken only from these: by default
    # the networks YooKassa publishes for its notifications
    webhook_source_networks: Annotated[
        tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...], NoDecode
    ] = tuple(
        ipaddress.ip_network(network)
        for network in (
            "185.71.76.0/27",
            "185.71.77.0/27",
            "77.75.153.0/25",
            "77.75.156.11/32",
            "77.75.156.35/32",
            "77.75.154.128/25",
            "2a02:5180::/32",
        )
    )
    # the ingress in front: a delivery from one of these is from the address it forwarded
    webhook_trusted_proxies: Annotated[
        tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...], NoDecode
    ] = ()

    @field_validator("webhook_secrets", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("webhook_source_networks", "webhook_trusted_proxies", mode="before")
    @classmethod
    def _networks(cls, value: object) -> object:
        """Comma-separated CIDR networks or single addresses (a /32 or /128), host bits
        clear: `10.0.0.1/8` is refused as a likely typo."""
        parts = value.split(",") if isinstance(value, str) else value
        if not isinstance(parts, list | tuple):
            return value
        networks = []
        for part in parts:
            if not isinstance(part, str):
                networks.append(part)
                continue
            if not part.strip():
                continue
            text = part.strip()
            try:
                networks.append(ipaddress.ip_network(text))
            except ValueError as error:
                try:
                    loose = ipaddress.ip_network(text, strict=False)
                except ValueError:
                    raise ValueError(f"{text!r} is not an IP address or CIDR network") from error
                raise ValueError(f"{text!r} has host bits set (the network is {loose})") from error
        return tuple(networks)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
DAY_S = 86400.0
CAP_WINDOW_S = 30 * DAY_S  # the window of CHARGE_WORKER_RETRY_CAP_30D


class RetrySettings(_EnvGroup):
    """Retries of a declined renewal (docs/contracts/gateway.md, "Retrying a declined
    renewal"; docs/decisions/0007-retries.md)."""

    # the wait before each try after the first, from the decline before it: `1d,3d,5d,7d`
    # (the default) is five tries over 16 days; empty: a decline ends the period
    retry_schedule: Annotated[tuple[float, ...], NoDecode] = (
        1 * DAY_S,
        3 * DAY_S,
        5 * DAY_S,
        7 * DAY_S,
    )
    # the most tries of one period started in any 30 days, retries on purpose included
    retry_cap_30d: int = Field(8, ge=1, le=MAX_TRIES)

    @field_validator("retry_schedule", mode="before")
    @classmethod
    def _durations(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        steps = []
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            match = _DURATION.fullmatch(part)
            if match is None:
                raise ValueError(
                    f"{part!r} is not a duration like 12h or 3d (units s, m, h, d; none: s)"
                )
            steps.append(float(match[1]) * _UNIT_S[match[2]])
        return tuple(steps)

    @field_validator("retry_schedule")
    @classmethod
    def _sane(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(step <= 0 for step in value):
            raise ValueError("every wait must be positive")
        if len(value) + 1 > MAX_TRIES:
            raise ValueError(f"allows at most {MAX_TRIES - 1} retries")
        return value

    @_model_validator(mode="after")
    def _within_cap(self) -> Self:
        if self.tries_in_30d > self.retry_cap_30d:
            raise _Rule(
                "CHARGE_WORKER_RETRY_CAP_30D",
                f"is {self.retry_cap_30d} but CHARGE_WORKER_RETRY_SCHEDULE starts "
                f"{self.tries_in_30d} tries of a period within 30 days",
            )
        return self

    @property
    def tries_in_30d(self) -> int:
        """The most tries the schedule itself starts in one 30-day window (the first one's)."""
        offsets = itertools.accumulate(self.retry_schedule)
        return 1 + sum(1 for offset in offsets if offset < CAP_WINDOW_S)


class HttpSettings(_EnvGroup):
    """The worker's own HTTP surface: /metrics, /healthz, /readyz."""

    http_host: str = "0.0.0.0"  # noqa: S104  # pods are probed from outside the container
    metrics_port: int = Field(9090, ge=0, le=65535)


class LogSettings(_EnvGroup):
    """Structured logging."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"


def _group(cls: type[_EnvGroup]) -> Any:
    factory: Callable[[], _EnvGroup] = cls
    return Field(default_factory=factory)


class Settings(BaseModel):
    """Every setting of charge-worker, grouped; cross-field rules are checked here."""

    model_config = {"frozen": True}

    nats: NatsSettings = _group(NatsSettings)
    db: DbSettings = _group(DbSettings)
    worker: WorkerSettings = _group(WorkerSettings)
    retries: RetrySettings = _group(RetrySettings)
    scoring: ScoringSettings = _group(ScoringSettings)
    gateway: GatewaySettings = _group(GatewaySettings)
    reconcile: ReconcileSettings = _group(ReconcileSettings)
    webhooks: WebhookSettings = _group(WebhookSettings)
    http: HttpSettings = _group(HttpSettings)
    log: LogSettings = _group(LogSettings)

    @property
    def shortest_ack_wait_s(self) -> float:
        """The shortest time JetStream waits for an ack on any delivery."""
        return min((self.nats.ack_wait_s, *self.nats.backoff_s))

    @property
    def heartbeat_s(self) -> float:
        """How often a message in progress tells JetStream so (`+WPI`)."""
        return self.worker.heartbeat_s or self.shortest_ack_wait_s / 3

    @_model_validator(mode="after")
    def _cross_field_rules(self) -> Self:
        nats, worker = self.nats, self.worker
        backoff = nats.backoff_s
        if backoff and nats.max_deliver <= len(backoff):
            raise _Rule(
                "CHARGE_WORKER_MAX_DELIVER",
                f"is {nats.max_deliver} but must exceed the {len(backoff)} backoff steps "
                "(JetStream rejects the consumer otherwise)",
            )
        if backoff and backoff[0] != nats.ack_wait_s:
            raise _Rule(
                "CHARGE_WORKER_BACKOFF_S",
                f"starts with {backoff[0]:g}s but CHARGE_WORKER_ACK_WAIT_S is "
                f"{nats.ack_wait_s:g}s; JetStream uses the first step in place of ack_wait, "
                "so they must be equal",
            )
        if self.heartbeat_s > self.shortest_ack_wait_s / 2:
            raise _Rule(
                "CHARGE_WORKER_HEARTBEAT_S",
                f"is {self.heartbeat_s:g}s but must be at most half the shortest ack wait "
                f"({self.shortest_ack_wait_s:g}s), or messages in progress get redelivered",
            )
        gateway = self.gateway
        requests = REQUESTS_PER_CHARGE[gateway.kind]
        needed = self.scoring.scoring_timeout_s + (1 + requests) * gateway.gateway_timeout_s
        if worker.processing_budget_s < needed:
            raise _Rule(
                "CHARGE_WORKER_PROCESSING_BUDGET_S",
                f"is {worker.processing_budget_s:g}s but one message may need {needed:g}s "
                f"(scoring timeout + gateway lookup + the {requests} request(s) of a "
                f"{gateway.kind} charge)",
            )
        if worker.lease_s < gateway.gateway_timeout_s + LEASE_MARGIN_S + LEASE_RENEWAL_S:
            raise _Rule(
                "CHARGE_WORKER_LEASE_S",
                f"is {worker.lease_s:g}s but must outlive CHARGE_WORKER_GATEWAY_TIMEOUT_S "
                f"({gateway.gateway_timeout_s:g}s) by {LEASE_MARGIN_S + LEASE_RENEWAL_S:g}s, so "
                "a lease renewed before a charge request outlives it by "
                f"{LEASE_MARGIN_S:g}s and a taken-over row's earlier request has finished",
            )
        if nats.max_ack_pending < worker.concurrency:
            raise _Rule(
                "CHARGE_WORKER_MAX_ACK_PENDING",
                f"is {nats.max_ack_pending} but CHARGE_WORKER_CONCURRENCY is "
                f"{worker.concurrency}; the consumer would stall below it",
            )
        if nats.duplicate_window_s < nats.publish_retry_horizon_s:
            raise _Rule(
                "CHARGE_WORKER_DUPLICATE_WINDOW_S",
                f"is {nats.duplicate_window_s:g}s, shorter than the producer's retry horizon "
                f"CHARGE_WORKER_PUBLISH_RETRY_HORIZON_S ({nats.publish_retry_horizon_s:g}s)",
            )
        if nats.duplicate_window_s > nats.stream_max_age_s:
            raise _Rule(
                "CHARGE_WORKER_DUPLICATE_WINDOW_S",
                f"is {nats.duplicate_window_s:g}s, longer than the stream keeps a message "
                f"(CHARGE_WORKER_STREAM_MAX_AGE_S, {nats.stream_max_age_s:g}s)",
            )
        if nats.outcomes_duplicate_window_s < worker.outbox_retry_horizon_s:
            raise _Rule(
                "CHARGE_WORKER_OUTCOMES_DUPLICATE_WINDOW_S",
                f"is {nats.outcomes_duplicate_window_s:g}s, shorter than the relay's retry "
                f"horizon ({worker.outbox_retry_horizon_s:g}s: "
                "CHARGE_WORKER_OUTBOX_PUBLISH_TIMEOUT_S + CHARGE_WORKER_OUTBOX_RETRY_MAX_S)",
            )
        if nats.outcomes_duplicate_window_s > nats.outcomes_max_age_s:
            raise _Rule(
                "CHARGE_WORKER_OUTCOMES_DUPLICATE_WINDOW_S",
                f"is {nats.outcomes_duplicate_window_s:g}s, longer than the stream keeps an "
                f"event (CHARGE_WORKER_OUTCOMES_MAX_AGE_S, {nats.outcomes_max_age_s:g}s)",
            )
        if (nats.tls_cert is None) != (nats.tls_key is None):
            missing = "NATS_TLS_KEY" if nats.tls_key is None else "NATS_TLS_CERT"
            raise _Rule(missing, "must be set with the other: a client certificate needs its key")
        if self.db.db_pool_max < self.db.db_pool_min:
            raise _Rule("CHARGE_WORKER_DB_POOL_MAX", "must be >= CHARGE_WORKER_DB_POOL_MIN")
        return self


class _Rule(ValueError):
    """A broken cross-field rule; carries the environment variable to name."""

    def __init__(self, env: str, problem: str) -> None:
        super().__init__(f"{env} {problem}")
        self.env = env


def env_name(group: type[BaseModel], field: str) -> str:
    """The environment variable that sets `field` of `group`."""
    alias = group.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        first = alias.choices[0]
        assert isinstance(first, str)
        return first
    return f"{ENV_PREFIX}{field.upper()}"


def _one_line(group: type[BaseModel], error: ValidationError) -> str:
    first = error.errors()[0]
    field = next((str(part) for part in first["loc"] if isinstance(part, str)), "")
    if isinstance(first.get("ctx", {}).get("error"), _Rule):
        return str(first["ctx"]["error"])
    name = env_name(group, field) if field in group.model_fields else field.upper()
    return f"{name}: {first['msg']}"


def load_settings() -> Settings:
    """Read and check every setting; raise `SettingsError` naming the first bad one."""
    groups: dict[str, _EnvGroup] = {}
    for name, info in Settings.model_fields.items():
        cls = info.annotation
        assert isinstance(cls, type)
        assert issubclass(cls, _EnvGroup)
        try:
            groups[name] = cls()
        except ValidationError as error:
            raise SettingsError(_one_line(cls, error)) from error
    try:
        return Settings.model_validate(groups)
    except ValidationError as error:
        raise SettingsError(_one_line(Settings, error)) from error


def require(value: str | None, env: str) -> str:
    """Return a server address that this command needs, or fail naming its variable."""
    if not value:
        raise SettingsError(f"{env} is not set; this command needs it")
    return value
