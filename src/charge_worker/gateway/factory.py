"""The one place an adapter is chosen: `GATEWAY_KIND` (`contract`, the default, `stripe` or
`yookassa`)."""

from __future__ import annotations

from charge_worker.gateway.contract import ContractGateway
from charge_worker.gateway.protocol import Gateway
from charge_worker.ratelimit import RateLimiter
from charge_worker.settings import GatewaySettings


def build_gateway(cfg: GatewaySettings, *, limiter: RateLimiter | None = None) -> Gateway:
    """The configured adapter, with the fleet's rate limiter (every request spends a token).

    Raises `SettingsError` naming the setting when the adapter cannot be built as set.
    """
    if cfg.kind == "stripe":
        # imported here: the SDK costs every other command a tenth of a second to load
        from charge_worker.gateway.stripe import StripeGateway  # noqa: PLC0415

        return StripeGateway(cfg, limiter=limiter)
    if cfg.kind == "yookassa":
        from charge_worker.gateway.yookassa import YooKassaGateway  # noqa: PLC0415

        return YooKassaGateway(cfg, limiter=limiter)
    return ContractGateway(cfg, limiter=limiter)
