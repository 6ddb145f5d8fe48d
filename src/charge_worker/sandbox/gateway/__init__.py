"""The payment gateway simulator (docs/contracts/gateway.md), for the demo, tests and benchmarks."""

from charge_worker.sandbox.gateway.app import GatewayConfig, build_gateway_app

__all__ = ["GatewayConfig", "build_gateway_app"]
