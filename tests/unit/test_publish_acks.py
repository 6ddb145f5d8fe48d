"""How the producer reads a stream's answer to a publish (`publish.stored`): an ack counts
the charge as published (or deduplicated); anything else sends it down the slow way, one
`js.publish` at a time up to the retry horizon, which fails it with the reason."""

from __future__ import annotations

import json

import pytest
from nats.js.api import PubAck

from charge_worker.producer.publish import stored


@pytest.mark.parametrize(
    ("answer", "ack"),
    [
        (b'{"stream":"CHARGES","seq":42}', PubAck("CHARGES", 42)),
        (b'{"stream":"CHARGES","seq":42,"duplicate":true}', PubAck("CHARGES", 42, duplicate=True)),
        (b'{"stream":"CHARGES","domain":"hub","seq":7}', PubAck("CHARGES", 7, domain="hub")),
        (b'{"seq":9,"stream":"CHARGES","unknown":1}', PubAck("CHARGES", 9)),
        (json.dumps({"stream": 'a"b', "seq": 3}).encode(), PubAck('a"b', 3)),
    ],
)
def test_a_stored_message_is_acked_with_its_stream_sequence_and_duplicate_flag(
    answer: bytes, ack: PubAck
) -> None:
    assert stored(answer) == ack


@pytest.mark.parametrize(
    "answer",
    [
        # another stream holds the subject: refused, though the answer names a stream
        b'{"error":{"code":400,"err_code":10060,"description":"expected stream does not match"},'
        b'"stream":"OTHER","seq":0}',
        b"",  # no stream listens on the subject: a 503 status without a body
        b"[]",
        b'{"stream":"CHARGES"}',  # no sequence: nothing says where it was stored
    ],
    ids=["refused", "no responders", "not an object", "no sequence"],
)
def test_a_refusal_or_no_stream_is_no_ack(answer: bytes) -> None:
    assert stored(answer) is None
