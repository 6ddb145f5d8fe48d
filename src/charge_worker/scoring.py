"""The anti-fraud scoring client (docs/contracts/scoring.md) and its fallback policy.

A verdict is `approve` or `block`. Anything else — a timeout of the whole call (2 s by
default), a non-2xx answer, a malformed body, an open breaker — is a scoring failure, and
`score()` returns a `ScoringFailure` saying why instead of raising: the caller then applies
the policy (`defer`: charge now and record a deferred check; `hold`: retry later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import httpx

from charge_worker import tracing
from charge_worker.breaker import BreakerOpen
from charge_worker.deadline import Deadlines
from charge_worker.errors import DependencyUnavailable, OutcomeUnknown
from charge_worker.http import build_breaker, build_client
from charge_worker.settings import ScoringSettings, require


@dataclass(frozen=True)
class Verdict:
    decision: Literal["approve", "block"]
    score: float | None


@dataclass(frozen=True)
class ScoringFailure:
    """Why there is no verdict; becomes the deferred check's reason."""

    reason: str


class ScoringClient:
    def __init__(
        self, cfg: ScoringSettings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.timeout_s = cfg.scoring_timeout_s
        self.policy = cfg.scoring_policy
        self.client = build_client(
            require(cfg.url, "SCORING_URL"),
            timeout_s=cfg.scoring_timeout_s,
            max_connections=100,
            transport=transport,
        )
        self.breaker = build_breaker(
            "scoring", fail_max=cfg.scoring_breaker_failures, reset_s=cfg.scoring_breaker_reset_s
        )
        self.deadlines = Deadlines()

    async def aclose(self) -> None:
        await self.client.aclose()

    @property
    def available(self) -> bool:
        """Closed, or open long enough that the next call is the half-open probe.

        The breaker half-opens only on a call: a caller that waited for "closed" would wait
        forever once nothing else calls (the deferred checks after the peak)."""
        return self.breaker.open_for_s() == 0.0

    async def score(
        self,
        *,
        order_id: int,
        customer_id: str,
        amount_minor: int,
        currency: str,
        traceparent: str | None = None,
    ) -> Verdict | ScoringFailure:
        """A verdict, or the reason there is none. Never raises for the service's faults.

        One `charge.score` span, with the verdict or the failure on it."""
        with tracing.span("charge.score") as span:
            verdict = await self._score(order_id, customer_id, amount_minor, currency, traceparent)
            if isinstance(verdict, ScoringFailure):
                span.set_attributes(
                    {
                        "charge_worker.scoring": "failed",
                        "charge_worker.scoring_error": verdict.reason,
                    }
                )
            else:
                span.set_attribute("charge_worker.scoring", verdict.decision)
            return verdict

    async def _score(
        self,
        order_id: int,
        customer_id: str,
        amount_minor: int,
        currency: str,
        traceparent: str | None,
    ) -> Verdict | ScoringFailure:
        body = {
            "order_id": order_id,
            "customer_id": customer_id,
            "amount_minor": amount_minor,
            "currency": currency,
        }
        headers = {"traceparent": traceparent} if traceparent else None
        try:
            with self.breaker:  # inside: a timeout or a bad answer counts toward it
                try:
                    async with self.deadlines.within(self.timeout_s):
                        response = await self.client.post("/v1/score", json=body, headers=headers)
                except TimeoutError as error:
                    raise OutcomeUnknown(f"scoring timed out after {self.timeout_s:g}s") from error
                except httpx.HTTPError as error:
                    raise DependencyUnavailable(f"scoring unreachable: {error!r}") from error
                return _verdict(response)
        except BreakerOpen:
            return ScoringFailure("scoring breaker open")
        except (OutcomeUnknown, DependencyUnavailable) as error:
            return ScoringFailure(str(error))


def _verdict(response: httpx.Response) -> Verdict:
    """The verdict an answer carries; `OutcomeUnknown` when it carries none."""
    if response.status_code != 200:
        raise OutcomeUnknown(f"scoring answered {response.status_code}")
    try:
        data = response.json()
        decision = data["decision"]
    except (ValueError, KeyError, TypeError) as error:
        raise OutcomeUnknown("scoring answered a malformed body") from error
    if decision not in ("approve", "block"):
        raise OutcomeUnknown(f"scoring answered an unknown decision {decision!r:.40}")
    score = data.get("score")
    return Verdict(decision, float(score) if isinstance(score, int | float) else None)
