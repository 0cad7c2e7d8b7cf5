"""Message.received: the adapters' fast way to build a Message is the same Message."""

import dataclasses
from datetime import datetime, timezone

import pytest

from reliable_sub import Message


def test_received_builds_the_message_the_constructor_builds() -> None:
    fields = dict(id="1700000000000-0", data=b'{"order": 1}',
                  attributes={"idempotency-key": "k-1"}, delivery_attempt=3,
                  publish_time=datetime(2026, 11, 27, tzinfo=timezone.utc),
                  ordering_key="order-1", subscription="billing")
    received = Message.received(*fields.values())
    assert received == Message(**fields)
    assert dataclasses.asdict(received) == fields
    assert received.idempotency_key == "k-1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        received.id = "another"  # type: ignore[misc]


def test_received_takes_every_field_in_the_dataclass_order() -> None:
    # a field added to Message must be added to Message.received too
    names = [field.name for field in dataclasses.fields(Message)]
    assert names == ["id", "data", "attributes", "delivery_attempt", "publish_time",
                     "ordering_key", "subscription"]
