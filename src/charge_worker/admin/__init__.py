"""Operators' commands: `provision` (the streams), `maintain` (the stores' retention),
`dlq list | show | replay`, `pause` / `resume` (the kill switch), and `status` (one screen
for the on-call)."""

from charge_worker.admin.dlq import list_command, replay_command, show_command
from charge_worker.admin.maintain import maintain_command
from charge_worker.admin.pause import pause_command, resume_command
from charge_worker.admin.provision import provision_command
from charge_worker.admin.status import status_command

__all__ = [
    "list_command",
    "maintain_command",
    "pause_command",
    "provision_command",
    "replay_command",
    "resume_command",
    "show_command",
    "status_command",
]
