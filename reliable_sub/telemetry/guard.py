"""Telemetry never fails a delivery or a publish.

A tracer or meter is user-supplied code (span processors, views, exporters): if one raises, the
step it was called from carries on without its telemetry. The first failure of each step is
logged at WARNING with its traceback, later ones at DEBUG, so a broken processor does not flood
the log.
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from .._text import safe_str

logger = logging.getLogger("reliable_sub.telemetry")

_warned: set[str] = set()

F = TypeVar("F", bound=Callable[..., Any])


def report(step: str) -> None:
    """Log the exception being handled, raised by telemetry in ``step``."""
    if step in _warned:
        logger.debug("telemetry failed in %s", step, exc_info=True)
        return
    _warned.add(step)
    logger.warning("telemetry failed in %s; carrying on without it (later failures of this "
                   "step are logged at DEBUG)", step, exc_info=True)


def record_error(span: Any, error: BaseException, error_type: str) -> None:
    """``span.record_exception(error)``, or the same event built from safe text when the SDK
    cannot format ``error`` (its ``__str__`` raises): the span still ends, with its event."""
    try:
        span.record_exception(error)
    except Exception:
        span.add_event("exception", {
            "exception.type": error_type,
            "exception.message": safe_str(error, 1000),
            "exception.stacktrace": "".join(traceback.format_exception(
                type(error), error, error.__traceback__)),
        })


def never_raises(method: F) -> F:
    """``method`` (returning None), with any exception it raises logged instead of raised."""
    step = method.__qualname__

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            report(step)

    return guarded  # type: ignore[return-value]


__all__ = ["never_raises", "record_error", "report"]
