"""Redis stream entries as the adapter reads them: from a reply, and in another producer's
layout (how such an entry is read, and written again).

Our layout is the fields ``data``, ``attributes`` (a JSON object of strings) and
``ordering-key`` (see adapters/redis_streams.py). Other producers write other fields: FastStream
one ``__data__`` field holding its own envelope (body, correlation id, headers), redis-cli what
it is given (``payload``, ``correlation_id``, ``content-type``). Nothing of an entry is dropped:

* fields beside ``data`` are attributes of their own names, their values as text (bytes that
  are not UTF-8 as Python's surrogate escapes, which give the bytes back), and the attribute
  ``redis-fields`` lists them, in the entry's order, as a JSON array;
* an entry that is no message of ours -- no ``data`` field; attributes or an ordering key that
  cannot be read; a field named like one of its attributes, or like a layout attribute -- is
  delivered malformed (the Subscriber dead-letters it) with all of it: when it has one field
  besides ``attributes`` and ``ordering-key`` (and those can be read), the data is that field's
  value and ``redis-data-field`` names it (FastStream's ``__data__``); otherwise the data is a
  JSON object of all its fields and ``redis-entry`` is ``json``.

Publishing a message with these attributes writes that layout again (a dead letter's replay, a
handler forwarding what it got): the attributes ``redis-fields`` lists become fields, the data
goes under ``redis-data-field``, or the JSON object's members are the entry's fields. The
entry's own fields win: the other attributes go into an ``attributes`` field, and the ordering
key into ``ordering-key``, only when the entry has no such field. A layout attribute that cannot
be followed (not a JSON array of names; data that is not a JSON object of strings) leaves the
message in our layout, the attribute kept as an ordinary one.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime, timezone
from typing import Any

from reliable_sub.ports import (
    LAYOUT_ATTRIBUTES,
    REDIS_DATA_FIELD_ATTRIBUTE,
    REDIS_ENTRY_ATTRIBUTE,
    REDIS_FIELDS_ATTRIBUTE,
    attributes_from_json,
    names_from_json,
)

DATA, ATTRIBUTES, ORDERING_KEY = b"data", b"attributes", b"ordering-key"
OUR_FIELDS = frozenset({DATA, ATTRIBUTES, ORDERING_KEY})
LAYOUTS = frozenset(LAYOUT_ATTRIBUTES)
JSON_ENTRY = "json"  # the value of redis-entry
_COMPACT = (",", ":")

# An entry as the adapter reads it: its id, its fields, and its delivery attempt.
Entry = tuple[str, dict[bytes, bytes], int]


def entries_of(reply: Any) -> list[Entry]:
    """Entries of an XREADGROUP reply (first deliveries), in RESP2 (list) or RESP3 (dict)
    shape."""
    streams = reply.items() if isinstance(reply, dict) else reply
    entries: list[Entry] = []
    for stream in streams:
        records = stream[1]
        if records and isinstance(records[0], list | tuple) and len(records[0]) == 1:
            records = records[0]  # RESP3 nests one level deeper
        for entry_id, fields in records:
            if fields is None:
                continue  # deleted while pending: only XREADGROUP of history shows these
            name = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            entries.append((name, field_map(fields), 1))
    return entries


def field_map(flat: Any) -> dict[bytes, bytes]:
    """Stream fields from a raw script reply (a flat list) or a redis-py reply (a dict)."""
    if isinstance(flat, dict):
        return flat
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def publish_time(entry_id: str) -> datetime | None:
    """The time an entry id carries (its milliseconds part), or None when it is past what a
    datetime holds (the year 9999): an id given by hand to XADD, and every later entry of its
    stream, since Redis numbers those after it."""
    return _time_of(entry_id.partition("-")[0])


@functools.lru_cache(maxsize=64)  # entries added together share their millisecond
def _time_of(milliseconds: str) -> datetime | None:
    try:
        return datetime.fromtimestamp(int(milliseconds) / 1000, tz=timezone.utc)
    except (OverflowError, ValueError, OSError):
        return None


def text(raw: bytes) -> str:
    """A field name or value as text: UTF-8, and any other byte as a surrogate escape."""
    return raw.decode("utf-8", "surrogateescape")


def raw(value: str) -> bytes | None:
    """The bytes :func:`text` read ``value`` from, or None for text no entry held (a lone
    surrogate that is no escape of a byte)."""
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None


def read_foreign(
    fields: dict[bytes, bytes], attributes: dict[str, str], problem: str | None
) -> tuple[bytes, dict[str, str], str | None]:
    """The data, attributes and problem of an entry that is not just our three fields, or whose
    ``attributes`` or ``ordering-key`` field could not be read (``problem``), given what its
    ``attributes`` field held."""
    data = fields.get(DATA)
    extra = {text(name): value for name, value in fields.items() if name not in OUR_FIELDS}
    if problem is None:
        problem = _clash(extra, attributes)
    if problem is None and data is not None:
        found = dict(attributes)
        found.update((name, text(value)) for name, value in extra.items())
        found[REDIS_FIELDS_ATTRIBUTE] = json.dumps(list(extra), separators=_COMPACT)
        return data, found, None
    if problem is None:
        problem = f"no data field (fields: {sorted(text(name) for name in fields)})"
        if len(extra) == 1:
            [(name, value)] = extra.items()
            return value, {**attributes, REDIS_DATA_FIELD_ATTRIBUTE: name}, problem
    return whole_entry(fields), {REDIS_ENTRY_ATTRIBUTE: JSON_ENTRY}, problem


def _clash(extra: dict[str, bytes], attributes: dict[str, str]) -> str | None:
    """Why the fields beside ours cannot be attributes beside those of the ``attributes``
    field (one would hide the other), or None."""
    for name in extra:
        if name in attributes:
            return f"the field {name!r} is also an attribute in the attributes field"
    for name in (*extra, *attributes):
        if name in LAYOUTS:
            return f"a field or attribute is named {name!r}, as a layout attribute of the adapter"
    return None


def unreadable(fields: dict[bytes, bytes]) -> tuple[bytes, dict[str, str]]:
    """The data and attributes of an entry whose parse raised: all of it, read no further."""
    if len(fields) == 1:
        [(name, value)] = fields.items()
        return value, {REDIS_DATA_FIELD_ATTRIBUTE: text(name)}
    return whole_entry(fields), {REDIS_ENTRY_ATTRIBUTE: JSON_ENTRY}


def whole_entry(fields: dict[bytes, bytes]) -> bytes:
    """All of an entry's fields as one JSON object of strings, in the entry's order (ASCII:
    the surrogate escapes of bytes that are not UTF-8 as ``\\udcXX``)."""
    return json.dumps({text(name): text(value) for name, value in fields.items()},
                      separators=_COMPACT).encode()


def written_fields(
    payload: bytes, attributes: dict[str, str], ordering_key: str | None
) -> dict[bytes, bytes] | None:
    """The fields of the entry that the layout attributes among ``attributes`` describe, or
    None when they describe none that can be followed (the message goes in our layout)."""
    rest = dict(attributes)
    fields: dict[bytes, bytes] = {}
    if REDIS_ENTRY_ATTRIBUTE in rest:
        whole = _fields_of(payload) if rest.pop(REDIS_ENTRY_ATTRIBUTE) == JSON_ENTRY else None
        if whole is None:
            return None
        fields.update(whole)
    elif REDIS_DATA_FIELD_ATTRIBUTE in rest:
        data_field = raw(rest.pop(REDIS_DATA_FIELD_ATTRIBUTE))
        if data_field is None:
            return None
        fields[data_field] = payload
    else:
        fields[DATA] = payload
    if REDIS_FIELDS_ATTRIBUTE in rest:
        names = _names(rest.pop(REDIS_FIELDS_ATTRIBUTE))
        if names is None:
            return None
        for name in names:
            field, value = raw(name), rest.get(name)
            encoded = None if value is None else raw(value)
            if field is None or encoded is None or field in fields or field in OUR_FIELDS:
                continue  # stays an attribute
            fields[field] = encoded
            del rest[name]
    if rest and ATTRIBUTES not in fields:
        fields[ATTRIBUTES] = json.dumps(rest, separators=_COMPACT).encode()
    if ordering_key and ORDERING_KEY not in fields:
        fields[ORDERING_KEY] = ordering_key.encode()
    return fields


def _fields_of(payload: bytes) -> dict[bytes, bytes] | None:
    """The fields a JSON object of strings names (what :func:`whole_entry` wrote), or None."""
    try:
        whole = attributes_from_json(payload)
    except ValueError:
        return None
    fields: dict[bytes, bytes] = {}
    for name, value in whole.items():
        field, encoded = raw(name), raw(value)
        if field is None or encoded is None:
            return None
        fields[field] = encoded
    return fields or None


def _names(listed: str) -> list[str] | None:
    try:
        return names_from_json(listed)
    except ValueError:
        return None
