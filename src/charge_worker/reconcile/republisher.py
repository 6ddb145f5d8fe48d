"""The charges stream, as reconcile uses it: where the consumer stands, and re-publishing.

One NATS connection, opened on first use and shared by the keys worked on at once. Driver
errors (nats) become domain errors here.
"""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker import streams
from charge_worker.errors import DependencyUnavailable, PermanentError, TransientError
from charge_worker.settings import NatsSettings


class NatsRepublisher:
    """The charges stream over one NATS connection, opened on first use."""

    def __init__(self, cfg: NatsSettings) -> None:
        self.cfg = cfg
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.connecting = asyncio.Lock()  # keys re-published at once share one connection

    async def __aenter__(self) -> NatsRepublisher:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self.nc is not None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self.nc.close()

    async def _connected(self) -> tuple[Client, JetStreamContext]:
        async with self.connecting:
            if self.nc is None or self.js is None:
                self.nc = await streams.connect(
                    self.cfg, name="charge-worker-reconcile", reconnect=False
                )
                self.js = self.nc.jetstream()
            return self.nc, self.js

    async def position(self) -> streams.Position:
        """Where the consumer stands: which quiet rows still have a message waiting."""
        nc, _ = await self._connected()
        return await streams.position(nc, self.cfg)

    async def paused(self) -> str | None:
        """Who paused the charges consumer, when and why (`charge-worker pause`); None when
        it delivers (or does not exist). `DependencyUnavailable` when NATS cannot say."""
        _, js = await self._connected()
        state = await streams.pause_state(js, self.cfg)
        return state.line() if state is not None and state.paused else None

    async def republish(self, body: bytes, msg_id: str, *, traceparent: str | None) -> int:
        """Publish and wait for the stream's ack; return its sequence. The message carries
        `traceparent` when the row names one."""
        _, js = await self._connected()
        subject = self.cfg.subject
        headers = {"Nats-Msg-Id": msg_id}
        if traceparent:
            headers["traceparent"] = traceparent
        try:
            ack = await js.publish(subject, body, headers=headers)
        except (nats.js.errors.ServiceUnavailableError, nats.js.errors.ServerError) as error:
            raise DependencyUnavailable(f"JetStream could not store {subject}: {error}") from error
        except nats.js.errors.APIError as error:
            raise PermanentError(f"JetStream refused the message: {error.description}") from error
        except (nats.errors.Error, OSError) as error:
            raise DependencyUnavailable(f"NATS publish to {subject}: {error!r}") from error
        if ack.duplicate:  # only another publish with this msg id in the same second
            raise TransientError(f"JetStream dropped {msg_id} as a duplicate")
        return ack.seq
