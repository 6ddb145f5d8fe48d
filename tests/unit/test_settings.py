"""Settings: defaults are valid, every cross-field rule fails with one line naming its setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from charge_worker.errors import SettingsError
from charge_worker.settings import DbSettings, Settings, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test sees only the variables it sets, and no stray .env file."""
    for name in list(os.environ):
        if name.startswith("CHARGE_WORKER_") or name in {
            "NATS_URL",
            "DATABASE_URL",
            "GATEWAY_URL",
            "GATEWAY_API_KEY",
            "SCORING_URL",
        }:
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_defaults_are_valid_and_match_the_contract() -> None:
    settings = load_settings()
    assert settings.nats.stream == "CHARGES"
    assert settings.nats.subject == "charges.due"
    assert settings.nats.durable == "charges-worker"
    assert settings.nats.dlq_stream == "CHARGES_DLQ"
    assert settings.nats.ack_wait_s == 30
    assert settings.nats.max_deliver == 5
    assert settings.nats.backoff_s == (30, 60, 300, 900)
    assert settings.scoring.scoring_timeout_s == 2
    assert settings.scoring.scoring_policy == "defer"
    assert settings.heartbeat_s == 10  # ack_wait / 3


def test_reads_conventional_names_and_prefixed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", "nats://10.0.0.1:4222")
    monkeypatch.setenv("DATABASE_URL", "postgresql://db/charges")
    monkeypatch.setenv("GATEWAY_API_KEY", "sk_live_secret")
    monkeypatch.setenv("CHARGE_WORKER_CONCURRENCY", "32")
    monkeypatch.setenv("CHARGE_WORKER_BACKOFF_S", "5,10,20")
    monkeypatch.setenv("CHARGE_WORKER_ACK_WAIT_S", "5")
    settings = load_settings()
    assert settings.nats.url == "nats://10.0.0.1:4222"
    assert settings.db.dsn == "postgresql://db/charges"
    assert settings.worker.concurrency == 32
    assert settings.nats.backoff_s == (5, 10, 20)
    assert settings.gateway.api_key is not None
    assert "sk_live_secret" not in repr(settings)  # never printed by accident


def test_the_database_address_is_a_secret_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://charges:pa55word@db/charges")
    settings = load_settings()
    assert "pa55word" not in repr(settings)
    assert "pa55word" not in str(settings.model_dump())
    assert settings.db.dsn == "postgresql://charges:pa55word@db/charges"


def test_a_missing_database_address_fails_naming_its_variable() -> None:
    with pytest.raises(SettingsError, match=r"^DATABASE_URL is not set"):
        DbSettings().dsn  # noqa: B018


def test_backoff_accepts_a_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHARGE_WORKER_BACKOFF_S", "[30, 60]")
    assert load_settings().nats.backoff_s == (30, 60)


def test_env_file_is_read() -> None:
    Path(".env").write_text("CHARGE_WORKER_CONCURRENCY=7\n")
    assert load_settings().worker.concurrency == 7


# (environment, the setting the one-line error must name)
BROKEN = [
    ({"CHARGE_WORKER_MAX_DELIVER": "4"}, "CHARGE_WORKER_MAX_DELIVER"),
    ({"CHARGE_WORKER_BACKOFF_S": "10,60,300,900"}, "CHARGE_WORKER_BACKOFF_S"),
    ({"CHARGE_WORKER_HEARTBEAT_S": "20"}, "CHARGE_WORKER_HEARTBEAT_S"),
    ({"CHARGE_WORKER_PROCESSING_BUDGET_S": "15"}, "CHARGE_WORKER_PROCESSING_BUDGET_S"),
    ({"CHARGE_WORKER_LEASE_S": "12"}, "CHARGE_WORKER_LEASE_S"),
    # no time left to renew the lease before the charge request (the review's finding)
    ({"CHARGE_WORKER_LEASE_S": "15"}, "CHARGE_WORKER_LEASE_S"),
    (
        {
            "GATEWAY_KIND": "stripe",
            "CHARGE_WORKER_GATEWAY_TIMEOUT_S": "12",
            "CHARGE_WORKER_LEASE_S": "17",
        },
        "CHARGE_WORKER_LEASE_S",
    ),
    # a Stripe charge is up to three requests: 2 + (1 + 3) x 10 s
    (
        {"GATEWAY_KIND": "stripe", "CHARGE_WORKER_PROCESSING_BUDGET_S": "30"},
        "CHARGE_WORKER_PROCESSING_BUDGET_S",
    ),
    ({"CHARGE_WORKER_MAX_ACK_PENDING": "8"}, "CHARGE_WORKER_MAX_ACK_PENDING"),
    ({"CHARGE_WORKER_DUPLICATE_WINDOW_S": "60"}, "CHARGE_WORKER_DUPLICATE_WINDOW_S"),
    ({"CHARGE_WORKER_DB_POOL_MIN": "20"}, "CHARGE_WORKER_DB_POOL_MAX"),
    ({"CHARGE_WORKER_CONCURRENCY": "0"}, "CHARGE_WORKER_CONCURRENCY"),
    ({"CHARGE_WORKER_CONCURRENCY": "many"}, "CHARGE_WORKER_CONCURRENCY"),
    ({"CHARGE_WORKER_ACK_WAIT_S": "-1"}, "CHARGE_WORKER_ACK_WAIT_S"),
    ({"CHARGE_WORKER_BACKOFF_S": "30,0"}, "CHARGE_WORKER_BACKOFF_S"),
    ({"CHARGE_WORKER_SCORING_POLICY": "maybe"}, "CHARGE_WORKER_SCORING_POLICY"),
    ({"CHARGE_WORKER_METRICS_PORT": "70000"}, "CHARGE_WORKER_METRICS_PORT"),
    ({"CHARGE_WORKER_LOG_LEVEL": "loud"}, "CHARGE_WORKER_LOG_LEVEL"),
    # issue 34, item 10: the API key and every charge in clear text over a network
    ({"GATEWAY_URL": "http://gateway.example.com"}, "GATEWAY_URL"),
    ({"GATEWAY_URL": "HTTP://10.0.0.7:8080"}, "GATEWAY_URL"),
    ({"GATEWAY_URL": "http://localhost.example.com"}, "GATEWAY_URL"),
    ({"GATEWAY_URL": "http://127.0.0.1.nip.io"}, "GATEWAY_URL"),
    ({"GATEWAY_KIND": "stripe", "GATEWAY_URL": "http://api.stripe.com"}, "GATEWAY_URL"),
    (
        {"CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX": "acme billing/"},
        "CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX",
    ),
    ({"CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX": "x" * 33}, "CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX"),
]


@pytest.mark.parametrize(("env", "named"), BROKEN)
def test_invalid_setting_fails_with_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    message = str(caught.value)
    assert named in message
    assert "\n" not in message


def test_ack_wait_shorter_than_a_gateway_call_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Heartbeats keep a message alive past ack_wait; that is what they are for."""
    monkeypatch.setenv("CHARGE_WORKER_ACK_WAIT_S", "5")
    monkeypatch.setenv("CHARGE_WORKER_BACKOFF_S", "5,30,60")
    monkeypatch.setenv("CHARGE_WORKER_GATEWAY_TIMEOUT_S", "10")
    settings = load_settings()
    assert settings.nats.ack_wait_s < settings.gateway.gateway_timeout_s
    assert settings.heartbeat_s == pytest.approx(5 / 3)


def test_no_backoff_means_ack_wait_alone() -> None:
    settings = Settings.model_validate({"nats": {"backoff_s": (), "max_deliver": 1}})
    assert settings.shortest_ack_wait_s == 30


def test_heartbeat_follows_the_shortest_backoff_step() -> None:
    settings = Settings.model_validate({"nats": {"ack_wait_s": 30, "backoff_s": (30, 60, 9)}})
    assert settings.heartbeat_s == 3


def test_the_example_env_file_is_valid() -> None:
    example = Path(__file__).parents[2] / "config" / "example.env"
    Path(".env").write_text(example.read_text())
    settings = load_settings()
    assert settings.nats.url == "nats://nats.example.internal:4222"
    assert settings.gateway.api_key is None  # never in a file we ship


def test_the_webhook_receiver_has_deadlines_and_a_connection_limit_by_default() -> None:
    webhooks = load_settings().webhooks
    # the gateway gives up on an answer after 5 s: no real delivery needs longer
    assert (webhooks.webhook_header_timeout_s, webhooks.webhook_body_timeout_s) == (5, 5)
    assert webhooks.webhook_keep_alive_s == 5
    assert webhooks.webhook_max_connections == 100


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("CHARGE_WORKER_WEBHOOK_HEADER_TIMEOUT_S", "0"),
        ("CHARGE_WORKER_WEBHOOK_HEADER_TIMEOUT_S", "600"),
        ("CHARGE_WORKER_WEBHOOK_BODY_TIMEOUT_S", "-1"),
        ("CHARGE_WORKER_WEBHOOK_KEEP_ALIVE_S", "0"),
        ("CHARGE_WORKER_WEBHOOK_KEEP_ALIVE_S", "1.5"),
        ("CHARGE_WORKER_WEBHOOK_MAX_CONNECTIONS", "1"),
        ("CHARGE_WORKER_WEBHOOK_MAX_CONNECTIONS", "lots"),
    ],
)
def test_a_bad_webhook_deadline_or_limit_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError, match=f"^{env}: "):
        load_settings()


def test_the_idempotency_key_prefix_is_empty_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34, item 8: empty by default, so the contract's keys stay exactly as they are."""
    assert load_settings().gateway.idempotency_key_prefix == ""
    monkeypatch.setenv("CHARGE_WORKER_IDEMPOTENCY_KEY_PREFIX", "billing-v2.eu:")
    assert load_settings().gateway.idempotency_key_prefix == "billing-v2.eu:"


@pytest.mark.parametrize(
    "url",
    [
        "https://gateway.example.com",
        "https://10.0.0.7:8443/v1",
        "http://127.0.0.1:8080",
        "http://127.8.0.1",
        "http://localhost:8080",
        "http://LOCALHOST",
        "http://[::1]:8080",
    ],
)
def test_a_gateway_url_is_https_or_loopback(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("GATEWAY_URL", url)
    assert load_settings().gateway.url == url
