"""How a reliable-sub message is written as an AMQP message, and read back.

Writing: the body is the data; ``message_id`` a fresh id (the message's identity on every
adapter: dead letters and replays name messages by it); ``timestamp`` the publish time;
delivery mode persistent; ``content_type``, ``correlation_id``, ``reply_to`` ... from the
attributes of their names (adapters/_rabbitmq_properties.py). Attributes are
headers of their own name with string values, unless one cannot be (a name over 255 bytes or
starting ``x-``, RabbitMQ's own; text that is not valid Unicode, a lone surrogate): then all of
them travel as one JSON object in the header ``reliable-sub-attributes``. The ordering key is
the header ``reliable-sub-ordering-key``.

Reading: ``delivery_attempt`` is the quorum queue's ``x-delivery-count`` plus one. Headers of
other publishers become attributes too, whatever their AMQP type: numbers, booleans and
decimals as text, timestamps in ISO 8601, bytes as UTF-8 (else base64), tables and arrays as
JSON. RabbitMQ's own headers (``x-delivery-count``, ``x-death`` ...) are left out. The
properties are attributes too, over headers of their names. A message
without a ``message_id`` (another publisher's) gets ``sha256:`` and the digest of its body and
properties: two such messages alike in every byte are one to a dedup store.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, DeliveryMode

from reliable_sub.adapters._rabbitmq_properties import (
    kept_properties,
    properties,
    read_properties,
)
from reliable_sub.errors import InvalidMessageError
from reliable_sub.message import Message
from reliable_sub.ports import attributes_from_json

ATTRIBUTES_HEADER = "reliable-sub-attributes"
ORDERING_KEY_HEADER = "reliable-sub-ordering-key"
# On a copy held back in a delay queue: the deliveries its message had before
EARLIER_DELIVERIES_HEADER = "reliable-sub-earlier-deliveries"
DELIVERY_COUNT_HEADER = "x-delivery-count"
# AMQP field-table keys are short strings
MAX_HEADER_NAME = 255
_BROKER_HEADERS = frozenset({"x-delivery-count", "x-death", "x-first-death-exchange",
                             "x-first-death-queue", "x-first-death-reason",
                             "x-last-death-exchange", "x-last-death-queue",
                             "x-last-death-reason", "x-stream-offset", "x-received-from"})
_OURS = frozenset({ATTRIBUTES_HEADER, ORDERING_KEY_HEADER, EARLIER_DELIVERIES_HEADER})


def outgoing(payload: bytes, attributes: dict[str, str], ordering_key: str | None
             ) -> aio_pika.Message:
    """The AMQP message for checked data and attributes."""
    headers: dict[str, Any]
    if all(_plain(name, value) for name, value in attributes.items()):
        headers = dict(attributes)
    else:
        headers = {ATTRIBUTES_HEADER: json.dumps(attributes, separators=(",", ":"))}
    if ordering_key:
        try:
            ordering_key.encode()
        except UnicodeEncodeError:
            raise InvalidMessageError(
                f"publish: the ordering key {ordering_key!r} is not valid Unicode text (a lone "
                "surrogate): an AMQP header cannot carry it; pass text that encodes as UTF-8"
            ) from None
        headers[ORDERING_KEY_HEADER] = ordering_key
    return aio_pika.Message(
        payload, headers=headers, message_id=uuid.uuid4().hex,
        timestamp=datetime.now(timezone.utc), delivery_mode=DeliveryMode.PERSISTENT,
        **properties(attributes))


def _plain(name: str, value: str) -> bool:
    """Whether an attribute can be a header of its own (else all go as one JSON header, whose
    escapes carry any text, a lone surrogate too)."""
    try:
        encoded = name.encode()
        value.encode()
    except UnicodeEncodeError:
        return False
    return len(encoded) <= MAX_HEADER_NAME and not name.startswith("x-") and name not in _OURS


def incoming(raw: AbstractIncomingMessage, subscription: str) -> tuple[Message, str | None]:
    """The message ``raw`` carries, and what is wrong with it (None: nothing)."""
    headers = dict(raw.headers or {})
    problem = None
    attributes = {name: as_text(value) for name, value in headers.items()
                  if name not in _BROKER_HEADERS and name not in _OURS}
    packed = headers.get(ATTRIBUTES_HEADER)
    if packed is not None:
        try:
            attributes.update(attributes_from_json(
                packed if isinstance(packed, str | bytes) else str(packed)))
        except ValueError as error:
            problem = f"{ATTRIBUTES_HEADER} header: {error}"
    ordering_key = headers.get(ORDERING_KEY_HEADER)
    if ordering_key is not None and not isinstance(ordering_key, str):
        problem = f"{ORDERING_KEY_HEADER} header is a {type(ordering_key).__name__}, not text"
        ordering_key = None
    read_properties(raw, attributes)
    attempt = _count(headers.get(DELIVERY_COUNT_HEADER)) + _count(
        headers.get(EARLIER_DELIVERIES_HEADER)) + 1
    return Message.received(message_id(raw), bytes(raw.body), attributes, attempt,
                            _utc(raw.timestamp), ordering_key or None, subscription), problem


def unreadable(raw: AbstractIncomingMessage, subscription: str) -> Message:
    """The message ``raw`` carries when its parse raised: its body and properties, and nothing
    of its headers (where the parse failed)."""
    return Message(id=str(raw.message_id or f"tag-{raw.delivery_tag}"), data=bytes(raw.body),
                   attributes=read_properties(raw, {}), subscription=subscription)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def delayed_copy(raw: AbstractIncomingMessage, attempt: int) -> aio_pika.Message:
    """The copy of ``raw`` (delivered as ``attempt``) a delay queue holds back: the same body,
    id, headers and properties, counting the deliveries so far."""
    headers = {k: v for k, v in (raw.headers or {}).items() if k not in _BROKER_HEADERS}
    headers[EARLIER_DELIVERIES_HEADER] = attempt
    kept = kept_properties(raw, headers)
    return aio_pika.Message(
        bytes(raw.body), headers=headers, message_id=message_id(raw), timestamp=raw.timestamp,
        delivery_mode=DeliveryMode.PERSISTENT, **kept)


def message_id(raw: AbstractIncomingMessage) -> str:
    if raw.message_id:
        return str(raw.message_id)
    digest = hashlib.sha256(bytes(raw.body))
    for name in ("correlation_id", "timestamp", "app_id", "type", "reply_to", "content_type"):
        digest.update(f"{name}={getattr(raw, name, None)!r};".encode())
    headers = {k: v for k, v in (raw.headers or {}).items() if k not in _BROKER_HEADERS}
    digest.update(repr(sorted((k, repr(v)) for k, v in headers.items())).encode())
    return f"sha256:{digest.hexdigest()[:32]}"


def as_text(value: object) -> str:
    """A header value of any AMQP type as an attribute's text."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bool | int | float | Decimal) or value is None:
        return str(value) if value is not None else ""
    return json.dumps(_jsonable(value), separators=(",", ":"))


def _jsonable(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | bool | int | float) or value is None:
        return value
    return as_text(value)


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
