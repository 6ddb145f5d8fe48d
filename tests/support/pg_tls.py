"""A TLS front for the embedded PostgreSQL, whose build (pgserver's) has no SSL.

PostgreSQL negotiates TLS inside its own protocol: the client sends an 8-byte SSLRequest,
the server answers `S`, and the TLS handshake follows on the same connection. This front
does exactly that with a certificate of the test's choosing, then relays the decrypted
stream to the real server, which sees an ordinary connection. A client that starts without
an SSLRequest (`sslmode=disable`) is relayed as it is. `handshakes` counts the TLS sessions
it completed, so a test can tell an encrypted connection from a plain one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

SSL_REQUEST = struct.pack("!II", 8, 80877103)


class PostgresTlsFront:
    """In front of the server `backend_url` names; `url()` is that URL through the front."""

    def __init__(self, backend_url: str, context: ssl.SSLContext) -> None:
        self.backend = urlsplit(backend_url)
        self.context = context
        self.handshakes = 0
        self.port = 0

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[PostgresTlsFront]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        async with server:
            yield self

    def url(self) -> str:
        user = self.backend.netloc.rpartition("@")[0]
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        return urlunsplit(self.backend._replace(netloc=netloc))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.readexactly(8)
            if first == SSL_REQUEST:
                writer.write(b"S")
                await writer.drain()
                await writer.start_tls(self.context)
                self.handshakes += 1
                first = b""
            up_reader, up_writer = await asyncio.open_connection(
                self.backend.hostname, self.backend.port or 5432
            )
            up_writer.write(first)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
            pass  # a refused handshake is what some tests are after
        finally:
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(OSError, ssl.SSLError):
            writer.close()
