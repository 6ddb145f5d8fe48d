"""`charge-worker pause` / `resume` as an operator runs them: idempotent, each saying the
consumer's state, the pause and its record kept through `provision --apply`, one line when
NATS or the consumer is not there. (The workers under a pause: tests/integration/test_pause.py.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker import streams
from charge_worker.admin.pause import AT_KEY, BY_KEY, REASON_KEY
from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import NatsSettings, Settings
from tests.support.cli import Ran
from tests.support.cli import cli as in_process
from tests.support.cli import cli_off_loop as cli
from tests.support.harness import settings_env

RECORD = (REASON_KEY, AT_KEY, BY_KEY)


def document(result: Ran) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    assert isinstance(parsed, dict), result.stdout
    return parsed


@pytest.fixture
def env(nats_settings: NatsSettings) -> dict[str, str]:
    return settings_env(Settings(nats=nats_settings))


@pytest.fixture
async def js(nc: Client, nats_settings: NatsSettings) -> JetStreamContext:
    js = nc.jetstream()
    await streams.provision(js, nats_settings)
    return js


async def test_pause_and_resume_are_idempotent_and_say_the_state(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    cfg = nats_settings
    paused = document(
        await cli("pause", "--reason", "gateway incident", "--by", "ann", "--json", env=env)
    )
    assert paused["changed"] is True
    assert (paused["stream"], paused["consumer"]) == (cfg.stream, cfg.durable)
    assert (paused["paused"], paused["reason"], paused["paused_by"]) == (
        True,
        "gateway incident",
        "ann",
    )
    assert paused["paused_at"]
    assert paused["paused_until"].startswith("9999-")
    info = await js.consumer_info(cfg.stream, cfg.durable)
    assert info.paused
    assert {k: v for k, v in (info.config.metadata or {}).items() if k in RECORD} == {
        REASON_KEY: "gateway incident",
        AT_KEY: paused["paused_at"],
        BY_KEY: "ann",
    }

    again = document(await cli("pause", "--reason", "other", "--by", "bob", "--json", env=env))
    assert again["changed"] is False
    assert again | {"changed": True} == paused  # the first record stays
    told = await cli("pause", env=env)
    assert told.returncode == 0, told.stderr
    assert told.stdout.startswith(f"already paused: {cfg.stream}/{cfg.durable} is paused")
    assert "by ann, reason: gateway incident" in told.stdout

    resumed = document(await cli("resume", "--json", env=env))
    assert resumed["changed"] is True
    assert (resumed["paused"], resumed["reason"], resumed["paused_at"]) == (False, None, None)
    info = await js.consumer_info(cfg.stream, cfg.durable)
    assert not info.paused
    assert not RECORD & (info.config.metadata or {}).keys()

    assert document(await cli("resume", "--json", env=env))["changed"] is False
    told = await cli("resume", env=env)
    assert told.returncode == 0, told.stderr
    assert told.stdout.startswith(f"not paused: {cfg.stream}/{cfg.durable} delivers;")


async def test_provision_apply_keeps_the_pause_and_its_record(
    env: dict[str, str], js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    cfg = nats_settings
    paused = document(
        await cli("pause", "--reason", "db failover", "--by", "ann", "--json", env=env)
    )

    # a setting changed since the consumer was made: --apply updates the consumer in place
    changed = env | {"CHARGE_WORKER_MAX_ACK_PENDING": str(cfg.max_ack_pending // 2)}
    applied = await cli("provision", "--apply", env=changed)
    assert applied.returncode == 0, applied.stderr
    assert f"updated consumer {cfg.stream}/{cfg.durable}" in applied.stdout

    info = await js.consumer_info(cfg.stream, cfg.durable)
    assert info.config.max_ack_pending == cfg.max_ack_pending // 2  # it did update
    assert info.paused
    state = document(await cli("pause", "--json", env=changed))
    assert state["changed"] is False
    assert state | {"changed": True} == paused


async def test_pause_and_resume_without_nats_are_one_line() -> None:
    for command in ("pause", "resume"):
        result = await cli(command, env={"NATS_URL": f"nats://127.0.0.1:{free_port()}"})
        assert result.returncode == 1
        [line] = result.stderr.splitlines()
        assert line.startswith("Error: DependencyUnavailable: cannot connect to NATS"), line


@pytest.mark.usefixtures("nc")  # deletes the streams, should anything create them
async def test_pause_and_resume_without_the_consumer_are_one_line(env: dict[str, str]) -> None:
    for command in ("pause", "resume"):
        result = await cli(command, "--json", env=env)
        assert result.returncode == 1
        assert result.stdout == ""
        [line] = result.stderr.splitlines()
        assert line.startswith("Error: ProvisioningError: consumer charges-worker of stream")
        assert "run `charge-worker provision`" in line


@pytest.mark.parametrize("command", ["pause", "resume"])
def test_both_offer_json(command: str) -> None:
    result = in_process(command, "--help", env={})
    assert result.returncode == 0, result.stderr
    assert "--json" in result.stdout
