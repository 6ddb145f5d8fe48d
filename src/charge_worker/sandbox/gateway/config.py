"""The gateway simulator's knobs (`GatewayConfig`); what each one does is told in `app.py`
(and for a flavour's own, in `stripe.py` and `yookassa.py`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from charge_worker.errors import SettingsError
from charge_worker.sandbox.gateway.webhooks import (
    CONTRACT_RETRY_SCHEDULE_S,
    YOOKASSA_RETRY_SCHEDULE_S,
)
from charge_worker.sandbox.latency import LatencyModel
from charge_worker.webhooks.signature import check_secret

# public, like the sandbox API keys of `SANDBOX_API_KEYS`
SANDBOX_WEBHOOK_SECRET = "whsec_Y2hhcmdlLXdvcmtlci1zYW5kYm94LXdlYmhvb2tz"  # noqa: S105
# the `/v1` endpoints of each flavour, as `/_sim/stats` names them (`endpoint_latency`)
ENDPOINTS: dict[str, tuple[str, ...]] = {
    "contract": ("POST /v1/charges", "GET /v1/charges", "POST /v1/refunds"),
    "stripe": (
        "GET /v1/customers/{id}",
        "GET /v1/payment_methods",
        "POST /v1/payment_intents",
        "GET /v1/payment_intents",
        "GET /v1/payment_intents/{id}",
        "POST /v1/refunds",
    ),
    "yookassa": (
        "POST /v3/payments",
        "GET /v3/payments",
        "GET /v3/payments/{id}",
        "POST /v3/refunds",
    ),
}
# each flavour's sandbox credentials, the `api_key` default: a bearer token, or YooKassa's
# `<shopId>:<secret key>` for HTTP Basic auth
SANDBOX_API_KEYS = {
    "contract": "sk_test_sandbox",
    "stripe": "sk_test_sandbox",
    "yookassa": "100500:test_sandbox",
}
# each flavour's webhook retries, the `webhook_retry_schedule_s` default
RETRY_SCHEDULES_S = {"yookassa": YOOKASSA_RETRY_SCHEDULE_S}


class GatewayConfig(BaseModel):
    """The gateway simulator's knobs (see `charge_worker.sandbox.gateway.app`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the wire format: docs/contracts/gateway.md, or Stripe's subset (`stripe.py`), or
    # YooKassa's (`yookassa.py`)
    flavour: Literal["contract", "stripe", "yookassa"] = "contract"
    api_key: str = SANDBOX_API_KEYS["contract"]  # unless given: the flavour's sandbox key
    latency: LatencyModel = LatencyModel()
    # an endpoint of `ENDPOINTS` -> its own latency, instead of `latency`
    endpoint_latency: dict[str, LatencyModel] = Field(default_factory=dict)
    error_rates: dict[int, float] = Field(default_factory=dict)
    retry_after_s: int = Field(1, ge=0)
    rate_limit_per_s: float | None = Field(None, gt=0)  # the account's request rate
    lost_answer_rate: float = Field(0.0, ge=0, le=1)
    lost_answer_mode: Literal["timeout", "5xx"] = "timeout"
    lost_answer_delay_s: float = Field(30.0, ge=0)
    idempotency_enabled: bool = True
    # Stripe and YooKassa flavours: how long a `cus_processing…` payment stays pending
    processing_settle_s: float = Field(1.0, ge=0)
    # Stripe flavour: false, no customer has an invoice default payment method (its card is
    # only listed), so a charge is three requests: the customer, its cards, the intent
    invoice_default: bool = True
    key_retention_s: float = Field(86400.0, gt=0)
    # a customer -> the first try its card is charged on; declined `insufficient_funds`
    # before it (`cards.py`: as a `cus_soft<k>…` customer)
    succeeds_on_try: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    seed: int | None = None
    webhook_url: str | None = None
    webhook_secret: str = SANDBOX_WEBHOOK_SECRET
    # unless given: the flavour's (`RETRY_SCHEDULES_S`), else the contract's
    webhook_retry_schedule_s: tuple[float, ...] = CONTRACT_RETRY_SCHEDULE_S
    webhook_time_scale: float = Field(1.0, gt=0)
    webhook_timeout_s: float = Field(5.0, gt=0)
    webhook_reorder: float = Field(0.0, ge=0, le=1)
    webhook_reorder_delay_s: float = Field(1.0, ge=0)
    webhook_duplicate: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _flavour_defaults(cls, data: Any) -> Any:
        """The flavour's own defaults for the knobs not given (or given as null)."""
        if not isinstance(data, dict):
            return data
        flavour, data = data.get("flavour", "contract"), dict(data)
        for name, default in (
            ("api_key", SANDBOX_API_KEYS.get(flavour)),
            ("webhook_retry_schedule_s", RETRY_SCHEDULES_S.get(flavour)),
        ):
            if data.get(name) is None and default is not None:
                data[name] = default
        return data

    @field_validator("webhook_secret")
    @classmethod
    def _whsec(cls, value: str) -> str:
        try:
            return check_secret(value)
        except SettingsError as error:
            raise ValueError(str(error)) from error

    @field_validator("webhook_retry_schedule_s")
    @classmethod
    def _non_negative(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(step < 0 for step in value):
            raise ValueError("webhook_retry_schedule_s: every step must be >= 0 seconds")
        return value

    @model_validator(mode="after")
    def _known_endpoints(self) -> Self:
        if unknown := sorted(set(self.endpoint_latency) - set(ENDPOINTS[self.flavour])):
            raise ValueError(
                f"endpoint_latency: {unknown} not among the {self.flavour} flavour's "
                f"endpoints {list(ENDPOINTS[self.flavour])}"
            )
        return self

    @model_validator(mode="after")
    def _valid_error_rates(self) -> Self:
        for status, rate in self.error_rates.items():
            if status != 429 and not 500 <= status <= 599:
                raise ValueError(f"error_rates: {status} is not 429 or 5xx")
            if not 0 <= rate <= 1:
                raise ValueError(f"error_rates: {status} rate {rate} is not in 0..1")
        if sum(self.error_rates.values()) > 1:
            raise ValueError("error_rates add up to more than 1")
        return self
