"""A real Prometheus evaluating `config/alerts.yml`, five minutes of the rules' time in five
seconds of the test's, and reading its alerts back (tests/integration/test_alerts_live*.py).

Prometheus is the Debian package `prometheus`; `PROMETHEUS` is None where it is missing. The
rules are the real file with one change, made on a copy: every duration is divided by 60
(`[5m]` becomes `[5s]`, `for: 15m` becomes `for: 15s`, `[1h]` becomes `[1m]`). Thresholds
are unchanged: the numbers of seconds in expressions (`time() - x > 93600`) stay numbers.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from charge_worker.sandbox.embedded import free_port

ROOT = Path(__file__).parents[2]
ALERTS = ROOT / "config" / "alerts.yml"
PROMETHEUS = shutil.which("prometheus")


def minutes_as_seconds(rules: str) -> str:
    """Every PromQL and `for:` duration divided by 60: 5m -> 5s, 1h -> 1m, 1d -> 1h."""
    shorter = {"m": "s", "h": "m", "d": "h"}
    return re.sub(r"(?<![\w$.])(\d+)([mhd])\b", lambda m: m.group(1) + shorter[m.group(2)], rules)


@contextlib.contextmanager
def prometheus(workdir: Path, targets: list[str]) -> Iterator[str]:
    """Prometheus on a free loopback port, scraping `targets` and evaluating the shortened
    rules every second; its URL. Its log is `workdir/prometheus.log`."""
    assert PROMETHEUS is not None
    rules = workdir / "alerts.yml"
    rules.write_text(minutes_as_seconds(ALERTS.read_text()))
    config = workdir / "prometheus.yml"
    config.write_text(  # JSON is YAML
        json.dumps(
            {
                "global": {
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "evaluation_interval": "1s",
                },
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {"job_name": "charge-worker", "static_configs": [{"targets": targets}]}
                ],
            }
        )
    )
    port = free_port()
    with (workdir / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def api(client: httpx.AsyncClient, path: str, params: dict[str, str] | None = None) -> Any:
    """The `data` of a successful answer of Prometheus' HTTP API."""
    response = await client.get(path, params=params)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


async def alert_states(client: httpx.AsyncClient) -> dict[str, str]:
    """Every alert Prometheus holds, by name: `firing` if one of its series fires, else
    `pending`. A resolved alert leaves the list: absent means inactive."""
    states: dict[str, str] = {}
    for alert in (await api(client, "/api/v1/alerts"))["alerts"]:
        name = alert["labels"]["alertname"]
        states[name] = "firing" if "firing" in (alert["state"], states.get(name)) else "pending"
    return states


async def alert_state(client: httpx.AsyncClient, name: str) -> str:
    """`firing`, `pending`, or `inactive` (a resolved alert leaves the list)."""
    return (await alert_states(client)).get(name, "inactive")


async def value(client: httpx.AsyncClient, query: str) -> float:
    """An instant query's single value now; 0 when it returns no series."""
    result = (await api(client, "/api/v1/query", {"query": query}))["result"]
    assert len(result) <= 1, result
    return float(result[0]["value"][1]) if result else 0.0


async def evaluated_after(client: httpx.AsyncClient, moment: float) -> bool:
    """Every rule group has been evaluated since `moment` (Unix time)."""
    groups = (await api(client, "/api/v1/rules"))["groups"]
    return all(dt.datetime.fromisoformat(g["lastEvaluation"]).timestamp() > moment for g in groups)


async def ready(client: httpx.AsyncClient) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return (await client.get("/-/ready")).status_code == 200
    return False


async def scraping(client: httpx.AsyncClient, count: int) -> bool:
    """Exactly `count` targets up."""
    targets = (await api(client, "/api/v1/targets"))["activeTargets"]
    return bool(sum(t["health"] == "up" for t in targets) == count)


async def rules_loaded(client: httpx.AsyncClient) -> None:
    """Every rule of the file loaded, none in error."""
    groups = (await api(client, "/api/v1/rules"))["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    assert len(loaded) == ALERTS.read_text().count("- alert:")
    assert all(r["health"] != "err" for r in loaded), loaded
