"""What a JetStream message's reply subject says about its delivery, read without nats-py's
``Msg.metadata`` (a frozen dataclass and two more objects per message, most of which the adapter
never reads).

The server acks through ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
seq>.<timestamp ns>.<pending>`` (9 tokens), or with a domain and an account hash after ``ACK``
(11 tokens or more, as newer servers send). The fields read here are the ones ``Msg.metadata``
gives for the same subject; ``tests/test_nats_replies.py`` checks that against nats-py.
"""

from __future__ import annotations

from datetime import datetime, timezone

from nats.errors import NotJSMessageError

_V1_TOKENS = 9
_V2_MIN_TOKENS = 11


def delivery_fields(reply: str | None) -> tuple[str, int, datetime]:
    """The stream sequence (as text, the message's id), how many times the message has been
    delivered, and when it was stored, from a JetStream reply subject.

    Raises:
        NotJSMessageError: ``reply`` is not a JetStream ack subject (as ``Msg.metadata`` does).
        ValueError: a numeric field is not a number.
    """
    if not reply:
        raise NotJSMessageError
    tokens = reply.split(".")
    count = len(tokens)
    if count == _V1_TOKENS:
        skip = 0
    elif count >= _V2_MIN_TOKENS:
        skip = 2  # the domain and the account hash
    else:
        raise NotJSMessageError
    if tokens[0] != "$JS" or tokens[1] != "ACK":
        raise NotJSMessageError
    return (str(int(tokens[5 + skip])), int(tokens[4 + skip]),
            datetime.fromtimestamp(int(tokens[7 + skip]) / 1_000_000_000.0, timezone.utc))


__all__ = ["delivery_fields"]
