"""`charge-worker reconcile`: compare the gateway's history with the ledger and repair;
`reconcile resolve`: a person's review of what it left for a person."""

from charge_worker.reconcile.reviews import resolve_command
from charge_worker.reconcile.run import reconcile_command

__all__ = ["reconcile_command", "resolve_command"]
