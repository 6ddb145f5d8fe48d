"""NATS over mutual TLS (NATS_TLS_CERT, NATS_TLS_KEY, NATS_TLS_CA), against a real
nats-server that requires and verifies client certificates (issue 34, item 10).

trustme makes a CA, the server's certificate for 127.0.0.1 and a client certificate; the
server is the embedded nats-server with its own TLS flags.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from charge_worker.errors import DependencyUnavailable, SettingsError
from charge_worker.sandbox.embedded import NatsServer
from charge_worker.settings import NatsSettings, load_settings
from charge_worker.streams import connect


class TlsNatsServer(NatsServer):
    """nats-server that speaks only TLS and asks every client for a certificate."""

    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        super().__init__()
        self.tls = ["--tlscert", str(cert), "--tlskey", str(key), "--tlscacert", str(ca)]

    def _command(self) -> list[str]:
        return [*super()._command(), "--tlsverify", *self.tls]


class Pki:
    """A CA and the files a server and a client need, in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem.bytes())
        server = self.ca.issue_cert("127.0.0.1")
        self.server_cert = self._write("server.pem", server.cert_chain_pems[0].bytes())
        self.server_key = self._write("server.key", server.private_key_pem.bytes())
        client = self.ca.issue_cert("charge-worker@example.internal")
        self.client_cert = self._write("client.pem", client.cert_chain_pems[0].bytes())
        self.client_key = self._write("client.key", client.private_key_pem.bytes())

    def _write(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.write_bytes(data)
        return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[TlsNatsServer]:
    with TlsNatsServer(pki.server_cert, pki.server_key, pki.ca_file) as server:
        yield server


async def test_a_client_with_its_certificate_talks_jetstream(
    tls_server: TlsNatsServer, pki: Pki
) -> None:
    cfg = NatsSettings(
        url=tls_server.url, tls_cert=pki.client_cert, tls_key=pki.client_key, tls_ca=pki.ca_file
    )
    nc = await connect(cfg, name="tls-test", reconnect=False)
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
        assert nc.connected_url is not None
    finally:
        await nc.close()


async def test_without_a_client_certificate_the_server_refuses(
    tls_server: TlsNatsServer, pki: Pki
) -> None:
    cfg = NatsSettings(url=tls_server.url, tls_ca=pki.ca_file)
    with pytest.raises(DependencyUnavailable, match="cannot connect to NATS"):
        await connect(cfg, name="tls-test", reconnect=False)


async def test_a_server_signed_by_another_ca_is_refused(
    tls_server: TlsNatsServer, pki: Pki, tmp_path: Path
) -> None:
    other = Pki(tmp_path)
    cfg = NatsSettings(
        url=tls_server.url,
        tls_cert=other.client_cert,
        tls_key=other.client_key,
        tls_ca=other.ca_file,
    )
    with pytest.raises(DependencyUnavailable, match="cannot connect to NATS"):
        await connect(cfg, name="tls-test", reconnect=False)


async def test_a_missing_ca_file_fails_naming_its_setting(tmp_path: Path) -> None:
    cfg = NatsSettings(url="nats://127.0.0.1:9", tls_ca=tmp_path / "nowhere.pem")
    with pytest.raises(SettingsError, match=r"^NATS_TLS_CA: cannot load"):
        await connect(cfg, name="tls-test", reconnect=False)


async def test_an_unreadable_certificate_fails_naming_its_setting(pki: Pki, tmp_path: Path) -> None:
    garbage = tmp_path / "client.pem"
    garbage.write_text("not a certificate")
    cfg = NatsSettings(url="nats://127.0.0.1:9", tls_cert=garbage, tls_key=pki.client_key)
    with pytest.raises(SettingsError, match=r"^NATS_TLS_CERT: cannot load"):
        await connect(cfg, name="tls-test", reconnect=False)


def test_a_certificate_without_its_key_fails_at_start(
    monkeypatch: pytest.MonkeyPatch, pki: Pki
) -> None:
    monkeypatch.setenv("NATS_TLS_CERT", str(pki.client_cert))
    with pytest.raises(SettingsError, match=r"^NATS_TLS_KEY must be set"):
        load_settings()
