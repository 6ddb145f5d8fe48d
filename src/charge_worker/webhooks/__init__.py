"""`charge-worker webhooks`: receive, journal and apply the gateway's webhooks."""

from charge_worker.webhooks.serve import serve_command

__all__ = ["serve_command"]
