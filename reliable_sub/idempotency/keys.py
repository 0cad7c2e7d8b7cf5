"""Idempotency keys: derived from the parts that identify a request, or fresh for a client.

* :func:`idempotency_key` -- the same parts in the same namespace always give the same key, and
  different parts or namespaces never do (short of a SHA-256 collision)::

      idempotency_key("order-17", 3, namespace="charge")
      # 'charge:3f0c...'  -- the namespace, a colon and 64 hex digits

* :func:`new_idempotency_key` -- a fresh random key for a client to send with a request and
  resend with its retries: a UUIDv7 (RFC 9562), so keys sort by creation time.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid

from ..errors import ConfigurationError

# The first element of every hashed document: a change of the encoding below must change it,
# so keys made by two encodings can never be taken for one another.
_ENCODING = "reliable-sub/idempotency-key/v1"


def idempotency_key(*parts: str | int | bytes | uuid.UUID, namespace: str) -> str:
    """A deterministic key for ``parts`` within ``namespace``: ``f"{namespace}:{sha256 hex}"``.

    Each part is encoded with its type and its full value before hashing, so the split between
    parts matters (``("a", "bc")`` and ``("ab", "c")`` differ) and so does the type (``"1"``,
    ``1``, ``b"1"``; a UUID and its text). The namespace is hashed too and prefixes the result,
    so two namespaces never give the same key for the same parts.

    Args:
        parts: at least one ``str``, ``int`` (not bool), ``bytes`` or ``uuid.UUID``.
        namespace: a non-empty str naming what the key is for (``"charge"``, ``"refund"``).

    Raises:
        ConfigurationError: no parts, an empty or non-str namespace, or a part of another type
            (the message names it).
    """
    if not isinstance(namespace, str) or not namespace:
        raise ConfigurationError(
            f"idempotency_key: namespace must be a non-empty str, got {namespace!r}"
        )
    if not parts:
        raise ConfigurationError(
            "idempotency_key: give at least one part (the values that identify the request)"
        )
    document: list[object] = [_ENCODING, namespace]
    for index, part in enumerate(parts):
        document.append(_encoded_part(index, part))
    # ensure_ascii: any str, lone surrogates included, becomes plain ASCII JSON.
    text = json.dumps(document, ensure_ascii=True, separators=(",", ":"))
    return f"{namespace}:{hashlib.sha256(text.encode('ascii')).hexdigest()}"


def _encoded_part(index: int, part: object) -> list[object]:
    """``part`` as a [type tag, value] pair of JSON values."""
    if isinstance(part, bool):  # an int subclass, but a flag is rarely what identifies a request
        raise ConfigurationError(
            f"idempotency_key: part {index} is a bool ({part!r}); pass a str, int, bytes or "
            "uuid.UUID"
        )
    if isinstance(part, str):
        return ["s", part]
    if isinstance(part, int):
        return ["i", str(int(part))]  # as text: JSON numbers lose precision in some decoders
    if isinstance(part, bytes):
        return ["b", part.hex()]
    if isinstance(part, uuid.UUID):
        return ["u", part.hex]
    raise ConfigurationError(
        f"idempotency_key: part {index} ({part!r}) is a {type(part).__name__}; pass a str, "
        "int, bytes or uuid.UUID"
    )


# -- UUIDv7 ----------------------------------------------------------------------------------------

_MS_BITS = 48
_COUNTER_MAX = 0xFFF  # rand_a: 12 bits, used as a counter within one millisecond
_RAND_B_MASK = (1 << 62) - 1
_lock = threading.Lock()
_last_ms = 0
_counter = 0


def new_idempotency_key() -> str:
    """A fresh random idempotency key: a UUIDv7 in its canonical text form.

    The first 48 bits are the Unix time in milliseconds, so keys sort by creation time (across
    processes to within clock skew). ``uuid.uuid7`` is used where Python has it (3.14+);
    otherwise the key is built here per RFC 9562: version 7, variant ``10``, a 12-bit counter
    that keeps the keys of one process strictly increasing within a millisecond (method 1 of
    section 6.2, its start randomised), and 62 random bits from ``os.urandom``.
    """
    make = getattr(uuid, "uuid7", None)
    if make is not None:
        return str(make())
    return str(_uuid7())


def _uuid7() -> uuid.UUID:
    global _last_ms, _counter
    now_ms = time.time_ns() // 1_000_000
    with _lock:
        if now_ms > _last_ms:
            _last_ms = now_ms
            # A random start in the lower half leaves room to count up within this millisecond.
            _counter = int.from_bytes(os.urandom(2), "big") & 0x7FF
        else:  # the same millisecond, or the wall clock stepped back: keep counting
            _counter += 1
            if _counter > _COUNTER_MAX:  # 2048+ keys in one millisecond: borrow the next one
                _last_ms += 1
                _counter = 0
        unix_ms, counter = _last_ms, _counter
    rand_b = int.from_bytes(os.urandom(8), "big") & _RAND_B_MASK
    value = (
        (unix_ms & ((1 << _MS_BITS) - 1)) << 80
        | 0x7 << 76  # version
        | counter << 64
        | 0b10 << 62  # variant (RFC 9562)
        | rand_b
    )
    return uuid.UUID(int=value)


__all__ = ["idempotency_key", "new_idempotency_key"]
