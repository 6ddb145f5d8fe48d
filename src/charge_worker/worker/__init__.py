"""`charge-worker run`: consume `charges.due` and charge each due subscription once.

`consumer` fetches, heartbeats and executes actions; `pipeline` turns a delivery into a
result; `decisions` maps results to actions; `run` wires them together.
"""

from charge_worker.worker.run import run_command

__all__ = ["run_command"]
