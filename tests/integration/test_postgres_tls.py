"""PostgreSQL over verified TLS (PGSSLMODE=verify-full, PGSSLROOTCERT), issue 34 item 10.

The embedded PostgreSQL's build has no SSL, so a TLS front (tests/support/pg_tls.py) does
PostgreSQL's own TLS negotiation with a certificate for 127.0.0.1 signed by a trustme CA
and relays to it. A DATABASE_URL's own `sslmode` wins over the settings.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme

from charge_worker.database import connect
from charge_worker.errors import DependencyUnavailable
from charge_worker.settings import DbSettings
from tests.support.pg_tls import PostgresTlsFront


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pg-ca") / "ca.crt"
    ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture
async def front(pg_admin_url: str, ca: trustme.CA) -> AsyncIterator[PostgresTlsFront]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    async with PostgresTlsFront(pg_admin_url, context).serving() as serving:
        yield serving


async def select_one(cfg: DbSettings) -> int:
    conn = await connect(cfg, application_name="tls-test")
    try:
        return int(await conn.fetchval("SELECT 1"))
    finally:
        await conn.close()


async def test_verify_full_with_the_servers_ca_connects_over_tls(
    front: PostgresTlsFront, ca_file: Path
) -> None:
    cfg = DbSettings(url=front.url(), sslmode="verify-full", sslrootcert=ca_file)
    assert await select_one(cfg) == 1
    assert front.handshakes == 1


async def test_verify_full_refuses_a_server_another_ca_signed(
    front: PostgresTlsFront, tmp_path: Path
) -> None:
    other = tmp_path / "other-ca.crt"
    trustme.CA().cert_pem.write_to_path(str(other))
    cfg = DbSettings(url=front.url(), sslmode="verify-full", sslrootcert=other)
    with pytest.raises(DependencyUnavailable, match="cannot connect to the database"):
        await select_one(cfg)


async def test_the_urls_own_sslmode_wins(front: PostgresTlsFront, tmp_path: Path) -> None:
    """An operator who wrote `sslmode=disable` into DATABASE_URL gets exactly that."""
    cfg = DbSettings(
        url=f"{front.url()}?sslmode=disable",
        sslmode="verify-full",
        sslrootcert=tmp_path / "nowhere.crt",
    )
    assert await select_one(cfg) == 1
    assert front.handshakes == 0
