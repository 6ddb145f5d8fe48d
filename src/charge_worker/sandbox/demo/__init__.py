"""`charge-worker demo`: the whole stack embedded, sample charges, a printed account."""

from charge_worker.sandbox.demo.run import run_demo

__all__ = ["run_demo"]
