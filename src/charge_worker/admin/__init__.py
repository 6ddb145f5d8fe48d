"""Operators' commands: `provision` (the streams), `maintain` (the stores' retention), and
`dlq list | show | replay`."""

from charge_worker.admin.dlq import list_command, replay_command, show_command
from charge_worker.admin.maintain import maintain_command
from charge_worker.admin.provision import provision_command

__all__ = [
    "list_command",
    "maintain_command",
    "provision_command",
    "replay_command",
    "show_command",
]
