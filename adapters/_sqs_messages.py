"""How a reliable-sub message is written as an SQS message, and read back.

Body. An SQS body is XML text: only the characters #x9 #xA #xD #x20-#xD7FF #xE000-#xFFFD
#x10000-#x10FFFF, at least one of them. Data that is UTF-8 text of those characters is sent as
that text, as any SQS client would read it; other data (binary, or text with a NUL or another
control character) is sent base64-encoded with the attribute ``reliable-sub-body: base64``, and
empty data as the body ``empty`` with ``reliable-sub-body: empty``. A body without that
attribute (another publisher's) is read as its UTF-8 bytes.

Attributes. SQS carries at most ``MAX_ATTRIBUTES`` message attributes, of names made of
letters, digits, ``-``, ``_`` and ``.``, with non-empty values of XML text. When all of a
message's attributes fit that (counting ours), each is a ``String`` attribute of its own name:
another consumer reads them as SQS attributes. Otherwise all of them travel as one JSON object
in the ``String`` attribute ``reliable-sub-attributes`` (its escapes carry any text). Attributes
of other publishers are read whatever their type: ``String`` and ``Number`` (and their custom
subtypes, ``Number.int``) as their text, ``Binary`` as UTF-8 text, else base64.

Ordering key, FIFO. The ordering key is the ``MessageGroupId`` (1-128 ASCII letters, digits and
punctuation; another key is refused at publish). On a FIFO queue a message without one gets a
group of its own (``UNORDERED_GROUP`` and a fresh id: no order, no blocking), and its
``MessageDeduplicationId`` is the idempotency key (its SHA-256 when SQS's rules do not allow it
as it is; with the dead-letter copy's id on a replay, which must not be dropped as a retry), or
a fresh id without one: SQS drops a copy with the same id sent within five minutes.

Size. SQS counts a message's body and its attributes' names, types and values, in bytes of
UTF-8, against its limit (1 MiB, AWS's default and largest ``MaximumMessageSize`` since August
2025); a larger message is refused before it is sent, naming the sizes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import uuid
from datetime import datetime, timezone
from typing import Any

from reliable_sub.dead_letters import REPLAYED_FROM_ATTRIBUTE
from reliable_sub.errors import InvalidMessageError
from reliable_sub.message import IDEMPOTENCY_KEY_ATTRIBUTE, Message
from reliable_sub.ports import attributes_from_json

BODY_ATTRIBUTE = "reliable-sub-body"
ATTRIBUTES_ATTRIBUTE = "reliable-sub-attributes"
BASE64, EMPTY = "base64", "empty"
# SQS's limits: message attributes per message, one message's size (body and attributes).
MAX_ATTRIBUTES = 10
MAX_MESSAGE_SIZE = 1_048_576
MAX_ATTRIBUTE_NAME = 256
# A group of its own for a FIFO message without an ordering key (read back as no key).
UNORDERED_GROUP = "reliable-sub-unordered-"
# What the receive asks SQS for besides the body and the message attributes.
SYSTEM_ATTRIBUTES: list[Any] = ["ApproximateReceiveCount", "SentTimestamp", "MessageGroupId"]

_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# MessageGroupId and MessageDeduplicationId: 1-128 of ASCII 33-126.
_SQS_ID = re.compile(r"[!-~]{1,128}")
_ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_-](?:[A-Za-z0-9_.-]*[A-Za-z0-9_-])?")
_OURS = frozenset({BODY_ATTRIBUTE, ATTRIBUTES_ATTRIBUTE})


def xml_text(text: str) -> bool:
    """Whether SQS carries ``text`` as it is (a body, a String value)."""
    return _NOT_XML.search(text) is None


def _plain_name(name: str) -> bool:
    lowered = name.lower()
    return (len(name) <= MAX_ATTRIBUTE_NAME and _ATTRIBUTE_NAME.fullmatch(name) is not None
            and ".." not in name and not lowered.startswith(("aws.", "amazon."))
            and name not in _OURS)


def _plain_value(value: str) -> bool:
    return bool(value) and xml_text(value)


def _string(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": value}


def entry(payload: bytes, attributes: dict[str, str], ordering_key: str | None, *,
          fifo: bool, max_size: int, where: str) -> dict[str, Any]:
    """The SendMessage parameters (without the queue) for checked data and attributes."""
    body, encoding = _body(payload)
    ours = 0 if encoding is None else 1
    fields: dict[str, dict[str, str]] = {}
    if encoding is not None:
        fields[BODY_ATTRIBUTE] = _string(encoding)
    if len(attributes) + ours <= MAX_ATTRIBUTES and all(
            _plain_name(k) and _plain_value(v) for k, v in attributes.items()):
        fields.update((name, _string(value)) for name, value in attributes.items())
    elif attributes:
        fields[ATTRIBUTES_ATTRIBUTE] = _string(json.dumps(attributes, separators=(",", ":")))
    size = len(body.encode()) + sum(
        len(name.encode()) + len(field["DataType"]) + len(field["StringValue"].encode())
        for name, field in fields.items())
    if size > max_size:
        raise InvalidMessageError(
            f"{where}: the message is {size:,} bytes as SQS counts it (the body"
            f"{', base64-encoded,' if encoding == BASE64 else ''} and the attributes), over the "
            f"limit of {max_size:,} bytes; put the payload in storage (S3) and publish a "
            "reference to it")
    params: dict[str, Any] = {"MessageBody": body}
    if fields:
        params["MessageAttributes"] = fields
    if ordering_key:
        if _SQS_ID.fullmatch(ordering_key) is None:
            raise InvalidMessageError(
                f"{where}: the ordering key {ordering_key[:140]!r} cannot be an SQS "
                "MessageGroupId (1-128 ASCII letters, digits and punctuation); use such a key")
        params["MessageGroupId"] = ordering_key
    elif fifo:
        params["MessageGroupId"] = UNORDERED_GROUP + uuid.uuid4().hex
    if fifo:
        params["MessageDeduplicationId"] = deduplication_id(attributes)
    return params


def _body(payload: bytes) -> tuple[str, str | None]:
    """The body for ``payload`` and its ``reliable-sub-body`` encoding (None: plain text)."""
    if not payload:
        return EMPTY, EMPTY
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and xml_text(text):
        return text, None
    return base64.b64encode(payload).decode("ascii"), BASE64


def deduplication_id(attributes: dict[str, str]) -> str:
    """A FIFO message's ``MessageDeduplicationId``: its idempotency key (and, on a replayed
    dead letter, the copy it replays), as it is when SQS allows it, else its SHA-256; a fresh
    id without a key."""
    key = attributes.get(IDEMPOTENCY_KEY_ATTRIBUTE)
    if not key:
        return uuid.uuid4().hex
    replayed_from = attributes.get(REPLAYED_FROM_ATTRIBUTE)
    wanted = key if not replayed_from else f"{key} replayed-from {replayed_from}"
    if _SQS_ID.fullmatch(wanted):
        return wanted
    return "sha256:" + hashlib.sha256(wanted.encode("utf-8", "surrogatepass")).hexdigest()


def incoming(raw: dict[str, Any], subscription: str) -> tuple[Message, str | None]:
    """The message an SQS ``Messages`` entry carries, and what is wrong with it (None:
    nothing): a delivery marked malformed is dead-lettered by the Subscriber."""
    problem = None
    fields = raw.get("MessageAttributes") or {}
    attributes = {name: _text_of(field) for name, field in fields.items() if name not in _OURS}
    packed = fields.get(ATTRIBUTES_ATTRIBUTE)
    if packed is not None:
        try:
            attributes.update(attributes_from_json(_text_of(packed)))
        except ValueError as error:
            problem = f"{ATTRIBUTES_ATTRIBUTE} attribute: {error}"
    body = raw.get("Body", "")
    encoding = fields.get(BODY_ATTRIBUTE)
    data, body_problem = _data(body, None if encoding is None else _text_of(encoding))
    system = raw.get("Attributes") or {}
    group = system.get("MessageGroupId")
    ordering_key = None if not group or group.startswith(UNORDERED_GROUP) else group
    message = Message.received(
        raw["MessageId"], data, attributes, max(1, int(system.get("ApproximateReceiveCount", 1))),
        _sent_at(system.get("SentTimestamp")), ordering_key, subscription)
    return message, problem or body_problem


def _data(body: str, encoding: str | None) -> tuple[bytes, str | None]:
    if encoding is None:
        return body.encode("utf-8", "surrogatepass"), None
    if encoding == BASE64:
        try:
            return base64.b64decode(body, validate=True), None
        except (binascii.Error, ValueError):
            return body.encode("utf-8", "surrogatepass"), (
                f"{BODY_ATTRIBUTE} attribute says base64, but the body is not base64")
    if encoding == EMPTY:
        return b"", None
    return body.encode("utf-8", "surrogatepass"), (
        f"{BODY_ATTRIBUTE} attribute {encoding[:40]!r} is no encoding this adapter writes "
        f"({BASE64!r} or {EMPTY!r})")


def _text_of(field: dict[str, Any]) -> str:
    """An SQS attribute of any type as an attribute's text."""
    if "StringValue" in field:
        return str(field["StringValue"])
    raw = field.get("BinaryValue")
    if isinstance(raw, bytes | bytearray | memoryview):
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(bytes(raw)).decode("ascii")
    return "" if raw is None else str(raw)


def _sent_at(millis: str | None) -> datetime | None:
    if not millis:
        return None
    try:
        return datetime.fromtimestamp(int(millis) / 1000, tz=timezone.utc)
    except (ValueError, OverflowError, OSError):
        return None


def largest_binary_payload(max_size: int = MAX_MESSAGE_SIZE) -> int:
    """The most bytes of binary data one message carries (base64 with its attribute)."""
    room = max_size - len(BODY_ATTRIBUTE) - len("String") - len(BASE64)
    return room // 4 * 3
