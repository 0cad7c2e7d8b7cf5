"""Failure streaks of the calls a Subscriber depends on: what ``healthy()`` reads, and the log
of each outage.

A call (receiving from a subscription, claiming or completing in the dedup store, acking at the
broker, extending leases) that fails starts a *streak*, which its next success ends. A streak
is logged once when it starts (WARNING, with the traceback), then only at DEBUG, and summed up
when it ends (INFO: how many failures over how long) -- a broker down for a minute is two lines,
not one per retry. A streak that has lasted ``unhealthy_after`` seconds (from its first failure
to its latest), while its latest failure is recent (within ``unhealthy_after``), makes the
Subscriber unhealthy, with the call and its last error named: a consumer whose every receive,
claim or ack fails is not handling anything, whatever its loops are doing. One failed call, or
failures with successes between them, do not; nor does an old streak of a call that was not
made since (a claim that failed during an outage, then no message to claim).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .._text import describe_error

logger = logging.getLogger("reliable_sub.subscriber")


class _Streak:
    __slots__ = ("count", "first", "last", "last_error")

    def __init__(self, now: float) -> None:
        self.count = 0
        self.first = now
        self.last = now
        self.last_error = ""


class Health:
    """Failure streaks per kind of call.

    Args:
        now: the Subscriber's clock.
        unhealthy_after: seconds a streak lasts before it makes the Subscriber unhealthy.
    """

    def __init__(self, now: Callable[[], float], unhealthy_after: float) -> None:
        self._now = now
        self._unhealthy_after = unhealthy_after
        self._streaks: dict[str, _Streak] = {}

    def ok(self, call: str) -> None:
        """``call`` succeeded: its streak, if any, ends (and is summed up in the log)."""
        if not self._streaks:  # the common case: nothing failing
            return
        streak = self._streaks.pop(call, None)
        if streak is not None:
            logger.info("%s works again after %d failed tries over %.1fs (last error: %s)",
                        call, streak.count, self._now() - streak.first, streak.last_error,
                        extra={"call": call, "failures": streak.count})

    def failed(self, call: str, error: BaseException | None, exc_info: bool = True) -> None:
        """``call`` failed with ``error``: logged at WARNING if it starts a streak."""
        now = self._now()
        streak = self._streaks.get(call)
        text = describe_error(error, 500) if error is not None else "unknown error"
        if streak is None:
            streak = self._streaks[call] = _Streak(now)
            logger.warning("%s failed (%s); retrying, and logging further failures of it at "
                           "DEBUG until it works again", call, text,
                           exc_info=error if exc_info else None, extra={"call": call})
        else:
            logger.debug("%s failed again (%s)", call, text, extra={"call": call})
        streak.count += 1
        streak.last = now
        streak.last_error = text

    def problems(self) -> list[str]:
        """The calls failing for ``unhealthy_after`` seconds or more and still failing, with
        their last error."""
        if not self._streaks:
            return []
        now, bound = self._now(), self._unhealthy_after
        return [
            f"{call} has failed {streak.count} times over {streak.last - streak.first:.0f}s "
            f"(last error: {streak.last_error})"
            # a copy: healthy() is read from other threads too (probes, the metric reader)
            for call, streak in list(self._streaks.items())
            if streak.last - streak.first >= bound and now - streak.last <= bound
        ]

    def failing(self, call: str) -> bool:
        """Whether ``call`` is in a streak now."""
        return call in self._streaks


__all__ = ["Health"]
