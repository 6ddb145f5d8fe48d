"""`charge-worker produce`: record due charges as `scheduled`, then publish them; and
`charge-worker retry`: start a declined period's next try now, and publish it."""

from charge_worker.producer.processes import produce_in_processes
from charge_worker.producer.publish import Share
from charge_worker.producer.retry import retry_command
from charge_worker.producer.schedule import produce_command

__all__ = ["Share", "produce_command", "produce_in_processes", "retry_command"]
