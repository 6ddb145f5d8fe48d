"""Dead letters (docs/contracts/charge-due.md): the original body, byte for byte, with headers.

A dead letter is published with `Nats-Msg-Id: dlq:<stream seq>` and its publish ack awaited
before the original is terminated, so it is written once and never lost. The
MAX_DELIVERIES advisory is a safety net for messages whose last delivery died with its
worker: the worker reads the message back from the stream by sequence (`stream_copy`) and
requeues or dead-letters it (`decisions.after_deliveries_ran_out`). A requeue publishes a
fresh copy of a message to the charges subject, its deliveries unspent.

Operators read them back (`scan`, `summaries`, `get`) and `replay` them: the original body
goes back to the charges subject with `Nats-Msg-Id: replay:<dlq seq>`. A replay deletes
nothing; the `charge_attempts` claim keeps it at most one charge however often it runs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from email.header import Header, decode_header
from typing import Any, Literal

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg, StreamState

from charge_worker import streams
from charge_worker.display import printable
from charge_worker.errors import DependencyUnavailable, ProvisioningError
from charge_worker.messages import valid_traceparent
from charge_worker.settings import NatsSettings

MAX_ERROR_CHARS = 300
STREAM_NOT_FOUND = 10059  # JetStream's err_code; a missing message in a stream is 10037
_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError)

ReplayOutcome = Literal["replayed", "duplicate", "missing"]


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def header_text(value: object) -> str:
    """A header value as text, whatever nats-py made of it: its JetStream API (`get_msg`)
    reads a non-ASCII value into an `email.header.Header`, not a string."""
    if isinstance(value, str):
        return value
    if isinstance(value, Header):
        return "".join(
            part.decode("utf-8", "replace") if isinstance(part, bytes) else part
            for part, _charset in decode_header(value)
        )
    return str(value)


def _ascii(text: str) -> str:
    """Printable ASCII: anything else escaped (`\\xfc`, `\\x1b`), so that every reader,
    nats-py's included, reads the header back as the same plain string."""
    return printable(text).encode("ascii", "backslashreplace").decode("ascii")


def envelope_headers(
    *,
    reason: str,
    error: str,
    stream_seq: int,
    num_delivered: int,
    original: Mapping[str, object] | None,
    first_seen: str | None = None,
) -> dict[str, str]:
    """The dead-letter headers, printable ASCII; `error` is cut to one line."""
    one_line = _ascii(" ".join((error or reason).split()))[:MAX_ERROR_CHARS]
    headers = {
        "Dlq-Reason": reason,
        "Dlq-Error": one_line,
        "Dlq-Stream-Seq": str(stream_seq),
        "Dlq-Num-Delivered": str(num_delivered),
        "Dlq-First-Seen": first_seen or _now(),
        "Dlq-Dead-At": _now(),
        "Nats-Msg-Id": f"dlq:{stream_seq}",
    }
    original = original or {}
    if msg_id := original.get("Nats-Msg-Id"):
        headers["Dlq-Orig-Msg-Id"] = _ascii(header_text(msg_id))
    if traceparent := valid_traceparent(header_text(original.get("traceparent"))):
        headers["traceparent"] = traceparent
    return headers


def replay_headers(dlq_seq: int, envelope: Mapping[str, str]) -> dict[str, str]:
    """Headers of a replay: a fresh `Nats-Msg-Id`, and the original `traceparent` if valid."""
    headers = {"Nats-Msg-Id": f"replay:{dlq_seq}"}
    if traceparent := valid_traceparent(envelope.get("traceparent")):
        headers["traceparent"] = traceparent
    return headers


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError is one too
        return None
    return parsed if isinstance(parsed, dict) else None


def _short(value: object) -> int | str | None:
    """A field of a (maybe poison) body: kept when an integer or a string (cut to 64 chars)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return value[:64] if isinstance(value, str) else None


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdecimal() else None


@dataclass(frozen=True)
class DeadLetterSummary:
    """One row of `dlq list`: where, when and why a message died, and which charge it was."""

    seq: int
    dead_at: str | None
    reason: str | None
    stream_seq: int | None
    num_delivered: int | None
    order_id: int | str | None
    billing_period: int | str | None
    error: str | None


@dataclass(frozen=True)
class Letter:
    """A dead letter as stored: its sequence in the DLQ stream, envelope headers and body."""

    seq: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def reason(self) -> str | None:
        return self.headers.get("Dlq-Reason")

    def summary(self) -> DeadLetterSummary:
        """The row of `dlq list`; order and period are read from the body when it is JSON."""
        body = _json_object(self.body) or {}
        return DeadLetterSummary(
            seq=self.seq,
            dead_at=self.headers.get("Dlq-Dead-At"),
            reason=self.reason,
            stream_seq=_int(self.headers.get("Dlq-Stream-Seq")),
            num_delivered=_int(self.headers.get("Dlq-Num-Delivered")),
            order_id=_short(body.get("order_id")),
            billing_period=_short(body.get("billing_period")),
            error=self.headers.get("Dlq-Error"),
        )

    def pretty_body(self) -> str:
        """The body as indented JSON when it is UTF-8 JSON, else the repr of its bytes;
        printable either way (see `display.printable`)."""
        try:
            parsed = json.loads(self.body.decode("utf-8"))
        except ValueError:
            return repr(self.body)
        indented = json.dumps(parsed, indent=2, ensure_ascii=False)
        return "\n".join(printable(line) for line in indented.split("\n"))


@dataclass(frozen=True)
class DeadLetterPage:
    """Dead letters in sequence order, and whether more matched beyond the limit."""

    items: list[DeadLetterSummary]
    more: bool


@dataclass
class ReplayReport:
    """DLQ sequences by what their replay did."""

    replayed: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)

    def add(self, seq: int, outcome: ReplayOutcome) -> None:
        if outcome == "replayed":
            self.replayed.append(seq)
        elif outcome == "duplicate":
            self.duplicates.append(seq)
        else:
            self.missing.append(seq)

    def summary(self) -> str:
        """One line: replayed / skipped as duplicates / missing (with their sequences)."""
        line = (
            f"replayed {len(self.replayed)}, skipped as duplicates {len(self.duplicates)}, "
            f"missing {len(self.missing)}"
        )
        if self.missing:
            line += f" (seq {', '.join(map(str, self.missing))})"
        return line


_ROW = "{:>5}  {:<20}  {:<14}  {:>8}  {:>5}  {:>10}  {:<10}  "
_TITLES = ("SEQ", "DEAD AT", "REASON", "ORIG SEQ", "DELIV", "ORDER", "PERIOD")
MIN_ERROR_WIDTH = 20


def table(rows: Iterable[DeadLetterSummary], width: int) -> list[str]:
    """A header and one line per dead letter, printable (see `display.printable`); the error
    is cut to fit `width` characters."""
    lines = [_ROW.format(*_TITLES) + "ERROR"]
    for row in rows:
        cells = (
            row.seq,
            row.dead_at,
            row.reason,
            row.stream_seq,
            row.num_delivered,
            row.order_id,
            row.billing_period,
        )
        prefix = _ROW.format(*("-" if cell is None else printable(str(cell)) for cell in cells))
        room = max(width - len(prefix), MIN_ERROR_WIDTH)
        error = printable(row.error or "-")
        lines.append(prefix + (error if len(error) <= room else error[: room - 1] + "…"))
    return lines


class DeadLetters:
    """Writes dead letters and requeued copies, and reads and replays them for operators."""

    def __init__(self, js: JetStreamContext, cfg: NatsSettings) -> None:
        self.js = js
        self.cfg = cfg

    async def write(
        self,
        body: bytes,
        *,
        reason: str,
        error: str,
        stream_seq: int,
        num_delivered: int,
        original: Mapping[str, object] | None,
        first_seen: str | None = None,
    ) -> None:
        """Publish a dead letter and wait for JetStream to store it."""
        headers = envelope_headers(
            reason=reason,
            error=error,
            stream_seq=stream_seq,
            num_delivered=num_delivered,
            original=original,
            first_seen=first_seen,
        )
        try:
            await self.js.publish(self.cfg.dlq_subject, body, headers=headers, timeout=5)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as error_:
            raise DependencyUnavailable(f"dead-letter stream not writable: {error_!r}") from error_

    async def requeue(
        self, body: bytes, headers: Mapping[str, object] | None, *, from_seq: int
    ) -> int:
        """Publish a fresh copy of the charges stream's message `from_seq`, its deliveries
        unspent; `Nats-Msg-Id: requeue:<seq>` keeps it to one copy however many try.
        Returns the copy's stream sequence."""
        copy = {k: header_text(v) for k, v in (headers or {}).items() if k != "Nats-Msg-Id"}
        copy["Nats-Msg-Id"] = f"requeue:{from_seq}"
        copy["Charge-Requeued-From"] = str(from_seq)
        try:
            ack = await self.js.publish(self.cfg.subject, body, headers=copy, timeout=5)
        except _NATS_ERRORS as error:
            raise DependencyUnavailable(f"{self.cfg.subject} not writable: {error!r}") from error
        return ack.seq

    def advisory_subject(self) -> str:
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.cfg.stream}.{self.cfg.durable}"

    async def stream_copy(self, seq: int) -> RawStreamMsg | None:
        """The charges stream's message at `seq`, or None when it is gone (acked, purged)."""
        try:
            return await self.js.get_msg(self.cfg.stream, seq)
        except nats.js.errors.NotFoundError:
            return None

    async def get(self, seq: int) -> Letter | None:
        """The dead letter stored at `seq`, or None when there is none (never, or deleted)."""
        try:
            stored = await self.js.get_msg(self.cfg.dlq_stream, seq)
        except nats.js.errors.NotFoundError as error:
            if error.err_code == STREAM_NOT_FOUND:
                raise self._no_stream() from error
            return None
        except _NATS_ERRORS as error:
            raise self._unavailable(error) from error
        headers = {name: header_text(value) for name, value in (stored.headers or {}).items()}
        return Letter(seq, headers, stored.data or b"")

    async def scan(self, reason: str | None = None) -> AsyncGenerator[Letter, None]:
        """Every dead letter (with this `Dlq-Reason`) present when the scan starts, in order."""
        # One get per sequence rather than an ordered consumer: no subscription, heartbeats or
        # end-of-stream detection to manage, and nothing deletes dead letters one by one (age
        # trims from the front, moving first_seq), so there are next to no gaps to walk over.
        state = await self._state()
        if state.messages == 0:
            return  # an empty stream reports first_seq 0
        for seq in range(max(state.first_seq, 1), state.last_seq + 1):
            letter = await self.get(seq)
            if letter is not None and (reason is None or letter.reason == reason):
                yield letter

    async def summaries(self, *, reason: str | None = None, limit: int = 100) -> DeadLetterPage:
        """The first `limit` dead letters (with this reason), oldest first."""
        items: list[DeadLetterSummary] = []
        async with contextlib.aclosing(self.scan(reason)) as letters:
            async for letter in letters:
                if len(items) == limit:
                    return DeadLetterPage(items, more=True)
                items.append(letter.summary())
        return DeadLetterPage(items, more=False)

    async def seqs(self, reason: str | None = None) -> list[int]:
        """The sequences of every dead letter (with this reason), oldest first."""
        # Sequences, not messages: a replay of thousands re-reads each body rather than
        # holding them all (a poison body can be as large as the server's max payload).
        async with contextlib.aclosing(self.scan(reason)) as letters:
            return [letter.seq async for letter in letters]

    async def replay(
        self,
        seqs: Iterable[int],
        *,
        on_each: Callable[[int, ReplayOutcome], None] | None = None,
    ) -> ReplayReport:
        """Republish each dead letter's original body to the charges subject, one ack at a time.

        The dead letters stay where they are. A replay inside the charges stream's duplicate
        window of an earlier replay of the same dead letter is acked as a duplicate.
        """
        report = ReplayReport()
        for seq in seqs:
            try:
                outcome = await self._replay_one(seq)
            except DependencyUnavailable as error:
                raise DependencyUnavailable(
                    f"replay stopped at dead letter {seq} ({report.summary()} before it; "
                    f"running it again is safe): {error}"
                ) from error
            report.add(seq, outcome)
            if on_each is not None:
                on_each(seq, outcome)
        return report

    async def _replay_one(self, seq: int) -> ReplayOutcome:
        letter = await self.get(seq)
        if letter is None:
            return "missing"
        headers = replay_headers(seq, letter.headers)
        try:
            ack = await self.js.publish(self.cfg.subject, letter.body, headers=headers, timeout=5)
        except _NATS_ERRORS as error:
            raise DependencyUnavailable(f"{self.cfg.subject} not writable: {error!r}") from error
        return "duplicate" if ack.duplicate else "replayed"

    async def _state(self) -> StreamState:
        try:
            info = await self.js.stream_info(self.cfg.dlq_stream)
        except nats.js.errors.NotFoundError as error:
            raise self._no_stream() from error
        except _NATS_ERRORS as error:
            raise self._unavailable(error) from error
        return info.state

    def _no_stream(self) -> ProvisioningError:
        return ProvisioningError(
            f"dead-letter stream {self.cfg.dlq_stream} does not exist "
            "(run `charge-worker provision`)"
        )

    def _unavailable(self, error: Exception) -> DependencyUnavailable:
        return DependencyUnavailable(f"dead-letter stream not readable: {error!r}")


@contextlib.asynccontextmanager
async def opened(
    cfg: NatsSettings, *, name: str = "charge-worker-dlq"
) -> AsyncIterator[DeadLetters]:
    """`DeadLetters` on a connection of its own to NATS_URL, closed on exit.

    The connection is for one operator command: when NATS is down it fails within seconds
    with `DependencyUnavailable`, and a lost connection fails the command, not retried.
    """
    nc = await streams.connect(cfg, name=name, reconnect=False)
    try:
        yield DeadLetters(nc.jetstream(), cfg)
    finally:
        await nc.close()
