"""How a reliable-sub message is written as a Kafka record, and read back.

Writing: the value is the data; the key is the ordering key in UTF-8 (None without one: the
partitioner spreads such records); each attribute is a header of its own name with its value in
UTF-8, unless one cannot be (text that is not valid Unicode, a lone surrogate; a name of ours,
or one holding NUL): then all of them travel as one JSON object in the header
``reliable-sub-attributes``. The idempotency key is the ``idempotency-key`` attribute, a
header like the others.

Reading: the message id is ``topic/partition/offset`` (stable across redeliveries, and what
``publish`` returned); ``publish_time`` the record's timestamp; attributes are the headers, a
repeated header name giving its last value, a null value the empty string, and a value that is
not UTF-8 its base64 text. A tombstone (a null value) has empty data. The ordering key is the
record key as text (a key that is not UTF-8: ``base64:`` and its base64), or None when the
subscription orders nothing (``ordering="none"``).
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timezone
from typing import Any

from reliable_sub.errors import InvalidMessageError
from reliable_sub.message import Message
from reliable_sub.ports import attributes_from_json

ATTRIBUTES_HEADER = "reliable-sub-attributes"
# A record key that is not UTF-8 becomes this prefix and its base64 as the ordering key.
BINARY_KEY_PREFIX = "base64:"
_OURS = frozenset({ATTRIBUTES_HEADER})
# The client's timestamp types: 0 is "not available".
_NO_TIMESTAMP = 0

Headers = list[tuple[str, str | bytes | None]]


def message_id(topic: str, partition: int, offset: int) -> str:
    """A record's message id."""
    return f"{topic}/{partition}/{offset}"


def outgoing(attributes: dict[str, str], ordering_key: str | None
             ) -> tuple[bytes | None, Headers]:
    """The record key and headers for checked attributes and an ordering key."""
    key = None
    if ordering_key:
        try:
            key = ordering_key.encode()
        except UnicodeEncodeError:
            raise InvalidMessageError(
                f"publish: the ordering key {ordering_key!r} is not valid Unicode text (a lone "
                "surrogate): a record key holds UTF-8; pass text that encodes as UTF-8"
            ) from None
    try:
        headers: Headers = [(name, value.encode()) for name, value in attributes.items()
                            if _plain(name)]
    except UnicodeEncodeError:
        headers = []
    if len(headers) != len(attributes):
        packed = json.dumps(attributes, separators=(",", ":"))  # escapes carry any text
        headers = [(ATTRIBUTES_HEADER, packed.encode())]
    return key, headers


def _plain(name: str) -> bool:
    """Whether an attribute name can be a header's (librdkafka takes header names as C strings:
    one with a NUL would be cut there)."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in name and name not in _OURS


def incoming(record: Any, subscription: str, attempt: int, ordered: bool
             ) -> tuple[Message, str | None]:
    """The message ``record`` carries (a client ``Message``), and what is wrong with it (None:
    nothing)."""
    problem = None
    attributes: dict[str, str] = {}
    packed = None
    for name, value in record.headers() or ():
        if name == ATTRIBUTES_HEADER:
            packed = value
        else:
            attributes[name] = as_text(value)
    if packed is not None:
        try:
            attributes.update(attributes_from_json(packed))
        except ValueError as error:
            problem = f"{ATTRIBUTES_HEADER} header: {error}"
    key = record.key()
    ordering_key = key_text(key) if ordered and key else None
    value = record.value()
    message = Message.received(
        message_id(record.topic(), record.partition(), record.offset()),
        value if value is not None else b"", attributes, attempt, publish_time(record),
        ordering_key, subscription)
    return message, problem


def key_text(key: bytes) -> str:
    """A record key as an ordering key."""
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return BINARY_KEY_PREFIX + base64.b64encode(key).decode()


def as_text(value: bytes | None) -> str:
    """A header value as an attribute's text."""
    if value is None:
        return ""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return base64.b64encode(value).decode()


def publish_time(record: Any) -> datetime | None:
    """The record's timestamp (create or log-append time), None if it has none."""
    kind, millis = record.timestamp()
    if kind == _NO_TIMESTAMP or millis < 0:
        return None
    try:
        return datetime.fromtimestamp(millis / 1000, tz=timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None


def unreadable(record: Any, subscription: str, attempt: int) -> Message:
    """What can be read of a record whose headers could not be: its id and data."""
    value = record.value()
    return Message(id=message_id(record.topic(), record.partition(), record.offset()),
                   data=value if value is not None else b"", delivery_attempt=attempt,
                   subscription=subscription)


__all__ = ["ATTRIBUTES_HEADER", "BINARY_KEY_PREFIX", "as_text", "incoming", "key_text",
           "message_id", "outgoing", "publish_time", "unreadable"]
