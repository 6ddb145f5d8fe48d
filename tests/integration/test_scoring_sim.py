"""The scoring simulator over real HTTP: docs/contracts/scoring.md and its failure knobs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from charge_worker.sandbox.latency import LatencyModel
from charge_worker.sandbox.scoring import ScoringConfig, build_scoring_app
from charge_worker.sandbox.serve import ServedApp


@pytest.fixture
def scoring() -> Iterator[ServedApp]:
    with ServedApp(build_scoring_app(ScoringConfig(seed=7))) as served:
        yield served


@pytest.fixture
async def client(scoring: ServedApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=scoring.url, timeout=10) as client:
        yield client


def request_body(customer_id: Any = "cus_42", **fields: Any) -> dict[str, Any]:
    return {
        "order_id": 48291,
        "customer_id": customer_id,
        "amount_minor": 99000,
        "currency": "RUB",
    } | fields


async def configure(client: httpx.AsyncClient, **knobs: Any) -> None:
    response = await client.post("/_sim/config", json=knobs)
    assert response.status_code == 200, response.text


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    body: dict[str, Any] = (await client.get("/_sim/stats")).json()
    return body


async def test_an_ordinary_customer_is_approved(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/score",
        json=request_body(),
        headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
    )

    assert response.status_code == 200
    body = response.json()
    assert (body["decision"], body["model_version"]) == ("approve", "sim-1")
    assert 0 <= body["score"] <= 1


async def test_a_cus_block_customer_is_blocked(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/score", json=request_body("cus_block_9"))

    assert response.status_code == 200
    body = response.json()
    assert body["decision"] == "block"
    assert 0 <= body["score"] <= 1
    await client.post("/v1/score", json=request_body())
    assert (await stats(client))["by_decision"] == {"block": 1, "approve": 1}


@pytest.mark.parametrize(
    "body",
    [
        request_body(order_id="48291"),
        request_body(order_id=True),
        request_body(amount_minor=0),
        request_body(amount_minor=990.0),
        request_body(amount_minor=False),
        request_body(customer_id=42),
        request_body(currency=None),
        {"order_id": 48291},
        [1, 2, 3],
    ],
)
async def test_a_bad_request_is_422(client: httpx.AsyncClient, body: Any) -> None:
    response = await client.post("/v1/score", json=body)

    assert response.status_code == 422
    assert response.json()["detail"]
    assert (await stats(client))["invalid"] == 1


async def test_a_body_that_is_not_json_is_422(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/score", content=b"order_id=1")
    assert response.status_code == 422


async def test_error_rate_one_answers_500(client: httpx.AsyncClient) -> None:
    await configure(client, error_rate=1.0)

    response = await client.post("/v1/score", json=request_body())

    assert response.status_code == 500
    assert (await stats(client))["errors"] == 1


def _is_valid_answer(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except json.JSONDecodeError:
        return False
    return response.status_code == 200 and body.get("decision") in ("approve", "block")


async def test_malformed_answers_are_200_but_unusable(client: httpx.AsyncClient) -> None:
    await configure(client, malformed_rate=1.0)

    answers = [await client.post("/v1/score", json=request_body()) for _ in range(20)]

    assert {r.status_code for r in answers} == {200}
    assert not any(_is_valid_answer(r) for r in answers)
    kinds = {r.headers["content-type"].split(";")[0] for r in answers}
    assert kinds == {"text/html", "application/json"}
    assert (await stats(client))["malformed"] == 20


async def test_a_hang_outlasts_the_client_timeout(client: httpx.AsyncClient) -> None:
    await configure(client, hang_rate=1.0)

    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/score", json=request_body(), timeout=0.3)

    assert (await stats(client))["hangs"] == 1


async def test_rates_are_drawn_per_call(client: httpx.AsyncClient) -> None:
    await configure(client, error_rate=0.5)

    answers = [(await client.post("/v1/score", json=request_body())).status_code for _ in range(40)]

    assert set(answers) == {200, 500}


async def test_bad_knobs_are_422_and_reset_restores(client: httpx.AsyncClient) -> None:
    initial = (await client.get("/_sim/config")).json()
    too_much = await client.post("/_sim/config", json={"error_rate": 0.6, "hang_rate": 0.6})
    assert too_much.status_code == 422

    await configure(client, error_rate=1.0)
    await client.post("/v1/score", json=request_body())
    await client.post("/_sim/reset")

    assert (await client.get("/_sim/config")).json() == initial
    assert (await stats(client))["calls"] == 0
    assert (await client.post("/v1/score", json=request_body())).status_code == 200


def test_the_default_is_fast() -> None:
    assert ScoringConfig().latency == LatencyModel.fixed(0.005)


def test_the_incident_preset_has_the_incident_shape() -> None:
    config = ScoringConfig.incident(seed=3)

    assert config.latency == LatencyModel.quantiles(
        0.030, 1.2, slow_fraction=0.02, slow_min_s=6, slow_max_s=8
    )
    assert config.seed == 3
    assert config.error_rate == config.hang_rate == config.malformed_rate == 0


async def test_the_incident_latency_can_be_switched_on_at_runtime(
    client: httpx.AsyncClient,
) -> None:
    incident = ScoringConfig.incident().latency.model_dump(mode="json")

    await configure(client, latency=incident)

    assert (await client.get("/_sim/config")).json()["latency"] == incident
