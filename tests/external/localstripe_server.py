"""localstripe (a stateful Stripe fake by others, on PyPI) as a child process, and the test's
workarounds for where it differs from Stripe's documentation (docs/adapters.md lists each).

The adapter talks to Stripe as Stripe documents it; where localstripe does not, `shim_app`
stands between them and answers as Stripe would, never the adapter:

* `GET /v1/payment_intents`: localstripe refuses `customer` and `created[…]` (400) and lists
  oldest first; the shim reads every intent from it and filters, orders newest first and
  pages as Stripe does (`limit`, `starting_after`);
* `POST /v1/refunds`: localstripe refuses `reason` (400 `Unexpected reason`) and refunds a
  refunded charge again; the shim drops `reason` and answers a second refund with Stripe's
  `400 charge_already_refunded`.

Everything else goes through unchanged. localstripe keeps no idempotency keys at all: the
worker's ledger and lookups alone keep a key from being charged twice (idempotency off).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-localstripe" / "bin" / "python"
LAUNCHER = Path(__file__).with_name("run_localstripe.py")
API_KEY = "sk_test_localstripe"  # localstripe takes any sk_ key
GOOD_CARD = "4242424242424242"
# localstripe declines at charge time only with this card (4000000000000002, the issue's
# example, is declined when attached, and charges fine unattached)
DECLINED_CARD = "4000000000000341"
NOT_INSTALLED = (
    "localstripe is not installed in .venv-localstripe: run"
    " `make .venv-localstripe/.installed` (pip install localstripe==1.15.10 from the registry)"
)


def not_installed() -> str | None:
    """Why the external tier cannot run here, or None."""
    if not PYTHON.exists():
        return NOT_INSTALLED
    found = subprocess.run(
        [str(PYTHON), "-c", "import localstripe"], capture_output=True, check=False, timeout=60
    )
    return None if found.returncode == 0 else f"{NOT_INSTALLED}; import failed"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def localstripe(log: Path) -> Iterator[str]:
    """localstripe on a free loopback port, its URL while inside; stopped after."""
    port = _free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(PYTHON), str(LAUNCHER), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/v1/customers", auth=(API_KEY, ""), trust_env=False).is_success:
                    break
            assert time.monotonic() < deadline, "localstripe did not answer within 30 s"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stripe_error(status: int, code: str, message: str) -> JSONResponse:
    body = {"error": {"type": "invalid_request_error", "code": code, "message": message}}
    return JSONResponse(body, status_code=status)


def shim_app(upstream: str) -> Starlette:
    """localstripe as Stripe documents it, for the subset the adapter uses (module doc)."""
    client = httpx.AsyncClient(base_url=upstream, trust_env=False, timeout=30)

    async def forward(request: Request, body: bytes | None = None) -> Response:
        answer = await client.request(
            request.method,
            request.url.path,
            params=request.url.query,
            content=await request.body() if body is None else body,
            headers={
                k: v
                for k, v in request.headers.items()
                if k.lower() in ("authorization", "content-type", "idempotency-key")
            },
        )
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
        )

    async def every_intent(request: Request) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        after: str | None = None
        auth = {"authorization": request.headers.get("authorization", "")}
        while True:
            params = {"limit": "100"} | ({"starting_after": after} if after else {})
            page = (await client.get("/v1/payment_intents", params=params, headers=auth)).json()
            found += page["data"]
            if not page.get("has_more") or not page["data"]:
                return found
            after = page["data"][-1]["id"]

    async def list_intents(request: Request) -> Response:
        query = dict(parse_qsl(request.url.query))
        intents = list(enumerate(await every_intent(request)))
        bounds = {
            "gte": lambda c, v: c >= v,
            "gt": lambda c, v: c > v,
            "lte": lambda c, v: c <= v,
            "lt": lambda c, v: c < v,
        }
        for name, holds in bounds.items():
            if (value := query.get(f"created[{name}]")) is not None:
                intents = [(i, pi) for i, pi in intents if holds(pi["created"], int(value))]
        if customer := query.get("customer"):
            intents = [(i, pi) for i, pi in intents if pi.get("customer") == customer]
        # newest first; localstripe's `created` has 1 s resolution: its order breaks ties
        ordered = [pi for _, pi in sorted(intents, key=lambda x: (x[1]["created"], x[0]))][::-1]
        if after := query.get("starting_after"):
            ids = [pi["id"] for pi in ordered]
            ordered = ordered[ids.index(after) + 1 :] if after in ids else []
        limit = int(query.get("limit", "10"))
        return JSONResponse(
            {
                "object": "list",
                "url": "/v1/payment_intents",
                "data": ordered[:limit],
                "has_more": len(ordered) > limit,
            }
        )

    async def create_refund(request: Request) -> Response:
        form = [(k, v) for k, v in parse_qsl((await request.body()).decode()) if k != "reason"]
        intent_id = dict(form).get("payment_intent")
        if intent_id:
            auth = {"authorization": request.headers.get("authorization", "")}
            intent = (await client.get(f"/v1/payment_intents/{intent_id}", headers=auth)).json()
            charge = intent.get("latest_charge") or {}
            if isinstance(charge, dict) and charge.get("refunded"):
                message = f"Charge {charge.get('id')} has already been refunded."
                return _stripe_error(400, "charge_already_refunded", message)
        return await forward(request, urlencode(form).encode())

    async def other(request: Request) -> Response:
        return await forward(request)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    methods = ["GET", "POST", "DELETE"]
    return Starlette(
        routes=[
            Route("/v1/payment_intents", list_intents, methods=["GET"]),
            Route("/v1/refunds", create_refund, methods=["POST"]),
            Route("/{path:path}", other, methods=methods),
        ],
        lifespan=lifespan,
    )


class Stripe:
    """Setting localstripe up and counting on it, over its API (not through the shim)."""

    def __init__(self, url: str) -> None:
        self.client = httpx.AsyncClient(base_url=url, auth=(API_KEY, ""), trust_env=False)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _post(self, path: str, data: dict[str, str]) -> dict[str, Any]:
        answer = await self.client.post(path, data=data)
        assert answer.is_success, f"{path}: {answer.status_code} {answer.text}"
        return dict(answer.json())

    async def customer_with_card(self, card: str) -> str:
        """A customer whose saved card (its default payment method) is `card`."""
        customer = (await self._post("/v1/customers", {"email": "billing@example.com"}))["id"]
        method = await self._post(
            "/v1/payment_methods",
            {
                "type": "card",
                "card[number]": card,
                "card[exp_month]": "12",
                "card[exp_year]": "2030",
                "card[cvc]": "123",
            },
        )
        await self._post(f"/v1/payment_methods/{method['id']}/attach", {"customer": customer})
        await self._post(
            f"/v1/customers/{customer}",
            {"invoice_settings[default_payment_method]": method["id"]},
        )
        return str(customer)

    async def webhooks_to(self, url: str, secret: str) -> None:
        """localstripe's own endpoint settings (it has no /v1/webhook_endpoints)."""
        answer = await self.client.post(
            "/_config/webhooks/charge-worker", data={"url": url, "secret": secret}
        )
        assert answer.is_success, answer.text

    async def intents(self) -> list[dict[str, Any]]:
        """Every PaymentIntent localstripe holds (its list, oldest first, every page)."""
        found: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            params = {"limit": "100"} | ({"starting_after": after} if after else {})
            page = (await self.client.get("/v1/payment_intents", params=params)).json()
            found += page["data"]
            if not page.get("has_more") or not page["data"]:
                return found
            after = page["data"][-1]["id"]
