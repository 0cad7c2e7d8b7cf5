"""User values as text, safely: an exception or result whose ``__str__`` or ``__repr__`` raises
must never turn a log line, a span attribute or a dead-letter copy into a second failure.

Every place that formats a user's exception or value goes through these functions (or passes
the value to ``logging`` as an argument only through them: logging formats lazily, and a raising
``__str__`` there loses the record).
"""

from __future__ import annotations

import reprlib

# Text in place of what could not be formatted.
_UNPRINTABLE = "<unprintable {kind}: {how} raised {error}>"


def _failed(value: object, how: str, error: BaseException) -> str:
    return _UNPRINTABLE.format(kind=_type_name(value), how=how,
                               error=type(error).__name__)


def _type_name(value: object) -> str:
    try:
        return type(value).__qualname__
    except Exception:  # a metaclass can make even this raise
        return "object"


def safe_str(value: object, limit: int | None = None) -> str:
    """``str(value)``, or a placeholder naming its type if that raises; cut to ``limit``."""
    try:
        text = value if isinstance(value, str) else str(value)
        if not isinstance(text, str):
            raise TypeError("__str__ returned a non-string")
    except Exception as error:
        text = _failed(value, "str()", error)
    return text if limit is None or len(text) <= limit else text[:limit] + "..."


def safe_repr(value: object, limit: int | None = None) -> str:
    """``repr(value)``, or a placeholder naming its type if that raises; cut to ``limit``."""
    try:
        bounded = limit is not None and isinstance(value, list | tuple | dict | set | frozenset)
        text = reprlib.repr(value) if bounded else repr(value)
        if not isinstance(text, str):
            raise TypeError("__repr__ returned a non-string")
    except Exception as error:
        text = _failed(value, "repr()", error)
    return text if limit is None or len(text) <= limit else text[:limit] + "..."


def error_type(error: BaseException) -> str:
    """The qualified name of ``error``'s type (``module.Qualname``)."""
    kind = type(error)
    module = getattr(kind, "__module__", None)
    name = getattr(kind, "__qualname__", None) or _type_name(error)
    return f"{module}.{name}" if isinstance(module, str) and module else str(name)


def describe_error(error: BaseException, limit: int | None = None) -> str:
    """``"TypeName: message"`` of ``error`` (its message safely), cut to ``limit``."""
    message = safe_str(error)
    name = _type_name(error)
    text = f"{name}: {message}" if message else name
    return text if limit is None or len(text) <= limit else text[:limit] + "..."


__all__ = ["describe_error", "error_type", "safe_repr", "safe_str"]
