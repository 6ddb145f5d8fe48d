"""`charge-worker produce`: record due charges as `scheduled`, then publish them."""

from charge_worker.producer.processes import produce_in_processes
from charge_worker.producer.publish import Share
from charge_worker.producer.schedule import produce_command

__all__ = ["Share", "produce_command", "produce_in_processes"]
