"""Fingerprints of a call's arguments: equal for the same request in any process.

``@idempotent(validate_payload=True)`` stores one with each result, so the same key with other
arguments is refused rather than replayed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

# " at 0x...": an object's identity in its repr, which differs between processes.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def fingerprint(arguments: Mapping[str, Any]) -> str:
    """SHA-256 hex of the arguments' canonical JSON (``repr`` where JSON cannot hold them)."""
    try:
        text = _canonical(arguments)
    except (TypeError, ValueError, RecursionError):  # mixed-type dict keys, cycles
        text = _ADDRESS.sub("", repr(arguments))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      default=_tagged)


def _tagged(value: Any) -> Any:
    """A JSON stand-in for ``value``: its type, and what identifies it across processes."""
    kind = type(value)
    tag = f"<{kind.__module__}.{kind.__qualname__}>"
    if isinstance(value, set | frozenset):  # repr order varies with the hash seed
        return {tag: sorted(_canonical(item) for item in value)}
    return {tag: _ADDRESS.sub("", repr(value))}  # " at 0x...": identity, not payload


__all__ = ["fingerprint"]
