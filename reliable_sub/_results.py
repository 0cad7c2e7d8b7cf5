"""Handler results as JSON text: what a dedup store keeps, never pickle."""

from __future__ import annotations

import json
from typing import Any

from ._bodies import jsonable
from ._text import describe_error
from .errors import ResultNotSerializableError, StoredResultError

# pydantic models and dataclasses are stored as their JSON form (``default`` is called only for
# values json cannot encode itself, so plain results pay nothing for it)
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=jsonable)


def encode_result(result: Any) -> str:
    """``result`` as JSON text, or :class:`ResultNotSerializableError` naming its type."""
    if result is None:
        return "null"
    try:
        return _ENCODER.encode(result)
    except Exception as error:  # any: a lazy row whose items() raises is as unstorable
        reason = ("nested too deeply" if isinstance(error, RecursionError)
                  else describe_error(error, 300))
        raise ResultNotSerializableError(
            f"handler result of type {type(result).__name__} cannot be stored as JSON "
            f"({reason}); return None, a str, number, bool, list or dict, a pydantic model "
            "or a dataclass"
        ) from error


def decode_result(result_json: str | None, key: object = None) -> Any:
    """The value of a stored result; :class:`StoredResultError` naming the key if unreadable."""
    if not result_json:
        return None
    try:
        return json.loads(result_json)
    except (ValueError, RecursionError) as error:
        raise StoredResultError(
            f"the stored result of {key!r} is not valid JSON ({error}): {result_json[:80]!r}"
        ) from error


def checked_result_json(result_json: object) -> str:
    """``result_json`` if it is JSON text; a :class:`ResultNotSerializableError` otherwise."""
    if result_json == "null":
        return "null"
    if not isinstance(result_json, str):
        raise ResultNotSerializableError(
            f"a completion's result_json must be JSON text (see encode_result), "
            f"got {type(result_json).__name__}"
        )
    try:
        json.loads(result_json)
    except (ValueError, RecursionError) as error:
        raise ResultNotSerializableError(
            f"a completion's result_json is not valid JSON ({error}): {result_json[:80]!r}"
        ) from error
    return result_json
