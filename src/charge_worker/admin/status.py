"""`charge-worker status [--json]`: one screen for whoever is paged at 03:00.

Whether charging runs (the kill switch: who paused, when, why), how far behind it is (the
consumer's lag, ack-pending against its limit, redeliveries, the oldest due charge not yet
charged), the dead letters by reason, the money-moving jobs' latest runs and reconcile's
findings, the outcome events' outbox, the deferred scoring checks, and the worker pods:
each one's breakers and messages in flight as it last wrote them to `worker_pods` (a
breaker lives in one pod's memory), the pods not seen for `pods.SEEN_WITHIN_S` counted
apart. Each part is read with the call its owner exports (`streams`, `dlq`, `jobs`,
`outcomes`, `ledger`); nothing here writes. `gather` reads into one frozen `Status`,
`screen.render` turns it into lines.

A part that cannot be read (NATS or PostgreSQL away, a grant missing, the consumer not
provisioned) is named in `failed` with its one-line error, and the rest is shown: exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import asyncpg
import click
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from charge_worker import database, privileges, streams
from charge_worker.admin.screen import render
from charge_worker.database import translated
from charge_worker.display import printable
from charge_worker.dlq import DeadLetters
from charge_worker.errors import ChargeWorkerError, DependencyUnavailable, ProvisioningError
from charge_worker.jobs import backlog, pods, runs
from charge_worker.jobs.figures import RECONCILE_COUNTS
from charge_worker.jobs.pods import Pods
from charge_worker.ledger import DeferredChecks
from charge_worker.outcomes.outbox import Outbox
from charge_worker.settings import NatsSettings, Settings
from charge_worker.streams import PauseState

T = TypeVar("T")

DEAD_LETTERS_READ = 1000  # the newest; each is one request, to read its Dlq-Reason
_DEAD_LETTERS_AT_ONCE = 50
ANSWER_S = 15.0  # a server that has not answered by then is reported, not waited for
PROGRESS_AFTER_S = 1.0  # reading dead letters longer than this shows a line on stderr

Progress = Callable[[int, int], None]
# the parts `failed` may name, in the screen's order ("nats", "database": no connection)
_PARTS = (
    "nats",
    "consumer",
    "dead letters",
    "database",
    "job runs",
    "oldest due charge",
    "outbox",
    "deferred checks",
    "worker pods",
)


@dataclass(frozen=True)
class Backlog:
    """The durable consumer's counts: messages not delivered yet (the lag), delivered and
    not acked yet against the limit, redelivered among those, pull requests waiting."""

    lag: int
    ack_pending: int
    max_ack_pending: int
    redelivered: int
    waiting_pulls: int


@dataclass(frozen=True)
class DeadLetterCounts:
    """Dead letters in the dead-letter stream, and by reason among the newest `read`
    (fewer than `total`: `capped`)."""

    stream: str
    total: int
    read: int
    capped: bool
    by_reason: dict[str, int]


@dataclass(frozen=True)
class JobRuns:
    """When a job's latest successful and latest failed runs finished (None: none kept)."""

    job: str
    last_ok_at: dt.datetime | None
    last_failed_at: dt.datetime | None


@dataclass(frozen=True)
class ReconcileRun:
    """Reconcile's latest run that finished, and what it found (`held`: it ran while
    charging was paused, and changed nothing)."""

    started_at: dt.datetime
    finished_at: dt.datetime
    ok: bool
    held: bool
    counts: dict[str, int]


@dataclass(frozen=True)
class Failure:
    """A part that could not be read, and why, in one line."""

    part: str
    error: str


@dataclass(frozen=True)
class Status:
    """Everything `status` shows; a field is None when its part was not read (`failed`
    says why)."""

    checked_at: dt.datetime
    charging: PauseState | None = None
    backlog: Backlog | None = None
    oldest_due_s: float | None = None
    dead_letters: DeadLetterCounts | None = None
    runs: tuple[JobRuns, ...] | None = None
    reconcile: ReconcileRun | None = None
    outbox_oldest_unsent_s: float | None = None
    deferred_checks_pending: int | None = None
    pods: Pods | None = None
    failed: tuple[Failure, ...] = ()

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_json(self) -> str:
        """One JSON object: every field, times in ISO 8601, and `exit_code`."""
        document = dataclasses.asdict(self) | {"exit_code": self.exit_code}
        return json.dumps(document, default=_iso)


@dataclass
class _Found:
    """What the parts have read so far (they run at once), and what they could not."""

    charging: PauseState | None = None
    backlog: Backlog | None = None
    oldest_due_s: float | None = None
    dead_letters: DeadLetterCounts | None = None
    runs: tuple[JobRuns, ...] | None = None
    reconcile: ReconcileRun | None = None
    outbox_oldest_unsent_s: float | None = None
    deferred_checks_pending: int | None = None
    pods: Pods | None = None
    failed: list[Failure] = field(default_factory=list)

    async def read(self, part: str, reading: Awaitable[T]) -> T | None:
        """`reading`'s value, or None with the part named in `failed`."""
        try:
            async with asyncio.timeout(ANSWER_S):
                return await reading
        except (ChargeWorkerError, TimeoutError) as error:
            self.fail(part, error)
            return None

    def fail(self, part: str, error: BaseException) -> None:
        text = str(error) if isinstance(error, ChargeWorkerError) else ""
        line = " ".join(text.split()) or f"no answer within {ANSWER_S:g} s"
        self.failed.append(Failure(part, printable(line)))


async def gather(
    settings: Settings,
    *,
    dead_letters_read: int = DEAD_LETTERS_READ,
    progress: Progress | None = None,
) -> Status:
    """Read every part at once, NATS and PostgreSQL side by side; never raises for a
    dependency: a part not read is in `failed`."""
    found = _Found()
    checked_at = dt.datetime.now(dt.UTC)
    await asyncio.gather(
        _from_nats(settings.nats, found, dead_letters_read, progress),
        _from_database(settings, found),
    )
    failed = sorted(found.failed, key=lambda f: _PARTS.index(f.part))
    return Status(
        checked_at=checked_at,
        charging=found.charging,
        backlog=found.backlog,
        oldest_due_s=found.oldest_due_s,
        dead_letters=found.dead_letters,
        runs=found.runs,
        reconcile=found.reconcile,
        outbox_oldest_unsent_s=found.outbox_oldest_unsent_s,
        deferred_checks_pending=found.deferred_checks_pending,
        pods=found.pods,
        failed=tuple(failed),
    )


async def _from_nats(
    cfg: NatsSettings, found: _Found, dead_letters_read: int, progress: Progress | None
) -> None:
    nc = await found.read(
        "nats", streams.connect(cfg, name="charge-worker-status", reconnect=False)
    )
    if nc is None:
        return
    try:
        js = nc.jetstream()
        consumer = await found.read("consumer", _consumer(js, cfg))
        if consumer is not None:
            found.charging, found.backlog = consumer
        # not under `found.read`'s timeout: a thousand reads may take longer; each has its own
        try:
            letters = await _dead_letters(DeadLetters(js, cfg), dead_letters_read, progress)
        except ChargeWorkerError as error:
            found.fail("dead letters", error)
        else:
            found.dead_letters = letters
    finally:
        await nc.close()


async def _consumer(js: JetStreamContext, cfg: NatsSettings) -> tuple[PauseState, Backlog]:
    """The pause and the counts from one CONSUMER.INFO, so they agree with each other."""
    try:
        info = await js.consumer_info(cfg.stream, cfg.durable, timeout=10)
    except nats.js.errors.NotFoundError as error:
        raise ProvisioningError(
            f"consumer {cfg.durable} of stream {cfg.stream} does not exist "
            "(run `charge-worker provision`): nothing is delivered"
        ) from error
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as error:
        raise DependencyUnavailable(f"JetStream did not answer: {error!r}") from error
    counts = Backlog(
        lag=info.num_pending or 0,
        ack_pending=info.num_ack_pending or 0,
        max_ack_pending=info.config.max_ack_pending or 0,
        redelivered=info.num_redelivered or 0,
        waiting_pulls=info.num_waiting or 0,
    )
    return PauseState.of(info), counts


async def _dead_letters(
    letters: DeadLetters, newest: int, progress: Progress | None
) -> DeadLetterCounts:
    """How many dead letters the stream holds, and by reason among the newest `newest`."""
    cfg = letters.cfg
    try:
        info = await letters.js.stream_info(cfg.dlq_stream)
    except nats.js.errors.NotFoundError as error:
        raise ProvisioningError(
            f"dead-letter stream {cfg.dlq_stream} does not exist (run `charge-worker provision`)"
        ) from error
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as error:
        raise DependencyUnavailable(f"dead-letter stream not readable: {error!r}") from error
    state = info.state
    total = state.messages
    reasons: Counter[str] = Counter()
    read = 0
    if total:
        seqs = list(range(max(state.first_seq, state.last_seq - newest + 1, 1), state.last_seq + 1))
        for start in range(0, len(seqs), _DEAD_LETTERS_AT_ONCE):
            chunk = seqs[start : start + _DEAD_LETTERS_AT_ONCE]
            for letter in await asyncio.gather(*(letters.get(seq) for seq in chunk)):
                if letter is not None:  # deleted, or aged out meanwhile
                    reasons[letter.reason or "(none)"] += 1
                    read += 1
            if progress is not None:
                progress(start + len(chunk), len(seqs))
    return DeadLetterCounts(
        stream=cfg.dlq_stream,
        total=total,
        read=read,
        capped=read < total,
        by_reason=dict(reasons.most_common()),
    )


async def _from_database(settings: Settings, found: _Found) -> None:
    pool = await found.read("database", database.create_pool(settings.db))
    if pool is None:
        return
    try:
        await _read_database(settings, pool, found)
    except (ChargeWorkerError, TimeoutError) as error:  # the grants, or no connection to lend
        found.fail("database", error)
    finally:
        with contextlib.suppress(*database.DRIVER_ERRORS, TimeoutError):
            async with asyncio.timeout(5):
                await pool.close()


async def _read_database(settings: Settings, pool: asyncpg.Pool, found: _Found) -> None:
    # as the CronJobs do: one line naming the grant, not every part failing on it
    async with asyncio.timeout(ANSWER_S):
        await privileges.require(pool, privileges.STATUS)
    async with translated("cannot reach the database"), pool.acquire() as conn:
        latest = await found.read("job runs", runs.latest(conn))
        found.oldest_due_s = await found.read("oldest due charge", backlog.oldest_due_s(conn))
    if latest is not None:
        found.runs = tuple(
            JobRuns(job, latest.succeeded.get(job), latest.failed.get(job)) for job in runs.JOBS
        )
        if (run := latest.reconciled) is not None:
            found.reconcile = ReconcileRun(
                started_at=run.started_at,
                finished_at=run.finished_at,
                ok=run.ok,
                held=bool(run.summary.get("held")),
                counts={name: int(run.summary.get(name) or 0) for name in RECONCILE_COUNTS},
            )
    outbox = Outbox.of_worker(pool, settings.worker)  # only read here
    found.outbox_oldest_unsent_s = await found.read("outbox", outbox.oldest_unsent_s())
    checks = DeferredChecks(pool, retry_s=settings.worker.deferred_check_interval_s)
    found.deferred_checks_pending = await found.read("deferred checks", checks.pending())
    found.pods = await found.read("worker pods", pods.recent(pool))


def _iso(value: object) -> str:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


async def status_command(settings: Settings, *, as_json: bool = False) -> int:
    """Print the screen (one JSON object with `as_json`); 0 when every part was read."""
    status = await gather(settings, progress=_progress_line())
    if as_json:
        click.echo(status.to_json())
    else:
        for line in render(status):
            click.echo(line)
    return status.exit_code


def _progress_line() -> Progress:
    """Dead letters read so far, on stderr, once reading them has taken a while."""
    started = time.monotonic()
    shown = False

    def show(done: int, total: int) -> None:
        nonlocal shown
        if not shown and time.monotonic() - started < PROGRESS_AFTER_S:
            return
        shown = True
        click.echo(f"\rreading dead letters: {done} of {total}", err=True, nl=done >= total)

    return show
