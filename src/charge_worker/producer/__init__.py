"""`charge-worker produce`: record due charges as `scheduled`, then publish them."""

from charge_worker.producer.schedule import produce_command

__all__ = ["produce_command"]
