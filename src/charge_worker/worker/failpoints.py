"""Failpoints: named places in the worker where a test can make it die or fail on purpose.

`CHARGE_WORKER_FAILPOINTS=after_gateway_response_before_commit:exit:0.2,after_claim:raise`
makes the worker kill itself (SIGKILL, no cleanup: a pod killed at that line) with
probability 0.2 right after the gateway answered, and raise at every claim. Unset, every
`hit()` is a dictionary miss and nothing else.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass

from charge_worker.errors import SettingsError

POINTS = frozenset(
    {
        "after_claim",
        "after_scoring",
        "before_gateway_call",
        "after_gateway_response_before_commit",
        "after_commit_before_ack",
        "after_dead_letter_before_term",
        "after_outcome_publish_before_mark",
    }
)
ACTIONS = frozenset({"exit", "raise"})


class FailpointTriggered(RuntimeError):
    """Raised by a failpoint whose action is `raise`."""


@dataclass(frozen=True)
class _Point:
    action: str
    probability: float


def parse(spec: str) -> dict[str, _Point]:
    """Parse `name:action[:probability]`, comma-separated; raise ValueError naming the bad part."""
    points: dict[str, _Point] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rest = part.partition(":")
        action, _, probability = rest.partition(":")
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(POINTS))}")
        if action not in ACTIONS:
            raise ValueError(f"failpoint {name}: action must be one of {sorted(ACTIONS)}")
        try:
            chance = float(probability or 1.0)
        except ValueError as error:
            raise ValueError(f"failpoint {name}: probability {probability!r}") from error
        if not 0 <= chance <= 1:
            raise ValueError(f"failpoint {name}: probability must be within 0..1")
        points[name] = _Point(action, chance)
    return points


class Failpoints:
    def __init__(self, spec: str = "", *, seed: int | None = None) -> None:
        try:
            self.points = parse(spec)
        except ValueError as error:
            raise SettingsError(f"CHARGE_WORKER_FAILPOINTS: {error}") from error
        self.rng = random.Random(seed)  # noqa: S311  # chaos, not secrets

    def hit(self, name: str) -> None:
        point = self.points.get(name)
        if point is None or self.rng.random() >= point.probability:
            return
        if point.action == "exit":
            os.kill(os.getpid(), signal.SIGKILL)
        raise FailpointTriggered(name)
