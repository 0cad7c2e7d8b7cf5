"""The NATS adapter reads a delivery's id, count and time from its reply subject itself: what it
reads must be what nats-py's ``Msg.metadata`` reads from the same subject, for both forms the
server sends, and a subject nats-py refuses is refused alike."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from reliable_sub.adapters._nats_replies import delivery_fields

names = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126,
                                       blacklist_characters="."), min_size=1, max_size=12)
numbers = st.integers(min_value=0, max_value=2**63 - 1)
# nanoseconds a datetime can hold (year 1 .. 9999 in UTC)
stamps = st.integers(min_value=0, max_value=253_402_300_799 * 10**9)


@given(stream=names, consumer=names, delivered=numbers, stream_seq=numbers,
       consumer_seq=numbers, stamp=stamps, pending=numbers)
def test_a_v1_subject_reads_as_nats_py_reads_it(stream, consumer, delivered, stream_seq,
                                                consumer_seq, stamp, pending) -> None:
    reply = (f"$JS.ACK.{stream}.{consumer}.{delivered}.{stream_seq}.{consumer_seq}.{stamp}."
             f"{pending}")
    _same_as_nats_py(reply)


@given(domain=names, account=names, stream=names, consumer=names, delivered=numbers,
       stream_seq=numbers, consumer_seq=numbers, stamp=stamps, pending=numbers,
       tail=st.lists(names, max_size=2))
def test_a_v2_subject_reads_as_nats_py_reads_it(domain, account, stream, consumer, delivered,
                                                stream_seq, consumer_seq, stamp, pending,
                                                tail) -> None:
    reply = ".".join(["$JS", "ACK", domain, account, stream, consumer, str(delivered),
                      str(stream_seq), str(consumer_seq), str(stamp), str(pending), *tail])
    _same_as_nats_py(reply)


def _same_as_nats_py(reply: str) -> None:
    metadata = Msg.Metadata._from_reply(reply)
    assert delivery_fields(reply) == (str(metadata.sequence.stream), metadata.num_delivered,
                                      metadata.timestamp)


@pytest.mark.parametrize("reply", [
    None, "", "inbox.abc", "$JS.ACK.s.c.1.2.3.4", "$JS.NAK.s.c.1.2.3.4.5",
    "$JS.ACK.a.b.s.c.1.2.3.4", "_INBOX.ACK.s.c.1.2.3.4.5",
])
def test_a_subject_nats_py_refuses_is_refused(reply) -> None:
    with pytest.raises(NotJSMessageError):
        Msg.Metadata._from_reply(reply)  # type: ignore[arg-type]
    with pytest.raises(NotJSMessageError):
        delivery_fields(reply)


@pytest.mark.parametrize("reply", ["$JS.ACK.s.c.one.2.3.4.5", "$JS.ACK.s.c.1.x.3.4.5",
                                   "$JS.ACK.s.c.1.2.3.now.5"])
def test_a_field_that_is_not_a_number_is_a_value_error(reply) -> None:
    with pytest.raises(ValueError):
        Msg.Metadata._from_reply(reply)
    with pytest.raises(ValueError):
        delivery_fields(reply)
