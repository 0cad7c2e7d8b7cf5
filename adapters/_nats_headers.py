"""How a JetStream message's headers are read as its attributes and ordering key.

Our publish writes the attributes as one JSON header (``Reliable-Sub-Attributes``) and the
ordering key as a JSON string (``Reliable-Sub-Ordering-Key``). Plain headers of other publishers
(a Go service's ``traceparent``, FastStream's ``correlation_id`` and ``reply_to``) are attributes
of their own names. ``Nats-*`` headers are the server's and are left out, but for the
``Nats-Msg-Id`` another publisher set, the attribute ``nats-msg-id``: its dedup id, kept through
dead letters and replays. (Ours is the ``idempotency-key`` attribute's, which a message of ours
has already.) It is not sent as ``Nats-Msg-Id`` again: within the stream's duplicate window a
replay would be dropped as a retry; an ``idempotency-key`` attribute sets that header.

The reply subject a publisher gave is not kept: JetStream sends its acknowledgement there and
stores no reply subject with the message.
"""

from __future__ import annotations

import contextlib
import json

from reliable_sub.ports import attributes_from_json

ATTRIBUTES_HEADER = "Reliable-Sub-Attributes"
ORDERING_KEY_HEADER = "Reliable-Sub-Ordering-Key"
MSG_ID_HEADER = "Nats-Msg-Id"
# Another publisher's Nats-Msg-Id, as an attribute.
NATS_MSG_ID_ATTRIBUTE = "nats-msg-id"
_OUR_HEADERS = frozenset({ATTRIBUTES_HEADER, ORDERING_KEY_HEADER})


def read_headers(headers: dict[str, str]) -> tuple[dict[str, str], str | None, str | None]:
    """A message's attributes and ordering key from its headers, and what was wrong with them
    (None: nothing)."""
    problem = None
    attributes = {name: value for name, value in headers.items()
                  if not name.startswith("Nats-") and name not in _OUR_HEADERS}
    raw = headers.get(ATTRIBUTES_HEADER)
    if raw is not None:
        try:
            attributes.update(attributes_from_json(raw))
        except ValueError as error:
            problem = f"{ATTRIBUTES_HEADER} header: {error}"
    else:  # another publisher's message
        msg_id = headers.get(MSG_ID_HEADER)
        if msg_id is not None:
            attributes[NATS_MSG_ID_ATTRIBUTE] = msg_id
    ordering_key = None
    raw_key = headers.get(ORDERING_KEY_HEADER)
    if raw_key:
        # only a JSON string is parsed: a hostile header nested deep would make json.loads
        # recurse to the interpreter's limit
        if raw_key.startswith('"'):
            with contextlib.suppress(ValueError):
                ordering_key = json.loads(raw_key)
        if not isinstance(ordering_key, str):
            ordering_key = None
            problem = f"{ORDERING_KEY_HEADER} header is not a JSON string: {raw_key[:100]!r}"
    return attributes, ordering_key, problem
