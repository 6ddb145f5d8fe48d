"""Every migration passes squawk (the PostgreSQL migration linter, configured in
`.squawk.toml`), or its finding is listed in ACCEPTED with why it was safe when written.

A file runs as `charge-worker migrate` will run it: in a transaction, or, after the
`-- migrate: no-transaction` marker, statement by statement without one (where squawk's
`prefer-robust-stmts` then asks every statement to be re-runnable: `IF NOT EXISTS`). One rule
is ours: `CONCURRENTLY` only in a no-transaction file. An applied file can never change (its
checksum is recorded), so a listed (file, rule) stays true, and a stale entry fails too.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from charge_worker.migrate import Migration

ROOT = Path(__file__).parents[2]
MIGRATIONS = ROOT / "migrations"
CONFIG = ROOT / ".squawk.toml"
HOW = "docs/deploying.md, 'Schema upgrades'"

_COUNTS = (
    "a counter bounded far below 2^31 (gateway calls, tries, attempts, an interval count, "
    "a period's event sequence, a try number); money and ids are bigint, and the rule stays "
    "on for new files because an integer amount in minor units overflows at 21 million"
)
_BEFORE_CONCURRENTLY = (
    "written before migrate could run a file outside a transaction, so CONCURRENTLY was "
    "impossible; the plain build blocks the table's writes (not its reads) for one scan"
)
_WIDER_CHECK = (
    "the status CHECK is dropped and added again, wider and NOT VALID, in the same "
    "transaction: no other session ever sees the table without it, and nothing is scanned"
)

# (file, rule) -> why it was acceptable when the file was written. A new file belongs here
# only as a contract step's drop, naming the release that stopped using what it drops; any
# other finding is fixed in the migration (docs/deploying.md, "Schema upgrades").
ACCEPTED: dict[tuple[str, str], str] = {
    ("0001_ledger.sql", "prefer-bigint-over-int"): _COUNTS,
    ("0002_charge_events.sql", "prefer-identity"): "bigserial, as every table had then; "
    "new tables use GENERATED ALWAYS AS IDENTITY",
    ("0002_charge_events.sql", "require-concurrent-index-creation"): _BEFORE_CONCURRENTLY,
    ("0003_webhook_inbox.sql", "prefer-bigint-over-int"): _COUNTS,
    ("0003_webhook_inbox.sql", "prefer-identity"): "bigserial, as every table had then",
    ("0004_billing_anchor.sql", "prefer-bigint-over-int"): _COUNTS,
    ("0006_reconcile_checkpoint.sql", "require-concurrent-index-creation"): (_BEFORE_CONCURRENTLY),
    ("0007_rate_buckets.sql", "prefer-bigint-over-int"): "tokens granted in one refill "
    "of one bucket, bounded by the rate",
    ("0008_charge_events_by_month.sql", "renaming-table"): "charge_events becomes the "
    "partition of the old rows and a partitioned charge_events takes its name in the same "
    "transaction: every client still reads and writes charge_events",
    ("0008_charge_events_by_month.sql", "renaming-object"): "the renamed table's own "
    "constraint and index, renamed with it; no client names them",
    ("0010_processing_and_declines.sql", "ban-drop-constraint"): _WIDER_CHECK,
    ("0010_processing_and_declines.sql", "require-concurrent-index-creation"): (
        _BEFORE_CONCURRENTLY
    ),
    ("0011_webhook_ignored.sql", "ban-drop-constraint"): _WIDER_CHECK,
    ("0011_webhook_ignored.sql", "require-concurrent-index-deletion"): "the webhook "
    "journal's index rebuilt with a new predicate in one transaction; the journal keeps "
    "3 days of events, so the exclusive lock lasts one small build",
    ("0011_webhook_ignored.sql", "require-concurrent-index-creation"): "the same rebuild, "
    "on the small webhook journal",
    ("0012_charge_outcomes.sql", "prefer-bigint-over-int"): _COUNTS,
    ("0013_retries.sql", "ban-drop-constraint"): _WIDER_CHECK,
    ("0013_retries.sql", "prefer-bigint-over-int"): _COUNTS,
    ("0013_retries.sql", "require-concurrent-index-creation"): _BEFORE_CONCURRENTLY,
}

CONCURRENTLY_IN_TRANSACTION = "concurrently-needs-no-transaction-marker"
_CONCURRENTLY = re.compile(r"\bCONCURRENTLY\b", re.I)
_COMMENT = re.compile(r"--[^\n]*")


@dataclass(frozen=True, order=True)
class Finding:
    file: str
    line: int  # from 1
    rule: str
    message: str

    def __str__(self) -> str:
        return f"migrations/{self.file}:{self.line}: {self.rule}: {self.message}"


def squawk() -> str:
    found = shutil.which("squawk", path=str(Path(sys.executable).parent)) or shutil.which("squawk")
    assert found, "squawk is not installed: `make install` (the dev extra's squawk-cli)"
    return found


def lint(paths: list[Path]) -> list[Finding]:
    """squawk's findings for `paths`, each linted as migrate runs it, and ours."""
    findings: list[Finding] = []
    files = {path: Migration(path.name[:4], path, path.read_text()) for path in paths}
    for in_transaction in (True, False):
        group = [str(p) for p, m in files.items() if m.transactional is in_transaction]
        if not group:
            continue
        mode = "--assume-in-transaction" if in_transaction else "--no-assume-in-transaction"
        ran = subprocess.run(
            [squawk(), "--config", str(CONFIG), "--reporter", "json", mode, *group],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert ran.stdout.strip(), f"squawk printed nothing: {ran.stderr}"
        findings += [
            Finding(
                Path(f["file"]).name,
                f["line"] + 1,
                f["rule_name"],
                " ".join(filter(None, (f["message"], f.get("help")))),
            )
            for f in json.loads(ran.stdout)
        ]
    for path, migration in files.items():
        if migration.transactional:
            for number, text in enumerate(migration.sql.splitlines(), start=1):
                if _CONCURRENTLY.search(_COMMENT.sub("", text)):
                    message = "CONCURRENTLY cannot run in a transaction: first line "
                    message += "`-- migrate: no-transaction`"
                    findings.append(
                        Finding(path.name, number, CONCURRENTLY_IN_TRANSACTION, message)
                    )
    return sorted(findings)


def test_every_migration_passes_the_linter_or_is_listed_with_its_reason() -> None:
    new = [f for f in lint(sorted(MIGRATIONS.glob("*.sql"))) if (f.file, f.rule) not in ACCEPTED]
    assert not new, (
        "migrations break squawk's rules (https://squawkhq.com/docs/rules; how to write an "
        f"online-safe migration: {HOW}):\n" + "\n".join(f"  {f}" for f in new)
    )


def test_every_listed_exception_is_still_found() -> None:
    found = {(f.file, f.rule) for f in lint(sorted(MIGRATIONS.glob("*.sql")))}
    assert not set(ACCEPTED) - found, "listed but no longer found: remove them from ACCEPTED"


ON_LEDGER = "CREATE INDEX charge_attempts_x_idx ON charge_attempts (updated_at);\n"
MARKER = "-- migrate: no-transaction\n"


@pytest.mark.parametrize(
    ("sql", "rule"),
    [
        (ON_LEDGER, "require-concurrent-index-creation"),
        (MARKER + ON_LEDGER.replace("INDEX", "INDEX CONCURRENTLY"), "prefer-robust-stmts"),
        (
            "-- the ledger's new lookup\n"
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS x_idx ON charge_attempts (updated_at);\n",
            CONCURRENTLY_IN_TRANSACTION,
        ),
        ("ALTER TABLE charge_attempts DROP COLUMN last_error;\n", "ban-drop-column"),
        ("ALTER TABLE charge_attempts RENAME COLUMN last_error TO error;\n", "renaming-column"),
        ("ALTER TABLE charge_attempts ADD COLUMN fee_minor integer;\n", "prefer-bigint-over-int"),
        (
            "ALTER TABLE charge_attempts ADD CONSTRAINT c CHECK (attempt < 9);\n",
            "constraint-missing-not-valid",
        ),
    ],
)
def test_a_new_migration_that_is_not_online_safe_fails_naming_the_file_and_rule(
    tmp_path: Path, sql: str, rule: str
) -> None:
    path = tmp_path / "0099_new.sql"
    path.write_text(sql)
    assert rule in {f.rule for f in lint([path]) if f.file == "0099_new.sql"}


def test_a_concurrent_build_in_its_own_no_transaction_file_passes(tmp_path: Path) -> None:
    path = tmp_path / "0099_new.sql"
    path.write_text(
        MARKER + "-- reconcile's new sweep\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS charge_attempts_x_idx\n"
        "    ON charge_attempts (updated_at) WHERE status = 'processing';\n"
    )
    assert lint([path]) == []
