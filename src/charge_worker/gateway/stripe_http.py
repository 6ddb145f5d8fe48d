"""stripe-python's HTTP over the project's own client: httpx's API on aiohttp's transport,
pooled and limited as every dependency's (`http.build_client`).

Why not the SDK's own: `stripe.HTTPXClient` builds its own `httpx.AsyncClient` (no pool
limits, `trust_env` on) and posts the form as `data=<str>`, which httpx 0.28 answers with a
DeprecationWarning (an error under this project's `filterwarnings=error`, where it became
an `APIConnectionError` and nothing was sent); `stripe.AIOHTTPClient` keeps a session of its
own. This one sends `content=`, and keeps the transport error as `__cause__`, so the
adapter can tell a request never sent from an outcome unknown (`guard.never_sent`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any, NoReturn

import httpx
import stripe


class OwnedHTTPClient(stripe.HTTPClient):
    """A `stripe.HTTPClient` over an `httpx.AsyncClient` this process owns."""

    name = "httpx-owned"

    def __init__(self, client: httpx.AsyncClient) -> None:
        super().__init__()
        self.client = client

    async def request_async(
        self, method: str, url: str, headers: Mapping[str, str] | None, post_data: Any = None
    ) -> tuple[bytes, int, Mapping[str, str]]:
        """One request, no retries (the adapter passes `max_network_retries=0`)."""
        try:
            response = await self.client.request(
                method, url, headers=dict(headers or {}), content=post_data
            )
        except httpx.HTTPError as error:
            raise stripe.APIConnectionError(  # type: ignore[no-untyped-call]
                f"network error talking to the gateway: {type(error).__name__}",
                should_retry=True,
            ) from error
        return response.content, response.status_code, response.headers

    async def request_stream_async(
        self, method: str, url: str, headers: Mapping[str, str] | None, post_data: Any = None
    ) -> NoReturn:
        """Not used by the adapter."""
        raise NotImplementedError("streamed responses are not used")

    def sleep_async(self, secs: float) -> Awaitable[None]:
        """Between the SDK's own retries, which the adapter turns off."""
        return asyncio.sleep(secs)

    async def close_async(self) -> None:
        """Close the owned client's connections."""
        await self.client.aclose()
