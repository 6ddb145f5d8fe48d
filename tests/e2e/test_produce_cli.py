"""`charge-worker produce` as the CronJob runs it: a subprocess, its summary and exit status."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import asyncpg
import psutil
from nats.aio.client import Client
from nats.js.api import DiscardPolicy

from charge_worker import streams
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import (
    eventually,
    gateway_charges,
    running_worker,
    settings_env,
    settings_for,
)
from tests.support.producer import (
    DAY,
    Sub,
    add_attempt,
    add_subscriptions,
    all_final,
    attempts,
    next_dates,
    stream_messages,
)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def env_for(nats: NatsSettings, database_url: str, **extra: str) -> dict[str, str]:
    return {
        "NATS_URL": str(nats.url),
        "DATABASE_URL": database_url,
        "CHARGE_WORKER_STREAM": nats.stream,
        "CHARGE_WORKER_SUBJECT": nats.subject,
        "CHARGE_WORKER_DLQ_STREAM": nats.dlq_stream,
        "CHARGE_WORKER_DLQ_SUBJECT": nats.dlq_subject,
        **extra,
    }


async def produce(*args: str, env: dict[str, str]) -> Result:
    """`charge-worker produce --date DAY ARGS` in a subprocess."""
    proc = await spawn_produce(*args, env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def spawn_produce(
    *args: str, env: dict[str, str], stderr: int = subprocess.PIPE
) -> asyncio.subprocess.Process:
    """`charge-worker produce --date DAY ARGS` started, its stdout piped."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CHARGE_WORKER_") and k not in ("NATS_URL", "DATABASE_URL")
    }
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "charge_worker",
        "produce",
        "--date",
        DAY.isoformat(),
        *args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=clean | env,
    )


async def test_json_summary_is_the_whole_story(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    paid = Sub("sub_paid", 4)
    await add_subscriptions(
        database_url,
        Sub("sub_ok", 1),
        Sub("sub_behind", 2, next_billing_date=DAY.replace(month=10)),
        Sub("sub_bad", 3, currency="rub"),
        paid,
    )
    await add_attempt(database_url, paid, "succeeded", published=True)

    result = await produce("--json", env=env_for(nats_settings, database_url))

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "day": "2026-12-01",
        "due": 4,
        "scheduled": 4,
        "already_scheduled": 0,
        "already_settled": 1,
        "tries_started": 0,
        "tries_postponed": 0,
        "published": 4,
        "deduplicated": 0,
        "invalid": [
            {
                "subscription_id": "sub_bad",
                "key": None,
                "reason": "currency: String should match pattern '^[A-Z]{3}$'",
            }
        ],
        "conflicts": [],
        "failed": [],
        "abandoned": 0,
        "exit_code": 0,
    }
    assert len(await stream_messages(nc.jetstream(), nats_settings.stream)) == 4


async def test_human_summary_and_exit_1_when_a_publish_fails(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    """A full stream refuses the second message: the run says so, exits 1, a re-run finishes."""
    js = nc.jetstream()
    full = dataclasses.replace(
        streams.charges_stream(nats_settings), max_msgs=1, discard=DiscardPolicy.NEW
    )
    await js.add_stream(full)
    await add_subscriptions(
        database_url,
        Sub("sub_1", 1),
        Sub("sub_2", 2),
        Sub("sub_3", 3),
        Sub("sub_4", 4, amount_minor=0),
    )
    env = env_for(nats_settings, database_url, CHARGE_WORKER_PUBLISH_RETRY_HORIZON_S="0.2")

    failed = await produce(env=env)

    assert failed.returncode == 1, failed.stderr
    lines = failed.stdout.splitlines()
    failure = lines.index("failed to publish (left scheduled for the next run):") + 1
    for n, line in enumerate(lines[failure : failure + 2], start=2):  # one window: both tried
        assert line.startswith(f"  sub_{n} {n}:2026-12-01: not stored after 0.2s of retries: ")
        lines[failure + n - 2] = f"  sub_{n} {n}:2026-12-01: ..."
    assert lines == [
        "produce for 2026-12-01",
        "  due subscriptions                  4",
        "  scheduled now                      3",
        "  already scheduled                  0",
        "  already settled                    0",
        "  next tries started                 0",
        "  tries postponed by the cap         0",
        "  published                          1",
        "  deduplicated by the server         0",
        "  invalid (skipped)                  1",
        "  conflicts (skipped)                0",
        "  failed to publish                  2",
        "invalid subscriptions (not advanced):",
        "  sub_4: amount_minor: Input should be greater than 0",
        "failed to publish (left scheduled for the next run):",
        "  sub_2 2:2026-12-01: ...",
        "  sub_3 3:2026-12-01: ...",
        "result: INCOMPLETE, re-run",
    ]

    await js.update_stream(dataclasses.replace(full, max_msgs=-1))
    rerun = await produce(env=env)

    assert rerun.returncode == 0, rerun.stderr
    assert "  published                          2" in rerun.stdout.splitlines()
    assert rerun.stdout.splitlines()[-1] == "result: ok"
    assert len(await stream_messages(js, nats_settings.stream)) == 3


async def test_two_runs_at_once_charge_once(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
) -> None:
    """Two CronJob pods started together; then a real worker charges what they published."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    await add_subscriptions(database_url, *(Sub(f"sub_{n:04}", n) for n in range(1, 1201)))
    keys = {f"{n}:2026-12-01" for n in range(1, 1201)}

    one, two = await asyncio.gather(
        produce("--json", env=settings_env(settings)), produce("--json", env=settings_env(settings))
    )

    assert (one.returncode, two.returncode) == (0, 0), one.stderr + two.stderr
    first, second = json.loads(one.stdout), json.loads(two.stdout)
    assert first["due"] + second["due"] == 1200
    assert first["scheduled"] + second["scheduled"] == 1200
    assert first["published"] + second["published"] == 1200
    assert set(await stream_messages(nc.jetstream(), nats_settings.stream)) == {
        f"charge:{key}" for key in keys
    }
    async with running_worker(settings):
        await eventually(all_final(database_url, len(keys)), "every charge settled", within_s=100)
    assert await gateway_charges(gateway_sim.url) == dict.fromkeys(keys, 1)


async def test_progress_goes_to_stderr_and_json_stays_one_object(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    await add_subscriptions(database_url, *(Sub(f"sub_{n:04}", n) for n in range(1, 1001)))
    env = env_for(nats_settings, database_url, CHARGE_WORKER_LOG_FORMAT="console")

    result = await produce("--json", env=env)

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["published"] == 1000
    progress = [line for line in result.stderr.splitlines() if line.startswith("produce: ")]
    assert progress == [
        "produce: 1000 due subscriptions examined",
        "produce: 1000 charges published",
    ]
    assert len(await stream_messages(nc.jetstream(), nats_settings.stream)) == 1000


async def test_with_json_logs_every_line_on_stderr_is_json_progress_included(
    nats_settings: NatsSettings, database_url: str
) -> None:
    await add_subscriptions(database_url, *(Sub(f"sub_{n:04}", n) for n in range(1, 1001)))
    env = env_for(nats_settings, database_url, CHARGE_WORKER_LOG_FORMAT="json")

    result = await produce("--json", env=env)

    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    progress = [line for line in lines if line["event"] == "progress"]
    assert [line["progress"] for line in progress] == [
        "produce: 1000 due subscriptions examined",
        "produce: 1000 charges published",
    ]
    assert {(line["level"], line["logger"]) for line in progress} == {
        ("info", "charge_worker.producer")
    }


async def test_nats_down_fails_in_one_line_after_scheduling(
    nats_settings: NatsSettings, database_url: str
) -> None:
    """The outbox: what is due is recorded even when the broker is down; the next run sends it."""
    await add_subscriptions(database_url, Sub("sub_1", 1))
    down = nats_settings.model_copy(update={"url": f"nats://127.0.0.1:{free_port()}"})

    result = await produce(env=env_for(down, database_url))

    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: DependencyUnavailable: cannot connect to NATS")
    assert await attempts(database_url) == {"1:2026-12-01": ("scheduled", False)}
    assert (await next_dates(database_url))["sub_1"] == DAY.replace(year=2027, month=1)


async def test_processes_share_one_run_and_add_up_its_summary(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    """`--processes 2`: two processes take the due subscriptions between them, only the first
    publishes what an earlier run left, and the summary is the whole run's."""
    left = Sub("sub_left", 9999, next_billing_date=DAY.replace(year=2027, month=1))
    subs = [Sub(f"sub_{n:04}", n) for n in range(1, 1201)]
    await add_subscriptions(database_url, *subs, Sub("sub_bad", 5000, currency="rub"), left)
    await add_attempt(database_url, left, "scheduled")  # scheduled, never published

    result = await produce("--json", "--processes", "2", env=env_for(nats_settings, database_url))

    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert {k: v for k, v in summary.items() if k != "invalid"} == {
        "day": "2026-12-01",
        "due": 1201,
        "scheduled": 1200,
        "already_scheduled": 0,
        "already_settled": 0,
        "tries_started": 0,
        "tries_postponed": 0,
        "published": 1201,
        "deduplicated": 0,
        "conflicts": [],
        "failed": [],
        "abandoned": 0,
        "exit_code": 0,
    }
    assert [p["subscription_id"] for p in summary["invalid"]] == ["sub_bad"]
    assert set(await stream_messages(nc.jetstream(), nats_settings.stream)) == {
        f"charge:{n}:2026-12-01" for n in [*range(1, 1201), 9999]
    }
    assert set((await attempts(database_url)).values()) == {("scheduled", True)}


async def test_a_process_that_ends_without_a_summary_fails_the_run_in_its_summary(
    nats_settings: NatsSettings, database_url: str
) -> None:
    await add_subscriptions(database_url, *(Sub(f"sub_{n:04}", n) for n in range(1, 1201)))
    down = nats_settings.model_copy(update={"url": f"nats://127.0.0.1:{free_port()}"})

    result = await produce("--processes", "2", env=env_for(down, database_url))

    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 2
    assert all("cannot connect to NATS" in line for line in errors)
    lines = result.stdout.splitlines()
    assert f"  {'failed to publish':<28}{2:>8}" in lines
    assert lines[-1] == "result: INCOMPLETE, re-run"
    assert sum("ended with exit status 1 and no summary" in line for line in lines) == 2
    scheduled = await attempts(database_url)  # each process scheduled its share
    assert set(scheduled) == {f"{n}:2026-12-01" for n in range(1, 1201)}
    assert set(scheduled.values()) == {("scheduled", False)}


async def test_a_stopped_run_stops_its_processes_and_says_the_run_is_incomplete(
    nats_settings: NatsSettings, database_url: str
) -> None:
    """SIGTERM to `produce --processes 2` (what `kill` or a pod's stop sends to the parent
    alone) stops the processes doing the work; they must not go on unsupervised. They are
    held on a table lock here, so that they are mid-run when the signal comes."""
    await add_subscriptions(database_url, *(Sub(f"sub_{n:04}", n) for n in range(1, 1201)))
    blocker = await asyncpg.connect(database_url)
    proc: asyncio.subprocess.Process | None = None
    children: list[psutil.Process] = []
    try:
        # the processes' read of due subscriptions (FOR UPDATE) waits; the cut does not
        await blocker.execute("BEGIN; LOCK TABLE subscriptions IN EXCLUSIVE MODE")
        env = env_for(nats_settings, database_url, CHARGE_WORKER_DB_COMMAND_TIMEOUT_S="600")
        # no pipe the processes could hold open once it has ended (its stderr is theirs)
        proc = await spawn_produce("--processes", "2", env=env, stderr=subprocess.DEVNULL)
        await eventually(
            lambda: _waiting_on_the_lock(database_url, 2), "both processes waiting for the lock"
        )
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2

        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 60)

        _, alive = await asyncio.to_thread(psutil.wait_procs, children, timeout=30)
        assert alive == []
        assert proc.returncode == 1
        assert proc.stdout is not None
        lines = (await proc.stdout.read()).decode().splitlines()
        assert lines[-1] == "result: INCOMPLETE, re-run"
        assert sum("no summary (stopped by SIGTERM)" in line for line in lines) == 2
    finally:  # nothing left running, whatever failed
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        await blocker.close()


async def _waiting_on_the_lock(database_url: str, count: int) -> bool:
    """Whether `count` produce connections wait for a lock (seen from a connection of its
    own: a transaction sees the activity frozen as it first looked)."""
    conn = await asyncpg.connect(database_url)
    try:
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'charge-worker produce' AND wait_event_type = 'Lock'"
        )
    finally:
        await conn.close()
    return bool(waiting == count)
