"""The gateway seam: the `Gateway` protocol, its domain results, one adapter per provider.

`build_gateway(settings.gateway)` picks the adapter from `GATEWAY_KIND`: `contract`
(`contract.py`, docs/contracts/gateway.md; the default) or `stripe` (`stripe.py`). What an
adapter must guarantee is in `protocol.py` and docs/adapters.md; "done" is passing
tests/integration/test_gateway_conformance.py.
"""

from charge_worker.gateway.contract import ContractGateway
from charge_worker.gateway.factory import build_gateway
from charge_worker.gateway.protocol import Gateway, GatewayKind, HistoryOrder, WebhookScheme
from charge_worker.gateway.results import (
    AUTHENTICATION_REQUIRED,
    CARD_DECLINED,
    ChargeResult,
    GatewayCharge,
    HistoryPage,
    decline_kind,
    period_answer,
)

GatewayClient = Gateway  # the name callers knew before the seam: any adapter

__all__ = [
    "AUTHENTICATION_REQUIRED",
    "CARD_DECLINED",
    "ChargeResult",
    "ContractGateway",
    "Gateway",
    "GatewayCharge",
    "GatewayClient",
    "GatewayKind",
    "HistoryOrder",
    "HistoryPage",
    "WebhookScheme",
    "build_gateway",
    "decline_kind",
    "period_answer",
]
