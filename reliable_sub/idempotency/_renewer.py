"""The renewer: one daemon thread that renews the claims of running sync ``@idempotent`` calls.

A sync call on a store with blocking twins (:class:`~reliable_sub.ports.SyncDedupStore`)
registers its claim when its function starts and unregisters it when the function returns or
raises. Most calls are over long before their first renewal is due, so both are a dict operation
under a lock and nothing else: the thread is not woken (while idle it looks again every renewal
period, and a claim registered meanwhile is due no sooner). The thread sleeps until the earliest
renewal is due (``lease_ttl / 3`` after the claim's last renewal), then renews every due claim
(and those due within a tenth of their period) -- one ``renew_sync`` call per store and lease --
and sleeps again. A claim found lost is dropped and reported to its ``on_lost``; a store that
fails is logged and tried again a period later. Real time (``time.monotonic``) paces it. The
thread starts on the first registration and ends after ``IDLE_EXIT`` seconds with nothing to
renew; after a fork the child starts with no claims and a thread of its own on first use.

Renewals of every store share the thread, so a store call that hangs (a Redis that stopped
answering: up to its socket timeout) delays the others' renewals by as long; a claim's lease is
three renewal periods, so one slow call is absorbed.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ..ports import Claimed, SyncDedupStore

# The name this module's records always had (it was public): logging set-ups name it.
logger = logging.getLogger("reliable_sub.idempotency.renewer")

# A claim is renewed this many times per lease (every lease_ttl / RENEWALS_PER_LEASE) ...
RENEWALS_PER_LEASE = 3
# ... or up to this fraction of a period early, to share the store call of a claim due now: so
# the claims of calls that started close together are renewed together from then on.
EARLY = 0.1
# The thread ends after this many seconds with no claim to renew (the next registration starts
# another), so a process that stopped making sync calls keeps no idle thread.
IDLE_EXIT = 60.0


@dataclass(eq=False, slots=True)
class _Entry:
    store: SyncDedupStore
    claim: Claimed
    lease_ttl: float
    interval: float
    due: float  # time.monotonic() of the next renewal
    key: str
    on_lost: Callable[[str], None]


class Renewer:
    """Renews registered claims from one daemon thread (started on first registration)."""

    def __init__(self) -> None:
        self._tickets = itertools.count(1)
        self._reset()
        if hasattr(os, "register_at_fork"):  # a lock held by another thread at fork stays held
            renewer = weakref.ref(self)

            def after_fork() -> None:
                alive = renewer()
                if alive is not None:
                    alive._reset()

            os.register_at_fork(after_in_child=after_fork)

    def _reset(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._entries: dict[int, _Entry] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._wake_at = math.inf  # when the thread looks next; inf: when told to
        self._period = math.inf  # the renewal period of the latest registration

    def register(
        self,
        store: SyncDedupStore,
        claim: Claimed,
        lease_ttl: float,
        key: str,
        on_lost: Callable[[str], None],
    ) -> int:
        """Renew ``claim`` on ``store`` every ``lease_ttl / 3`` until :meth:`unregister` is
        given the ticket returned; ``on_lost(key)`` (on the renewer's thread) if the claim is
        found no longer held, after which it is not renewed again."""
        interval = lease_ttl / RENEWALS_PER_LEASE
        entry = _Entry(store, claim, lease_ttl, interval, time.monotonic() + interval, key,
                       on_lost)
        ticket = next(self._tickets)
        with self._condition:
            if self._pid != os.getpid():  # not started, ended when idle, or a forked child
                self._start()
            self._entries[ticket] = entry
            self._period = interval
            if entry.due < self._wake_at:  # sooner than the thread means to look
                self._wake_at = entry.due
                self._condition.notify()
        return ticket

    def unregister(self, ticket: int) -> None:
        """Stop renewing the claim of ``ticket`` (a renewal in flight may still land: it is
        fenced by the claim's token, so it never touches a record completed or released
        since)."""
        with self._condition:
            self._entries.pop(ticket, None)

    def __len__(self) -> int:
        """How many claims are registered."""
        with self._condition:
            return len(self._entries)

    def _start(self) -> None:
        self._entries.clear()
        self._wake_at = math.inf
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=self._serve, args=(self._condition,), name="reliable-sub-renewer",
            daemon=True,
        )
        self._thread.start()

    def _serve(self, condition: threading.Condition) -> None:
        idle_since: float | None = None
        while True:
            with condition:
                if condition is not self._condition:  # reset: another thread serves now
                    return
                now = time.monotonic()
                due = self._take_due(now)
                if not due:
                    if self._entries:
                        idle_since = None
                    else:
                        idle_since = now if idle_since is None else idle_since
                        if now - idle_since >= IDLE_EXIT:
                            self._thread, self._pid = None, 0  # the next register starts one
                            return
                        # Look again a renewal period on: a claim registered meanwhile is due
                        # no sooner (its period after it registers), so registering need not
                        # wake this thread -- short calls come and go without a thread switch.
                        self._wake_at = now + min(self._period, IDLE_EXIT)
                    condition.wait(max(0.0, self._wake_at - now))
                    continue
            self._renew(due)

    def _take_due(self, now: float) -> list[tuple[int, _Entry]]:
        """The entries due for renewal, each rescheduled a period on (a failed renewal is
        tried again then); sets when to wake next. Under the lock."""
        due: list[tuple[int, _Entry]] = []
        wake_at = math.inf
        for ticket, entry in self._entries.items():
            if entry.due <= now + EARLY * entry.interval:
                due.append((ticket, entry))
                entry.due = now + entry.interval
            wake_at = min(wake_at, entry.due)
        self._wake_at = wake_at
        return due

    def _renew(self, due: list[tuple[int, _Entry]]) -> None:
        groups: dict[tuple[int, float], list[tuple[int, _Entry]]] = {}
        for ticket, entry in due:
            groups.setdefault((id(entry.store), entry.lease_ttl), []).append((ticket, entry))
        for group in groups.values():
            store, lease_ttl = group[0][1].store, group[0][1].lease_ttl
            try:
                lost = store.renew_sync([entry.claim for _, entry in group], lease_ttl)
            except Exception:
                logger.warning(
                    "renewing the claims of %d sync @idempotent call(s) on %r failed "
                    "(idempotency keys %s); retrying in %.3gs", len(group), store,
                    ", ".join(repr(entry.key) for _, entry in group[:5])
                    + (", ..." if len(group) > 5 else ""),
                    group[0][1].interval, exc_info=True,
                )
                continue
            if lost:
                self._report_lost(group, lost)

    def _report_lost(self, group: list[tuple[int, _Entry]], lost: list[Claimed]) -> None:
        gone = set(lost)
        reported: list[_Entry] = []
        with self._condition:
            for ticket, entry in group:
                # A call that ended meanwhile completed or released its claim: nothing lost.
                if entry.claim in gone and self._entries.get(ticket) is entry:
                    del self._entries[ticket]
                    reported.append(entry)
        for entry in reported:
            try:
                entry.on_lost(entry.key)
            except Exception:
                logger.exception("reporting the lost claim of idempotency key %r failed",
                                 entry.key)


RENEWER = Renewer()

__all__ = ["RENEWALS_PER_LEASE", "RENEWER", "Renewer"]
