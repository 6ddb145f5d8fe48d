"""`charge-worker sandbox gateway|scoring` served standalone, as an operator would run them."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from charge_worker.sandbox.embedded import free_port
from tests.support.harness import eventually


async def _answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as client:
            return (await client.get(f"{url}/_sim/stats")).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize(
    ("which", "path", "body", "expected"),
    [
        (
            "gateway",
            "/v1/charges",
            {
                "amount": 100,
                "currency": "EUR",
                "customer": "cus_1",
                "metadata": {"order_id": "1", "billing_period": "2026-12-01"},
            },
            "succeeded",
        ),
        (
            "scoring",
            "/v1/score",
            {"order_id": 1, "customer_id": "cus_block_1", "amount_minor": 100, "currency": "EUR"},
            "block",
        ),
    ],
)
async def test_simulator_serves_until_sigterm(
    which: str, path: str, body: dict[str, object], expected: str
) -> None:
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220  # starting is instant; nothing else runs
        [sys.executable, "-m", "charge_worker", "sandbox", which, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await eventually(lambda: _answers(url), f"the {which} simulator answering")
        headers = {"Authorization": "Bearer sk_test_sandbox", "Idempotency-Key": "1:2026-12-01"}
        async with httpx.AsyncClient(base_url=url) as client:
            answer = (await client.post(path, json=body, headers=headers)).json()
        assert expected in (answer.get("status"), answer.get("decision"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
