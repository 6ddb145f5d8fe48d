"""`consumer.position`: the stream sequence and delivery count off a JetStream ack subject,
the same as nats-py's `msg.metadata` reads, in both subject formats."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from charge_worker.worker.consumer import position

SUBJECTS = [
    # v1: $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>
    "$JS.ACK.CHARGES.charge-workers.3.1234.1200.1764547200000000000.17",
    # v2: a domain and an account hash after ACK
    "$JS.ACK.hub.ACCHASH.CHARGES.charge-workers.2.99.98.1764547200000000000.0",
    # v2 with the random token nats-server appends
    "$JS.ACK._.ACCHASH.CHARGES.charge-workers.1.7.7.1764547200000000000.5.xyz",
]


def _msg(reply: str) -> Msg:
    return Msg(None, subject="charges.due", reply=reply, data=b"{}")  # type: ignore[arg-type]


@pytest.mark.parametrize("reply", SUBJECTS)
def test_reads_what_nats_py_reads(reply: str) -> None:
    msg = _msg(reply)
    meta = _msg(reply).metadata
    assert position(msg) == (meta.sequence.stream, meta.num_delivered)


@pytest.mark.parametrize("reply", ["", "charges.due.reply", "$JS.ACK.only.five.tokens"])
def test_a_subject_that_is_no_ack_subject_raises_as_nats_py_does(reply: str) -> None:
    with pytest.raises(NotJSMessageError):
        position(_msg(reply))
