"""How the producer reads a stream's answer to a publish (`publish._ack`)."""

from __future__ import annotations

import json

import pytest
from nats.js.api import PubAck

from charge_worker.producer.publish import _ack


@pytest.mark.parametrize(
    ("answer", "ack"),
    [
        (b'{"stream":"CHARGES","seq":42}', PubAck("CHARGES", 42)),
        (b'{"stream":"CHARGES","seq":42,"duplicate":true}', PubAck("CHARGES", 42, duplicate=True)),
        # shapes the quick path does not know are parsed all the same
        (b'{"stream":"CHARGES","domain":"hub","seq":7}', PubAck("CHARGES", 7)),
        (b'{"seq":9,"stream":"CHARGES"}', PubAck("CHARGES", 9)),
        (json.dumps({"stream": 'a"b', "seq": 3}).encode(), PubAck('a"b', 3)),
    ],
)
def test_a_stored_message_is_acked_with_its_stream_and_sequence(answer: bytes, ack: PubAck) -> None:
    assert _ack(answer) == ack


def test_a_refusal_is_no_ack_even_when_it_names_the_stream() -> None:
    refusal = (
        b'{"error":{"code":400,"err_code":10060,"description":"expected stream does not match"},'
        b'"stream":"OTHER","seq":0}'
    )
    assert _ack(refusal) is None


@pytest.mark.parametrize("answer", [b"", b"[]", b'{"stream":"CHARGES"}'])
def test_no_answer_from_a_stream_raises(answer: bytes) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        _ack(answer)
