"""Per-message middleware: functions around a handler call that decide what becomes of a message.

A middleware is ``async def middleware(context, call_next) -> Decision``: it may look at the
:class:`Context`, call ``await call_next(context)`` (the rest of the chain, ending with the
handler), and return the :class:`Decision` it got -- or another one, with reasons. The chain of a
route is built once, when the Subscriber starts::

    your middleware (Subscriber-wide, then the handler's own)   e.g. logging, tracing
      -> DeadLetterOrBackoff   a failure becomes "redeliver after a backoff" or "dead-letter"
        -> InProcessRetry      transient errors retried in process (RetryPolicy.retry_on)
          -> the handler       its return value is an ack; anything it raises a failure

A middleware must not turn a failure into an ack it did not earn: outer middleware (tracing,
metrics) would report a dead letter as a success. When a route has no middleware of yours and no
in-process retries, the Subscriber calls the handler directly and builds no per-message objects.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..message import Message
from ..ports import Claimed


class Verdict(str, enum.Enum):
    """What a :class:`Decision` says should become of the message."""

    ACK = "ack"
    """The handler succeeded: record its result and ack."""
    FAILED = "failed"
    """The handler failed; not decided yet what follows (DeadLetterOrBackoff decides)."""
    REDELIVER = "redeliver"
    """Give it back to the broker, to come again after ``delay`` seconds."""
    DEAD_LETTERED = "dead_lettered"
    """A copy went to the dead-letter topic; ack the original."""


# read for every message (3.11 reads a member as a class attribute slowly: see
# reliable_sub/_runtime/members.py)
_ACK = Verdict.ACK


@dataclass(frozen=True, slots=True)
class Decision:
    """The end of one attempt, as the chain returns it to the Subscriber.

    Attributes:
        verdict: what to do with the message.
        result: the handler's return value (ACK).
        error: what the handler raised (FAILED, REDELIVER, DEAD_LETTERED).
        delay: seconds before the redelivery (REDELIVER).
        failures: handler failures of this message, this one included (0 on success).
    """

    verdict: Verdict
    result: Any = None
    error: BaseException | None = None
    delay: float = 0.0
    failures: int = 0

    @classmethod
    def ack(cls, result: Any = None) -> Decision:
        if result is None and cls is Decision:
            return _ACK_NONE  # frozen, so one serves every handler that returned None
        return cls(_ACK, result)

    @classmethod
    def failed(cls, error: BaseException) -> Decision:
        return cls(Verdict.FAILED, error=error)


# A frozen dataclass's __init__ costs about 1 µs on CPython 3.11: built once, not per message.
_ACK_NONE = Decision(_ACK)


@dataclass(slots=True)
class Context:
    """One attempt at one message, passed down the chain.

    Attributes:
        message: the message.
        failures: handler failures of this message before this attempt.
        claim: the dedup claim held for it (key and fencing token), or None.
        handler: the handler's qualified name.
        state: free for middleware to pass values along the chain.
    """

    message: Message
    failures: int = 0
    claim: Claimed | None = None
    handler: str = ""
    state: dict[str, Any] = field(default_factory=dict)


CallNext = Callable[[Context], Awaitable[Decision]]
Middleware = Callable[[Context, CallNext], Awaitable[Decision]]


def chain(middleware: Sequence[Middleware], last: CallNext) -> CallNext:
    """``middleware`` around ``last``, the first one outermost; built once per route."""
    call = last
    for outer in reversed(middleware):
        call = _link(outer, call)
    return call


def _link(middleware: Middleware, call_next: CallNext) -> CallNext:
    async def call(context: Context) -> Decision:
        return await middleware(context, call_next)

    return call


__all__ = ["CallNext", "Context", "Decision", "Middleware", "Verdict", "chain"]
