"""Reconcile's figures as Prometheus names them: written once, read by the textfile
`reconcile --metrics-file` writes (reconcile/report.py) and by the gauges every worker pod
exports from `job_runs` (exporter.py), so the alerts read the same series either way."""

from __future__ import annotations

RECONCILE_PREFIX = "charge_worker_reconcile"
LAST_RUN = "last_run_timestamp_seconds"

# `charge_worker_reconcile_<name>`: help. Every name but LAST_RUN is a count of the run's
# report (reconcile.report.Counts), and a key of its `job_runs` summary.
RECONCILE_GAUGES: dict[str, str] = {
    LAST_RUN: "Unix time of the last reconcile run that finished.",
    "double_charges": "Extra successful charges found for a key already charged (last run).",
    "refunds": "Extra charges refunded (last run).",
    "unrecorded_charges": (
        "Keys the ledger records as declined, failed, blocked, retry_scheduled or"
        " action_required that the gateway charged, with a charge matching the row"
        " (last run)."
    ),
    "ledger_repaired": "Unrecorded charges now recorded as the key's charge (last run).",
    "discrepancies": "Charges the ledger records that the gateway does not know (last run).",
    "unknown_resolved": "Unknown gateway outcomes resolved by lookup (last run).",
    "republished": "Quiet scheduled/pending charges re-published to the stream (last run).",
    "adopted": (
        "Charges the gateway made for open rows whose message was gone, recorded (last run)."
    ),
    "adopted_rows": (
        "Charges the gateway made for keys whose ledger row was lost, recorded from their"
        " subscription (last run)."
    ),
    "still_waiting": (
        "Quiet scheduled/pending charges whose message still waits in the stream (last run)."
    ),
    "unmatched_charges": (
        "Captured gateway charges for our keys not proven the key's own (no ledger row, or"
        " another amount, currency or customer): neither refunded nor recorded, left for a"
        " person (last run)."
    ),
    "errors": "Keys a sweep could not handle (last run).",
}
RECONCILE_COUNTS = tuple(name for name in RECONCILE_GAUGES if name != LAST_RUN)
