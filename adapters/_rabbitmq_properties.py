"""AMQP message properties as attributes, and back.

Besides its headers an AMQP message has a few properties of fixed names, which every AMQP client
reads where it looks for them: aio-pika's ``message.correlation_id``, FastStream's
``message.correlation_id`` and RPC replies (``reply_to``). Each is the attribute of the
property's name with ``-`` for ``_``, as ``content_type`` has always been ``content-type``:

================  ==================  ==========================================================
property          attribute           set by ``publish``
================  ==================  ==========================================================
content_type      content-type        yes
content_encoding  content-encoding    yes
correlation_id    correlation-id      yes
reply_to          reply-to            yes
type              type                yes
app_id            app-id              yes
priority          priority            yes, for ``0`` ... ``255`` written as integers
user_id           user-id             no: RabbitMQ refuses a ``user_id`` other than the
                                      connection's user, so a replay would fail
expiration        expiration          no: a dead-letter copy would expire from its queue
================  ==================  ==========================================================

The message id and the timestamp are the message's ``id`` and ``publish_time``, not attributes.

Reading: a property overrides a header of the same name (the property is what the other AMQP
clients act on). aio-pika reads an absent priority as 0 and an empty string as no property, so
priority 0 and empty properties give no attribute (a header of that name still does). The
expiration is in milliseconds, as AMQP has it.

Writing: every attribute is a header still (see adapters/_rabbitmq_messages.py), so a consumer
that reads headers sees what it saw before; those of the names set by ``publish`` also set the
property when it can carry the value: a short string (1 to 255 bytes of UTF-8), a priority
written as ``str(n)`` for n in 0 ... 255. Otherwise the value travels in the header only.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

# (attribute, property) of the properties publish sets
WRITTEN = (
    ("content-type", "content_type"),
    ("content-encoding", "content_encoding"),
    ("correlation-id", "correlation_id"),
    ("reply-to", "reply_to"),
    ("type", "type"),
    ("app-id", "app_id"),
)
PRIORITY = "priority"
USER_ID = "user-id"
EXPIRATION = "expiration"
# AMQP short strings: a length octet, then UTF-8
MAX_SHORT_STRING = 255
_PRIORITIES = frozenset(str(n) for n in range(256))
_READ_NAMES = tuple(name for name, _ in WRITTEN)
_READ = attrgetter(*(prop for _, prop in WRITTEN), "priority", "user_id", "expiration")


def properties(attributes: dict[str, str]) -> dict[str, Any]:
    """The properties ``attributes`` set, as keyword arguments of ``aio_pika.Message``."""
    found: dict[str, Any] = {}
    for name, prop in WRITTEN:
        value = attributes.get(name)
        if value and _short(value):
            found[prop] = value
    priority = attributes.get(PRIORITY)
    if priority is not None and priority in _PRIORITIES:
        found["priority"] = int(priority)
    return found


def _short(value: str) -> bool:
    try:
        return len(value.encode()) <= MAX_SHORT_STRING
    except UnicodeEncodeError:  # a lone surrogate: for the JSON header only
        return False


def read_properties(raw: AbstractIncomingMessage, attributes: dict[str, str]) -> dict[str, str]:
    """``attributes`` with the properties of ``raw`` added (over headers of their names)."""
    values = _READ(raw)  # one C call for the nine
    if not any(values):
        return attributes
    for name, value in zip(_READ_NAMES, values[:-3], strict=True):
        if value:
            attributes[name] = str(value)
    priority, user_id, expiration = values[-3:]
    if priority:
        attributes[PRIORITY] = str(priority)
    if user_id:
        attributes[USER_ID] = str(user_id)
    if expiration is not None:
        attributes[EXPIRATION] = expiration_text(expiration)
    return attributes


def expiration_text(seconds: Any) -> str:
    """aio-pika's expiration (seconds, from AMQP's milliseconds) as AMQP wrote it."""
    return str(round(float(seconds) * 1000))


def kept_properties(raw: AbstractIncomingMessage, headers: dict[str, Any]) -> dict[str, Any]:
    """The properties a copy of ``raw`` keeps (a delayed redelivery): those ``publish`` sets, as
    they are; the read-only ones as headers of their attribute names (a copy with the expiration
    would expire, one with another user's id be refused), so its attributes stay the same."""
    if raw.user_id:
        headers[USER_ID] = str(raw.user_id)
    if raw.expiration is not None:
        headers[EXPIRATION] = expiration_text(raw.expiration)
    kept = {prop: getattr(raw, prop) for _, prop in WRITTEN}
    if raw.priority:
        kept[PRIORITY] = raw.priority
    return kept
