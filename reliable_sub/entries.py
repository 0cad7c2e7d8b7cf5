"""Reading a received batch one entry at a time: an entry that cannot be read never fails the
others.

An adapter's ``receive`` turns each broker entry (a stream entry, a NATS message, a Pub/Sub
received message) into a :class:`~reliable_sub.message.Delivery`. What an entry holds is
written by whoever publishes -- another producer, a hand-made ``XADD``, a peer on another
version -- and its parse can fail in ways nobody foresaw: ``json.loads`` raises RecursionError on
deeply nested input, ``datetime`` refuses a time past the year 9999. Raised out of ``receive``,
such an error fails the whole batch: the broker has handed the entries out, none of them is
delivered, and each comes back together with the same bad neighbour (a Redis group's reclaim
meets the same batch every time, a NATS consumer redelivers it for ever).

:func:`read_each` gives every entry its own guard: whatever an entry's parse raises, that entry
becomes a delivery marked ``malformed`` (the Subscriber dead-letters it, with the error as its
reason), and the rest of the batch is delivered as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

from ._text import describe_error
from .message import Delivery

logger = logging.getLogger(__name__)

Entry = TypeVar("Entry")

# A parse error's text goes into a log line and a dead letter's attributes: keep it short.
MAX_PROBLEM_CHARS = 300


def read_each(
    entries: Iterable[Entry],
    read: Callable[[Entry], Delivery],
    unreadable: Callable[[Entry, str], Delivery],
) -> list[Delivery]:
    """``read(entry)`` for each entry of a received batch, in order, each in its own guard.

    When ``read`` raises anything (an Exception, foreseen or not), ``unreadable(entry,
    problem)`` makes the entry's delivery instead: one the broker can ack, its ``malformed``
    set to ``problem`` (the error's type and text), and whatever of the message could be read
    without the failing part. Should ``unreadable`` raise too, the entry is left out of the
    batch (it stays at the broker and comes back after its ack deadline) and the error is
    logged; the other entries are delivered either way.
    """
    deliveries: list[Delivery] = []
    for entry in entries:
        try:
            deliveries.append(read(entry))
        except Exception as error:
            problem = describe(error)
            logger.debug("an entry of a received batch cannot be read: %s", problem,
                         exc_info=True)
            try:
                deliveries.append(unreadable(entry, problem))
            except Exception:
                logger.exception("an entry of a received batch could neither be read (%s) nor "
                                 "delivered marked malformed; it stays at the broker and comes "
                                 "back after its ack deadline; the rest of the batch is "
                                 "delivered", problem)
    return deliveries


def describe(error: BaseException) -> str:
    """``"Type: text"`` of ``error``, at most MAX_PROBLEM_CHARS long, even when its ``__str__``
    raises."""
    return describe_error(error, MAX_PROBLEM_CHARS - 3)


__all__ = ["MAX_PROBLEM_CHARS", "describe", "read_each"]
