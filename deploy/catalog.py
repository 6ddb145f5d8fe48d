"""charge-worker's settings as the chart sees them, read from `charge_worker.settings`.

Every environment variable falls in one class: a secret (only ever by reference from a
Secret), managed by the chart (it sets the variable itself), test-only (refused), or plain
configuration (the ConfigMap). Reading the classes from the settings model, not from a list
kept here, is what makes a new setting fail the check until the chart knows about it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import SecretStr
from pydantic_core import PydanticUndefined

from charge_worker.settings import ENV_PREFIX, Settings, env_name

# A DSN carries the role's password, though the model types it `str`.
SECRET_BY_NATURE = frozenset({"DATABASE_URL"})
# Set by the chart from other values (natsCredentials, natsTls and postgresTls mount the
# files and point here).
CHART_MANAGED = frozenset(
    {
        "CHARGE_WORKER_NATS_CREDS_FILE",
        "NATS_TLS_CERT",
        "NATS_TLS_KEY",
        "NATS_TLS_CA",
        "PGSSLMODE",
        "PGSSLROOTCERT",
    }
)
# The reliability suite's fault injection: never in a deployment.
TEST_ONLY = frozenset({"CHARGE_WORKER_FAILPOINTS"})


@dataclass(frozen=True)
class Setting:
    env: str
    default: Any
    secret: bool


def _mentions_secret(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    return any(_mentions_secret(arg) for arg in typing.get_args(annotation))


@cache
def settings() -> dict[str, Setting]:
    """Every setting by its environment variable, in the model's order."""
    found: dict[str, Setting] = {}
    for info in Settings.model_fields.values():
        group = info.annotation
        assert isinstance(group, type)
        for field, field_info in group.model_fields.items():
            env = env_name(group, field)
            default = None if field_info.default is PydanticUndefined else field_info.default
            secret = env in SECRET_BY_NATURE or _mentions_secret(field_info.annotation)
            found[env] = Setting(env, default, secret)
    return found


def secrets() -> frozenset[str]:
    return frozenset(env for env, s in settings().items() if s.secret)


def configurable() -> frozenset[str]:
    """The variables the chart's `config` may set: all but secrets, managed, test-only."""
    return frozenset(settings()) - secrets() - CHART_MANAGED - TEST_ONLY


def has_our_prefix(env: str) -> bool:
    """A name charge-worker would read, were it a setting (a typo of one, when it is not)."""
    return env.startswith(ENV_PREFIX)


def default(env: str) -> Any:
    return settings()[env].default


# Runs in the child: each environment in turn as the whole of os.environ, then load_settings().
_JUDGE = """
import json, os, sys
from charge_worker.settings import load_settings
verdicts = []
for environment in json.load(sys.stdin):
    os.environ.clear()
    os.environ.update(environment)
    try:
        load_settings()
    except Exception as error:
        why = f"{type(error).__module__}.{type(error).__name__}: {error}"
        verdicts.append(" ".join(why.split()))
    else:
        verdicts.append(None)
print(json.dumps(verdicts))
"""
_verdicts: dict[frozenset[tuple[str, str]], str | None] = {}


def charge_worker_accepts(environments: list[dict[str, str]]) -> list[str | None]:
    """For each environment, None when charge-worker's own `load_settings()` accepts it, else why.

    Judged in one child process, each environment alone in `os.environ` (and an empty
    working directory, so no `.env` is read): the same validation, cross-field rules
    included, a pod runs at start. Verdicts are remembered: the checks ask again for the
    same environments.
    """
    keys = [frozenset(environment.items()) for environment in environments]
    new = list(dict.fromkeys(key for key in keys if key not in _verdicts))
    if new:
        with tempfile.TemporaryDirectory() as empty:
            done = subprocess.run(  # noqa: S603  # our interpreter, a constant program
                [sys.executable, "-c", _JUDGE],
                input=json.dumps([dict(key) for key in new]),
                env={"PATH": os.environ.get("PATH", "")},
                cwd=empty,
                capture_output=True,
                text=True,
                check=True,
            )
        _verdicts.update(zip(new, json.loads(done.stdout), strict=True))
    return [_verdicts[key] for key in keys]
