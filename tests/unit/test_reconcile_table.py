"""The human table `charge-worker reconcile` prints: what the gateway said reaches the
terminal escaped, never obeyed."""

from __future__ import annotations

import datetime as dt

from charge_worker.reconcile.report import Failure, Finding, Report, table

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def test_gateway_strings_in_findings_and_failures_are_escaped() -> None:
    report = Report(started_at=NOW, since=NOW, dry_run=False)
    report.add(
        "unmatched_charges",
        Finding(1, dt.date(2026, 12, 1), "reported", {"customer": "cus_\x1b[2Jx\u202e"}),
    )
    report.failures.append(
        Failure("unmatched_charges", "2:2026-12-01", "gateway said \x1b]0;pwn\x07")
    )

    printed = "\n".join(table(report))

    assert "\x1b" not in printed
    assert "\u202e" not in printed
    assert "\x07" not in printed
    assert "cus_\\x1b[2Jx\\u202e" in printed
    assert "gateway said \\x1b]0;pwn\\x07" in printed
