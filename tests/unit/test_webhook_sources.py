"""YooKassa's unsigned notifications: where a delivery comes from (the TCP peer, or behind a
trusted proxy its X-Forwarded-For), the settings that say which sources and proxies count,
and how a notification body is journaled. Pure functions, no server."""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from charge_worker.errors import ForeignSource, MalformedDelivery, SettingsError
from charge_worker.settings import WebhookSettings, load_settings
from charge_worker.webhooks.bodies import STRIPE_REVISION, journal_entry
from charge_worker.webhooks.signature import verifier_for
from charge_worker.webhooks.sources import SourceCheck, inside, parse_address, source_of

YOOKASSA = SourceCheck.from_settings(WebhookSettings())
PROXIES = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))
BEHIND = SourceCheck(YOOKASSA.networks, PROXIES)
META = {"order_id": "7", "billing_period": "2026-12-01"}
PAYMENT = "2f9a1e3c-000f-5000-8000-1a2b3c4d5e6f"
SetEnv = Callable[..., None]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SetEnv:
    """Sets variables for `load_settings`, which sees no other CHARGE_WORKER_ one and no
    stray .env file."""
    for name in list(os.environ):
        if name.startswith("CHARGE_WORKER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)

    def set_env(**variables: str) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_env


@pytest.mark.parametrize(
    ("peer", "admitted"),
    [
        ("185.71.76.1", True),
        ("185.71.76.31", True),
        ("185.71.76.32", False),  # just past the /27
        ("77.75.156.11", True),
        ("77.75.156.12", False),
        ("77.75.154.200", True),
        ("2a02:5180::1", True),
        ("2a02:5181::1", False),
        ("::ffff:185.71.77.5", True),  # an IPv4 peer on a dual-stack socket
        ("::ffff:8.8.8.8", False),
        ("127.0.0.1", False),
        ("::1", False),
        ("", False),
        (None, False),
        ("not-an-address", False),
    ],
)
def test_the_peer_is_the_source_without_trusted_proxies(peer: str | None, admitted: bool) -> None:
    if admitted:
        assert YOOKASSA.check(peer, []).address == parse_address(peer or "")
    else:
        with pytest.raises(ForeignSource) as refused:
            YOOKASSA.check(peer, [])
        assert (refused.value.status_code, refused.value.result) == (403, "unauthorized")


def test_forwarded_for_is_ignored_unless_the_peer_is_a_trusted_proxy() -> None:
    with pytest.raises(ForeignSource):
        YOOKASSA.check("203.0.113.9", ["185.71.76.1"])
    with pytest.raises(ForeignSource):  # no proxy is trusted: loopback is just a peer
        YOOKASSA.check("127.0.0.1", ["185.71.76.1"])
    assert BEHIND.check("185.71.76.1", ["203.0.113.9"]).text == "185.71.76.1"


@pytest.mark.parametrize(
    ("peer", "forwarded_for", "source"),
    [
        ("10.0.0.5", ["185.71.76.1"], "185.71.76.1"),
        ("10.0.0.5", ["185.71.76.1, 10.1.2.3"], "185.71.76.1"),  # two proxies deep
        ("10.0.0.5", ["185.71.76.1", "10.1.2.3"], "185.71.76.1"),  # the same, as two lines
        # a forged left-most entry: the client's own header, before our proxy appended
        ("10.0.0.5", ["185.71.76.1, 203.0.113.9"], "203.0.113.9"),
        ("10.0.0.5", ["185.71.76.1, 203.0.113.9, 10.1.2.3"], "203.0.113.9"),
        ("10.0.0.5", ["203.0.113.9, 185.71.76.1"], "185.71.76.1"),
        ("fd00::1", ["2a02:5180::7"], "2a02:5180::7"),
        ("fd00::1", ["2a02:5180::7, fd12::3"], "2a02:5180::7"),
        ("fd00::1", ["185.71.77.2"], "185.71.77.2"),  # an IPv6 proxy forwarding IPv4
        ("10.0.0.5", [], "10.0.0.5"),  # nothing forwarded: the proxy itself
        ("10.0.0.5", ["10.9.9.9, 10.1.2.3"], "10.9.9.9"),  # all proxies: the left-most
        ("10.0.0.5", ["185.71.76.1, unknown"], "unknown"),  # not an address: refused
        ("10.0.0.5", ["185.71.76.1,"], ""),
    ],
)
def test_behind_a_trusted_proxy_the_source_is_the_right_most_untrusted_entry(
    peer: str, forwarded_for: list[str], source: str
) -> None:
    assert source_of(peer, forwarded_for, PROXIES).text == source


@pytest.mark.parametrize(
    ("forwarded_for", "admitted"),
    [
        (["185.71.76.1"], True),
        (["185.71.76.1, 203.0.113.9"], False),  # the forged entry is not the source
        (["203.0.113.9, 185.71.76.1"], True),
        (["2a02:5180::7, fd12::3"], True),
        ([], False),
        (["185.71.76.1, unknown"], False),
    ],
)
def test_a_delivery_through_the_ingress_is_admitted_by_its_forwarded_source(
    forwarded_for: list[str], admitted: bool
) -> None:
    if admitted:
        BEHIND.check("10.0.0.5", forwarded_for)
    else:
        with pytest.raises(ForeignSource):
            BEHIND.check("10.0.0.5", forwarded_for)


def test_an_ipv4_address_is_never_inside_an_ipv6_network() -> None:
    assert not inside(parse_address("10.0.0.1"), [ipaddress.ip_network("::/0")])
    assert not inside(None, [ipaddress.ip_network("0.0.0.0/0")])


def test_the_default_networks_are_yookassas_published_list() -> None:
    assert [str(n) for n in WebhookSettings().webhook_source_networks] == [
        "185.71.76.0/27",
        "185.71.77.0/27",
        "77.75.153.0/25",
        "77.75.156.11/32",
        "77.75.156.35/32",
        "77.75.154.128/25",
        "2a02:5180::/32",
    ]
    assert WebhookSettings().webhook_trusted_proxies == ()


def test_networks_are_read_comma_separated(env: SetEnv) -> None:
    env(
        CHARGE_WORKER_WEBHOOK_SOURCE_NETWORKS=" 127.0.0.1/32, ::1 ,2a02:5180::/32",
        CHARGE_WORKER_WEBHOOK_TRUSTED_PROXIES="10.0.0.0/8",
    )
    webhooks = load_settings().webhooks
    assert [str(n) for n in webhooks.webhook_source_networks] == [
        "127.0.0.1/32",
        "::1/128",
        "2a02:5180::/32",
    ]
    assert [str(n) for n in webhooks.webhook_trusted_proxies] == ["10.0.0.0/8"]


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("CHARGE_WORKER_WEBHOOK_SOURCE_NETWORKS", "185.71.76.0/27,bogus", "'bogus' is not"),
        ("CHARGE_WORKER_WEBHOOK_SOURCE_NETWORKS", "185.71.76.5/27", "host bits set"),
        ("CHARGE_WORKER_WEBHOOK_TRUSTED_PROXIES", "10.0.0.0/33", "'10.0.0.0/33' is not"),
    ],
)
def test_an_invalid_network_fails_at_start_naming_its_setting(
    env: SetEnv, variable: str, value: str, says: str
) -> None:
    env(**{variable: value})
    with pytest.raises(SettingsError) as failed:
        load_settings()
    message = str(failed.value)
    assert message.startswith(f"{variable}: ")
    assert says in message
    assert "\n" not in message


def test_the_yookassa_scheme_needs_no_secret_but_some_network() -> None:
    assert verifier_for("yookassa", WebhookSettings()) is None
    with pytest.raises(SettingsError, match="CHARGE_WORKER_WEBHOOK_SOURCE_NETWORKS is empty"):
        SourceCheck.from_settings(WebhookSettings(webhook_source_networks=()))
    with pytest.raises(SettingsError, match="CHARGE_WORKER_WEBHOOK_SECRETS"):
        verifier_for("stripe", WebhookSettings())


# --- the body: which payment to re-fetch, under which event id ---------------------------


def notification(event: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": "notification", "event": event, "object": obj}).encode()


def payment(status: str = "succeeded", metadata: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "id": PAYMENT,
        "status": status,
        "paid": status == "succeeded",
        "amount": {"value": "990.00", "currency": "RUB"},
        "metadata": META if metadata is None else metadata,
    }


@pytest.mark.parametrize(
    ("event", "obj", "journaled_as", "event_id"),
    [
        ("payment.succeeded", payment(), "charge.succeeded", f"payment.succeeded:{PAYMENT}"),
        (
            "payment.canceled",
            payment("canceled") | {"cancellation_details": {"party": "yoo_kassa"}},
            "charge.failed",
            f"payment.canceled:{PAYMENT}",
        ),
        (
            "refund.succeeded",
            {"id": "rf-1", "payment_id": PAYMENT, "status": "succeeded", "amount": {}},
            "charge.refunded",
            "refund.succeeded:rf-1",
        ),
    ],
)
def test_a_notification_is_journaled_under_its_payment(
    event: str, obj: dict[str, Any], journaled_as: str, event_id: str
) -> None:
    entry = journal_entry("gateway", "yookassa", notification(event, obj), "")
    assert entry is not None
    assert (entry.event_id, entry.message_id) == (event_id, event_id)
    assert (entry.event_type, entry.object_id) == (journaled_as, PAYMENT)
    assert (entry.revision, entry.status) == (STRIPE_REVISION, "received")
    # an unsigned body names no ledger key: the re-fetched payment says whose it is
    assert (entry.order_id, entry.billing_period) == (None, None)


def test_the_same_event_about_the_same_payment_has_one_event_id() -> None:
    """A notification has no id: a duplicate delivery must land on the same journal row,
    whatever else differs in its body."""
    first = journal_entry("gateway", "yookassa", notification("payment.succeeded", payment()), "")
    again = payment() | {"captured_at": "2026-12-01T03:00:01.123Z"}
    second = journal_entry("gateway", "yookassa", notification("payment.succeeded", again), "")
    assert first is not None
    assert second is not None
    assert first.event_id == second.event_id


@pytest.mark.parametrize(
    "event", ["payment.waiting_for_capture", "refund.canceled", "deal.closed", "payout.succeeded"]
)
def test_events_the_ledger_does_not_use_are_not_journaled(event: str) -> None:
    assert journal_entry("gateway", "yookassa", notification(event, payment()), "") is None


def test_a_body_without_our_metadata_is_journaled_for_the_re_fetch_to_decide() -> None:
    """The body may have been stripped: only the re-fetched payment may say it is not ours."""
    raw = notification("payment.succeeded", payment(metadata={"cms_name": "shop"}))
    entry = journal_entry("gateway", "yookassa", raw, "")
    assert entry is not None
    assert (entry.object_id, entry.status) == (PAYMENT, "received")


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        b"not json",
        b"\xff\xfe",
        json.dumps({"type": "event", "event": "payment.succeeded", "object": {"id": "x"}}).encode(),
        json.dumps({"type": "notification", "event": "payment.succeeded"}).encode(),
        json.dumps({"type": "notification", "event": "payment.succeeded", "object": {}}).encode(),
        json.dumps(
            {"type": "notification", "event": "payment.succeeded", "object": {"id": 7}}
        ).encode(),
        json.dumps(  # the id goes into the re-fetch's path: nothing but an id's characters
            {"type": "notification", "event": "payment.succeeded", "object": {"id": "../v3/x"}}
        ).encode(),
        json.dumps(
            {"type": "notification", "event": "refund.succeeded", "object": {"id": "rf-1"}}
        ).encode(),
        # a Stripe or contract event is no notification
        json.dumps({"id": "evt_1", "type": "charge.succeeded", "created": 1, "data": {}}).encode(),
    ],
)
def test_a_body_that_is_no_notification_is_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedDelivery) as refused:
        journal_entry("gateway", "yookassa", raw, "")
    assert refused.value.status_code == 400
