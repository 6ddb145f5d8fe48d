"""Real servers for the whole suite, started once; fresh databases and streams per test.

`NATS_URL` / `DATABASE_URL`, when set, point the suite at servers you run yourself;
otherwise an embedded nats-server and PostgreSQL start on free loopback ports. Each test
gets its own database, cloned from a migrated template, and its own stream names.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats.js.errors
import pytest
from nats.aio.client import Client

from charge_worker import streams
from charge_worker.migrate import migrate
from charge_worker.sandbox.embedded import NatsServer, PostgresServer
from charge_worker.sandbox.gateway.app import GatewayConfig, build_gateway_app
from charge_worker.sandbox.scoring import ScoringConfig, build_scoring_app
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import DbSettings, NatsSettings

TEMPLATE_DB = "charge_worker_template"


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    if url := os.environ.get("NATS_URL"):
        yield url
        return
    with NatsServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    if url := os.environ.get("DATABASE_URL"):
        yield url
        return
    with PostgresServer() as server:
        yield server.url


def with_database(url: str, database: str) -> str:
    """`url` pointing at another database on the same server."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


async def _admin(pg_admin_url: str, *statements: str) -> None:
    conn = await asyncpg.connect(pg_admin_url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def template_url(pg_admin_url: str) -> str:
    """A database with every migration applied, cloned for each test."""
    name = f"{TEMPLATE_DB}_{os.getpid()}"
    asyncio.run(_admin(pg_admin_url, f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}"))
    url = with_database(pg_admin_url, name)
    asyncio.run(migrate(url))
    return url


@pytest.fixture
def empty_database_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh database with no tables at all."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(pg_admin_url, f"CREATE DATABASE {name}"))
    yield with_database(pg_admin_url, name)
    asyncio.run(_admin(pg_admin_url, f"DROP DATABASE {name} WITH (FORCE)"))


@pytest.fixture
def database_url(pg_admin_url: str, template_url: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    template = urlsplit(template_url).path.lstrip("/")
    asyncio.run(_admin(pg_admin_url, f"CREATE DATABASE {name} TEMPLATE {template}"))
    yield with_database(pg_admin_url, name)
    asyncio.run(_admin(pg_admin_url, f"DROP DATABASE {name} WITH (FORCE)"))


@pytest.fixture
def db_settings(database_url: str) -> DbSettings:
    return DbSettings(url=database_url)


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """One connection to the test's database, for what a test reads or seeds by hand."""
    connection = await asyncpg.connect(database_url)
    yield connection
    await connection.close()


@pytest.fixture
def nats_settings(nats_url: str) -> NatsSettings:
    """Stream and subject names of this test's own, so tests never see each other's messages."""
    uid = uuid.uuid4().hex[:10]
    return NatsSettings(
        url=nats_url,
        stream=f"CHARGES_{uid}",
        subject=f"charges_{uid}.due",
        dlq_stream=f"CHARGES_DLQ_{uid}",
        dlq_subject=f"charges_{uid}.dlq",
        outcomes_stream=f"CHARGE_OUTCOMES_{uid}",
        outcomes_subject=f"charges_{uid}.outcome",
    )


@pytest.fixture
async def nc(nats_settings: NatsSettings) -> AsyncIterator[Client]:
    """A NATS connection; the test's streams are deleted afterwards."""
    client = await streams.connect(nats_settings, name="tests")
    yield client
    js = client.jetstream()
    for name in (nats_settings.stream, nats_settings.dlq_stream, nats_settings.outcomes_stream):
        with contextlib.suppress(nats.js.errors.NotFoundError):  # maybe never created
            await js.delete_stream(name)
    await client.close()


@pytest.fixture
def gateway_sim() -> Iterator[ServedApp]:
    """The gateway simulator over real HTTP, fresh for each test."""
    with ServedApp(build_gateway_app(GatewayConfig(seed=1))) as served:
        yield served


@pytest.fixture
def scoring_sim() -> Iterator[ServedApp]:
    """The scoring simulator over real HTTP (fast by default), fresh for each test."""
    with ServedApp(build_scoring_app(ScoringConfig(seed=1))) as served:
        yield served
