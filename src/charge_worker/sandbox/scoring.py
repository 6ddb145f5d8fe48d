"""An anti-fraud scoring simulator implementing `docs/contracts/scoring.md`.

`build_scoring_app(ScoringConfig(...))` returns a Starlette app; its `ScoringSimulator` is
`app.state.sim`.

`POST /v1/score` takes `{"order_id": int, "customer_id": str, "amount_minor": positive int,
"currency": str}` (`422` otherwise; bools are not ints) and answers `200 {"decision",
"score", "model_version": "sim-1"}`. Block rule: a `customer_id` starting with `cus_block`
is `block` (score 0.9..1), anything else `approve` (score 0..0.3).

Knobs (`ScoringConfig`, also `POST /_sim/config` at runtime):

* `latency`: a `LatencyModel`, default fixed 5 ms. `ScoringConfig.incident()` is the shape
  of the incident every load test uses: p50 30 ms, p99 1.2 s, and 2 % of calls at 6-8 s;
* after the latency, one draw picks at most one fault: `hang_rate` (no answer for `hang_s`,
  120 s, cut short when the client hangs up; then `504`), `error_rate` (`500`),
  `malformed_rate` (`200` whose body is not JSON, or has an unknown decision);
* `seed` (`None`: random).

`GET /_sim/stats`: calls, invalid calls, answers by decision, errors, hangs, malformed
answers. `/_sim/config` and `/_sim/reset` as in `simulator.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from charge_worker.sandbox.latency import LatencyModel
from charge_worker.sandbox.simulator import Simulator, pause, read_json

BLOCK_PREFIX = "cus_block"
MODEL_VERSION = "sim-1"
INCIDENT_LATENCY = LatencyModel.quantiles(
    0.030, 1.2, slow_fraction=0.02, slow_min_s=6, slow_max_s=8
)


class ScoringConfig(BaseModel):
    """The scoring simulator's knobs (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    latency: LatencyModel = LatencyModel.fixed(0.005)
    error_rate: float = Field(0.0, ge=0, le=1)
    hang_rate: float = Field(0.0, ge=0, le=1)
    hang_s: float = Field(120.0, ge=0)
    malformed_rate: float = Field(0.0, ge=0, le=1)
    seed: int | None = None

    @model_validator(mode="after")
    def _rates_fit(self) -> Self:
        if self.error_rate + self.hang_rate + self.malformed_rate > 1:
            raise ValueError("error_rate + hang_rate + malformed_rate is more than 1")
        return self

    @classmethod
    def incident(cls, **knobs: Any) -> ScoringConfig:
        """The incident's latency (p50 30 ms, p99 1.2 s, 2 % at 6-8 s), other knobs as given."""
        return cls(latency=INCIDENT_LATENCY, **knobs)


def _problems(body: Any) -> list[dict[str, str]]:
    """What is wrong with a score request, one entry per field."""
    if not isinstance(body, dict):
        return [{"field": "body", "message": "must be a JSON object"}]
    checks: dict[str, Callable[[Any], bool]] = {
        "order_id": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "customer_id": lambda v: isinstance(v, str) and bool(v),
        "amount_minor": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
        "currency": lambda v: isinstance(v, str) and bool(v),
    }
    expected = {
        "order_id": "an integer",
        "customer_id": "a non-empty string",
        "amount_minor": "a positive integer",
        "currency": "a non-empty string",
    }
    return [
        {"field": name, "message": f"must be {expected[name]}"}
        for name, valid in checks.items()
        if name not in body or not valid(body[name])
    ]


class ScoringSimulator(Simulator[ScoringConfig]):
    """The scoring service's counters and its handler."""

    @property
    def seed(self) -> int | None:
        """The configured seed."""
        return self.config.seed

    def clear(self) -> None:
        """Forget every counter."""
        self.calls = 0
        self.invalid = 0
        self.by_decision: Counter[str] = Counter()
        self.errors = 0
        self.hangs = 0
        self.malformed = 0

    def stats(self) -> dict[str, Any]:
        """Calls, invalid calls, answers by decision, errors, hangs, malformed answers."""
        return {
            "calls": self.calls,
            "invalid": self.invalid,
            "by_decision": dict(self.by_decision),
            "errors": self.errors,
            "hangs": self.hangs,
            "malformed": self.malformed,
        }

    def routes(self) -> list[Route]:
        """Every route of the simulator."""
        return [Route("/v1/score", self.score, methods=["POST"]), *self.control_routes()]

    async def score(self, request: Request) -> Response:
        """`POST /v1/score`."""
        self.calls += 1
        body = await read_json(request)
        if problems := _problems(body):
            self.invalid += 1
            return JSONResponse({"detail": problems}, status_code=422)
        config = self.config
        await pause(request, config.latency.sample(self.rng))
        draw = self.rng.random()
        if draw < config.hang_rate:
            self.hangs += 1
            await pause(request, config.hang_s)
            return JSONResponse({"error": "scoring timed out"}, status_code=504)
        draw -= config.hang_rate
        if draw < config.error_rate:
            self.errors += 1
            return JSONResponse({"error": "simulated failure"}, status_code=500)
        draw -= config.error_rate
        if draw < config.malformed_rate:
            self.malformed += 1
            return self._malformed()
        blocked = body["customer_id"].startswith(BLOCK_PREFIX)
        decision = "block" if blocked else "approve"
        score = 0.9 + 0.1 * self.rng.random() if blocked else 0.3 * self.rng.random()
        self.by_decision[decision] += 1
        return JSONResponse(
            {"decision": decision, "score": round(score, 4), "model_version": MODEL_VERSION}
        )

    def _malformed(self) -> Response:
        if self.rng.random() < 0.5:
            return Response("<html>upstream glitch</html>", media_type="text/html")
        return JSONResponse({"decision": "maybe", "score": 0.5, "model_version": MODEL_VERSION})


def build_scoring_app(config: ScoringConfig | None = None) -> Starlette:
    """The scoring simulator as an ASGI app; its `ScoringSimulator` is `app.state.sim`."""
    sim = ScoringSimulator(config or ScoringConfig())
    app = Starlette(routes=sim.routes())
    app.state.sim = sim
    return app
