"""`charge-worker reconcile`: compare the gateway's history with the ledger and repair."""

from charge_worker.reconcile.run import reconcile_command

__all__ = ["reconcile_command"]
