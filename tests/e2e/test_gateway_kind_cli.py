"""`GATEWAY_KIND` as a user sets it: a wrong adapter, or a key the adapter cannot use, stops
the command at start with one line naming the setting (and never the key)."""

from __future__ import annotations

from charge_worker.sandbox.embedded import free_port
from tests.support.cli import cli


def test_an_unknown_gateway_kind_is_one_line_naming_it() -> None:
    result = cli("provision", env={"GATEWAY_KIND": "paypal"})
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "GATEWAY_KIND" in line


def test_a_publishable_key_for_stripe_is_one_line_naming_the_setting_not_the_key() -> None:
    key = "pk_test_not_a_secret_key_0123456789"
    env = {
        "GATEWAY_KIND": "stripe",
        "GATEWAY_API_KEY": key,
        "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres",
        "NATS_URL": f"nats://127.0.0.1:{free_port()}",
    }
    result = cli("reconcile", env=env)
    assert result.returncode != 0
    [line] = result.stderr.strip().splitlines()
    assert "GATEWAY_API_KEY" in line
    assert "sk_" in line
    assert key not in result.stderr + result.stdout
