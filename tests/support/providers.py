"""A payment provider's simulator over real HTTP and the adapter that speaks its wire
format: what the conformance suite, the integration tests and the chaos suite share.

`flavour` is the simulator's wire format (`contract`: docs/contracts/gateway.md; `stripe`:
Stripe's subset; `yookassa`: YooKassa's API v3 subset), which is also the `GATEWAY_KIND`
whose adapter speaks it. The simulator injects the faults (`configure`): lost answers, 5xx,
429, latency, idempotency off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import SecretStr

from charge_worker.gateway import Gateway, build_gateway
from charge_worker.messages import ChargeDue
from charge_worker.ratelimit import RateLimiter
from charge_worker.sandbox.gateway.app import GatewayConfig, build_gateway_app
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import GatewaySettings, NatsSettings, Settings
from tests.support.harness import settings_for

Flavour = Literal["contract", "stripe", "yookassa"]
FLAVOURS: tuple[Flavour, ...] = ("contract", "stripe", "yookassa")
API_KEY = "sk_test_sandbox"
# each flavour's sandbox credentials, and a well-formed wrong one
API_KEYS: dict[Flavour, tuple[str, str]] = {
    "contract": (API_KEY, "sk_test_wrong"),
    "stripe": (API_KEY, "sk_test_wrong"),
    "yookassa": ("100500:test_sandbox", "100500:test_wrong"),
}
# the decline cases of the conformance suite: customer -> the code its provider names
# (`sandbox/gateway/cards.py`), whose class the one table gives (`declines.py`)
CARD_DECLINES = {
    "cus_code_insufficient_funds_1": "insufficient_funds",
    "cus_code_do_not_honor_1": "do_not_honor",
    "cus_decline_1": "generic_decline",
    "cus_code_expired_card_1": "expired_card",
    "cus_auth_1": "authentication_required",
    "cus_code_stolen_card_1": "stolen_card",
    "cus_code_fraudulent_1": "fraudulent",
}
DECLINES: dict[Flavour, dict[str, str]] = {
    "contract": CARD_DECLINES,
    "stripe": CARD_DECLINES,
    "yookassa": {  # its cancellation reasons (ADR 0008)
        "cus_code_insufficient_funds_1": "insufficient_funds",
        "cus_code_issuer_unavailable_1": "issuer_unavailable",
        "cus_decline_1": "general_decline",
        "cus_code_card_expired_1": "card_expired",
        "cus_auth_1": "3d_secure_failed",
        "cus_code_permission_revoked_1": "permission_revoked",
        "cus_code_fraud_suspected_1": "fraud_suspected",
    },
}


@dataclass
class Provider:
    """A running simulator of one flavour."""

    flavour: Flavour
    served: ServedApp

    @property
    def url(self) -> str:
        return self.served.url

    @property
    def api_key(self) -> str:
        """The simulator's credentials, as `GATEWAY_API_KEY` spells them for the adapter."""
        return API_KEYS[self.flavour][0]

    @property
    def wrong_api_key(self) -> str:
        """Credentials of the right form that the simulator refuses."""
        return API_KEYS[self.flavour][1]

    @property
    def declines(self) -> dict[str, str]:
        """Customer -> the decline code this flavour answers its charge with."""
        return DECLINES[self.flavour]

    def settings(self, **overrides: Any) -> GatewaySettings:
        """Gateway settings that point the `flavour` adapter at this simulator."""
        values: dict[str, Any] = {
            "kind": self.flavour,
            "url": self.url,
            "api_key": SecretStr(self.api_key),
            "gateway_timeout_s": 5.0,
        }
        return GatewaySettings(**(values | overrides))

    def worker_settings(
        self, nats: NatsSettings, database_url: str, scoring_url: str, **overrides: Any
    ) -> Settings:
        """The harness's test settings (`settings_for`) with this flavour's adapter and
        credentials; `overrides` are field=value of any group."""
        return settings_for(
            nats,
            database_url,
            self.url,
            scoring_url,
            kind=self.flavour,
            api_key=self.api_key,
            **overrides,
        )

    def gateway(self, *, limiter: RateLimiter | None = None, **overrides: Any) -> Gateway:
        """The adapter of this flavour, built the way the commands build it."""
        return build_gateway(self.settings(**overrides), limiter=limiter)

    async def configure(self, **knobs: Any) -> None:
        """Change the simulator's knobs (`GatewayConfig` fields) at once."""
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(f"{self.url}/_sim/config", json=knobs)
            response.raise_for_status()

    async def charge_again(self, due_body: bytes) -> None:
        """A second charge of `due_body`'s key, made while the simulator checks no keys: the
        double charge reconcile must find and refund."""
        await self.configure(idempotency_enabled=False)
        gateway = self.gateway()
        try:
            await gateway.charge(ChargeDue.model_validate_json(due_body))
        finally:
            await gateway.aclose()
            await self.configure(idempotency_enabled=True)

    async def charges(self) -> list[dict[str, Any]]:
        """Every charge the simulator ever made, with its `idempotency_key`."""
        async with httpx.AsyncClient(trust_env=False) as client:
            return list((await client.get(f"{self.url}/_sim/charges")).json()["data"])

    async def made(self) -> Counter[str]:
        """Charges that took money, per idempotency key (refunded since or not)."""
        return Counter(
            c["idempotency_key"] for c in await self.charges() if c["status"] == "succeeded"
        )

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False) as client:
            return dict((await client.get(f"{self.url}/_sim/stats")).json())


@contextmanager
def provider(flavour: Flavour, **config: Any) -> Iterator[Provider]:
    """A fresh simulator of `flavour` on a free loopback port."""
    app = build_gateway_app(GatewayConfig(flavour=flavour, **({"seed": 1} | config)))
    with ServedApp(app) as served:
        yield Provider(flavour, served)


class CountingLimiter(RateLimiter):
    """A rate limiter that is off but counts the tokens spent: one per request."""

    def __init__(self) -> None:
        super().__init__(None, rate_per_s=0)
        self.spent = 0

    async def spend(self) -> None:
        self.spent += 1
        await super().spend()
