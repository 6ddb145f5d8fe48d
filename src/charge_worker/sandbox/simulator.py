"""What every simulator shares: runtime knobs, a seeded RNG, and the `/_sim/*` control routes.

Control routes (no auth, JSON):

* `GET /_sim/config`: the current knobs;
* `POST /_sim/config`: a partial update (top-level fields; a nested model is replaced whole),
  answers the new knobs, or `422` with the validation errors; a new `seed` reseeds the RNG;
* `POST /_sim/reset`: forget all state and counters, restore the knobs the app was built with;
* `GET /_sim/stats`: counters (each simulator defines its own).

State lives on one event loop and changes only in synchronous code between awaits, so every
change is atomic without a lock.
"""

from __future__ import annotations

import asyncio
import json
import random
from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class Simulator(ABC, Generic[ConfigT]):
    """Knobs, RNG and control routes; subclasses add state (`clear`), counters and routes."""

    def __init__(self, config: ConfigT) -> None:
        self._initial = config
        self.config = config
        self.rng = random.Random(self.seed)
        self.clear()

    @property
    @abstractmethod
    def seed(self) -> int | None:
        """The RNG seed the current knobs ask for (`None`: from OS entropy)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget all state and counters."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for `GET /_sim/stats`."""

    def update_config(self, patch: dict[str, Any]) -> ConfigT:
        """Apply a partial update of the knobs; raises `ValidationError`, changing nothing."""
        merged = {**self.config.model_dump(), **patch}
        self.config = type(self.config).model_validate(merged)
        if "seed" in patch:
            self.rng.seed(self.seed)
        return self.config

    def reset(self) -> None:
        """Forget everything, including runtime knob changes."""
        self.config = self._initial
        self.rng.seed(self.seed)
        self.clear()

    def control_routes(self) -> list[Route]:
        """The `/_sim/*` routes."""
        return [
            Route("/_sim/config", self._get_config, methods=["GET"]),
            Route("/_sim/config", self._post_config, methods=["POST"]),
            Route("/_sim/reset", self._post_reset, methods=["POST"]),
            Route("/_sim/stats", self._get_stats, methods=["GET"]),
        ]

    async def _get_config(self, request: Request) -> Response:
        return JSONResponse(self.config.model_dump(mode="json"))

    async def _post_config(self, request: Request) -> Response:
        patch = await read_json(request)
        if not isinstance(patch, dict):
            return JSONResponse({"detail": "the body must be a JSON object"}, status_code=422)
        try:
            config = self.update_config(patch)
        except ValidationError as exc:
            errors = json.loads(exc.json(include_url=False))
            return JSONResponse({"detail": errors}, status_code=422)
        return JSONResponse(config.model_dump(mode="json"))

    async def _post_reset(self, request: Request) -> Response:
        self.reset()
        return JSONResponse({"reset": True, "config": self.config.model_dump(mode="json")})

    async def _get_stats(self, request: Request) -> Response:
        return JSONResponse(self.stats())


async def read_json(request: Request) -> Any:
    """The request body as JSON, or `None` when it is empty or not JSON."""
    body = await request.body()
    try:
        return json.loads(body)
    except ValueError:
        return None


async def pause(request: Request, seconds: float) -> None:
    """Wait `seconds`, cut short when the client hangs up (nobody is left to answer)."""
    if seconds <= 0:
        return
    try:
        async with asyncio.timeout(seconds):
            while (await request.receive())["type"] != "http.disconnect":
                pass
    except TimeoutError:
        return
