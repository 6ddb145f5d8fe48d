"""`charge-worker pause [--reason R] [--by WHO] [--json]` and `charge-worker resume [--json]`:
the kill switch.

`pause` pauses the durable consumer (JetStream's consumer pause, nats-server 2.11+) until
resumed: JetStream delivers nothing more, not even redeliveries, while the workers keep
running, Ready, exporting metrics (`charge_worker_paused` is 1); their fetches come back
empty, messages wait in the stream, and a message already fetched is finished. Who paused,
when and why are kept in the consumer's own metadata (`charge-worker.paused_*`), so the one
state lives in JetStream: a worker (re)starting only binds to the consumer, and
`provision --apply` keeps its metadata and its pause (`streams.provision`). `resume` lifts
the pause and clears the record. Both are idempotent and print the consumer's state as it
is afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import getpass
import json
import socket
from collections.abc import Iterator, Mapping

import click
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from charge_worker import streams
from charge_worker.display import printable
from charge_worker.errors import ChargeWorkerError, DependencyUnavailable, ProvisioningError
from charge_worker.settings import NatsSettings, Settings
from charge_worker.streams import AT_KEY, BY_KEY, REASON_KEY, RECORD_KEYS, PauseState

# "until resumed": the latest time RFC 3339 can write
PAUSED_UNTIL = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)


def recorded(
    metadata: Mapping[str, str] | None, *, reason: str | None, by: str, at: dt.datetime
) -> dict[str, str]:
    """The consumer's metadata with the pause recorded in it (a previous record replaced)."""
    record = {AT_KEY: _rfc3339(at), BY_KEY: by}
    if reason:
        record[REASON_KEY] = reason
    return cleared(metadata) | record


def cleared(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The consumer's metadata without the pause's record (nor the server's own keys)."""
    kept = streams.kept_metadata(metadata) or {}
    return {key: value for key, value in kept.items() if key not in RECORD_KEYS}


def paused_for_good(info: ConsumerInfo) -> bool:
    """Paused until resumed, as `pause` pauses (not until some time, as `nats` can)."""
    until = info.config.pause_until
    # JetStream writes it back in RFC 3339, its offset and fraction its own: the year will do
    return bool(info.paused) and until is not None and until[:4] == f"{PAUSED_UNTIL.year}"


def operator() -> str:
    """Who runs this command, for the record: `user@host` (`unknown@host` in a pod whose
    uid has no name)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no LOGNAME/USER and no passwd entry for the uid
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def pause(
    js: JetStreamContext, cfg: NatsSettings, *, reason: str | None, by: str, now: dt.datetime
) -> tuple[PauseState, bool]:
    """Pause the durable consumer until resumed and record who, when and why; the state
    after, and whether anything changed. Paused already: the first record stays."""
    with _translated(cfg):
        info = await js.consumer_info(cfg.stream, cfg.durable)
        changed = not paused_for_good(info)
        if changed:
            answer = await js.pause_consumer(cfg.stream, cfg.durable, _rfc3339(PAUSED_UNTIL))
            if not answer.paused:
                raise ProvisioningError(
                    f"nats-server did not pause {cfg.stream}/{cfg.durable}: "
                    "the kill switch needs nats-server 2.11 or later"
                )
            info = await js.consumer_info(cfg.stream, cfg.durable)
    if changed or AT_KEY not in (info.config.metadata or {}):
        metadata = recorded(info.config.metadata, reason=reason, by=by, at=now)
        try:
            with _translated(cfg):
                info = await _with_metadata(js, cfg, info, metadata)
        except ChargeWorkerError as error:  # the operator must not take it for "not paused"
            raise type(error)(
                f"{cfg.stream}/{cfg.durable} is paused, but who, when and why could not be "
                f"recorded: {error}"
            ) from error
        changed = True
    return PauseState.of(info), changed


async def resume(js: JetStreamContext, cfg: NatsSettings) -> tuple[PauseState, bool]:
    """Resume the durable consumer and clear the pause's record; the state after, and
    whether anything changed."""
    with _translated(cfg):
        info = await js.consumer_info(cfg.stream, cfg.durable)
        changed = bool(info.paused)
        if changed:
            await js.resume_consumer(cfg.stream, cfg.durable)
            info = await js.consumer_info(cfg.stream, cfg.durable)
        if any(key in (info.config.metadata or {}) for key in RECORD_KEYS):
            info = await _with_metadata(js, cfg, info, cleared(info.config.metadata))
            changed = True
    return PauseState.of(info), changed


async def pause_command(
    settings: Settings, *, reason: str | None, by: str | None, as_json: bool = False
) -> int:
    """Stop every delivery until `resume`; print the consumer's state now."""
    nc = await streams.connect(settings.nats, name="charge-worker-pause", reconnect=False)
    try:
        who = by or operator()
        now = dt.datetime.now(dt.UTC)
        state, changed = await pause(nc.jetstream(), settings.nats, reason=reason, by=who, now=now)
    finally:
        await nc.close()
    _print(state, changed, done="paused", as_before="already paused", as_json=as_json)
    return 0


async def resume_command(settings: Settings, *, as_json: bool = False) -> int:
    """Deliver again; print the consumer's state now."""
    nc = await streams.connect(settings.nats, name="charge-worker-resume", reconnect=False)
    try:
        state, changed = await resume(nc.jetstream(), settings.nats)
    finally:
        await nc.close()
    _print(state, changed, done="resumed", as_before="not paused", as_json=as_json)
    return 0


def _print(state: PauseState, changed: bool, *, done: str, as_before: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(state) | {"changed": changed, "exit_code": 0}))
    else:
        click.echo(printable(f"{done if changed else as_before}: {state.line()}"))


async def _with_metadata(
    js: JetStreamContext, cfg: NatsSettings, info: ConsumerInfo, metadata: dict[str, str]
) -> ConsumerInfo:
    """The consumer updated with this metadata, every other field as the server has it
    (an update keeps the pause: only the pause API changes it). Sent as `provision` sends
    it, by durable name alone: with the server's `name` in it, nats-py would send it to
    `CONSUMER.CREATE.<stream>.<name>.<filter>`, a subject the documented users are not
    allowed (docs/nats-permissions.md)."""
    config = dataclasses.replace(info.config, metadata=metadata or None, name=None)
    return await js.add_consumer(cfg.stream, config)


@contextlib.contextmanager
def _translated(cfg: NatsSettings) -> Iterator[None]:
    """JetStream's errors as the domain's: a consumer or stream that is not there, a
    refusal, no answer."""
    try:
        yield
    except nats.js.errors.NotFoundError as error:
        raise ProvisioningError(
            f"consumer {cfg.durable} of stream {cfg.stream} does not exist "
            "(run `charge-worker provision`)"
        ) from error
    except nats.js.errors.APIError as error:
        raise ProvisioningError(f"JetStream refused: {error.description}") from error
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as error:
        raise DependencyUnavailable(f"JetStream did not answer: {error!r}") from error


def _rfc3339(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
