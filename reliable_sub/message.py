"""What a handler sees (Message) and what an adapter hands the core (Delivery)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime

IDEMPOTENCY_KEY_ATTRIBUTE = "idempotency-key"


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery of a broker message, as a handler receives it.

    Attributes:
        id: the broker's message id (stable across redeliveries).
        data: the payload.
        attributes: string key/value metadata set by the publisher.
        delivery_attempt: 1 on first delivery, counting up on every redelivery.
        publish_time: when the broker accepted the message (UTC).
        ordering_key: the publisher's ordering key, or None.
        subscription: the subscription this delivery came from.
    """

    id: str
    data: bytes
    attributes: dict[str, str] = field(default_factory=dict)
    delivery_attempt: int = 1
    publish_time: datetime | None = None
    ordering_key: str | None = None
    subscription: str = ""

    @property
    def idempotency_key(self) -> str:
        """The ``idempotency-key`` attribute when the publisher set one, else the message id."""
        return self.attributes.get(IDEMPOTENCY_KEY_ATTRIBUTE) or self.id

    @classmethod
    def received(
        cls,
        id: str,
        data: bytes,
        attributes: dict[str, str],
        delivery_attempt: int,
        publish_time: datetime | None,
        ordering_key: str | None,
        subscription: str,
    ) -> Message:
        """The same Message as ``Message(...)`` with every field given, built for an adapter's
        receive path: it writes the slots directly instead of running the frozen dataclass's
        ``__init__`` (0.5 µs against 1.2 µs per message on CPython 3.11)."""
        message = _new(cls)
        _set_id(message, id)
        _set_data(message, data)
        _set_attributes(message, attributes)
        _set_delivery_attempt(message, delivery_attempt)
        _set_publish_time(message, publish_time)
        _set_ordering_key(message, ordering_key)
        _set_subscription(message, subscription)
        return message


_new = object.__new__
# The slots' own setters, in field order: they write past the frozen class's __setattr__, as its
# __init__ does (a field added to Message fails this unpacking at import until `received` has it).
(_set_id, _set_data, _set_attributes, _set_delivery_attempt, _set_publish_time,
 _set_ordering_key, _set_subscription) = (Message.__dict__[f.name].__set__ for f in fields(Message))


@dataclass(slots=True, eq=False)
class Delivery:
    """A message handed out by an adapter, with the handle used to ack, nack or extend it.

    ``ack_id`` identifies this one delivery: after a redelivery the old ``ack_id`` is stale.
    ``received_at`` is the Subscriber's clock reading when the receive call returned.
    ``malformed`` is set by an adapter that could not read the broker's entry as a message (the
    parse error); ``message`` then carries what could be read, and the Subscriber dead-letters
    it without calling the handler.
    """

    message: Message
    ack_id: str
    received_at: float = 0.0
    malformed: str | None = None

    @property
    def size(self) -> int:
        """Payload bytes, for flow control."""
        return len(self.message.data)


__all__ = ["IDEMPOTENCY_KEY_ATTRIBUTE", "Delivery", "Message"]
