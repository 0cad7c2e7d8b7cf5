"""Bisecting a failed batch call, so that only the messages that fail alone take its failure.

A batch handler that raises fails every message of its call. With one poison message in a
batch, its neighbours would share each of its failures, and its redeliveries, up to the
dead-letter queue (#44, item 13). So when the call of a batch fails (after its in-process
retries), its messages are called again in halves, as AWS Lambda's ``BisectBatchOnFunctionError``
splits a failed batch: at once, in the batch's own task, while their claims and leases are held
(no redelivery, no backoff, and no failure counted for a message before it is decided)::

    the batch's call failed
       ▼
    its halves, each called ─ returned ─► decided as any call: acked (a BatchResult's
       │                    │             failures failing alone)
       │                    └ failed ──┐
       ▼                               ▼
    a failed group of one message: its own failure (counted; redelivered or dead-lettered)
    a failed group of more: halved again while the failure looks like its messages' (below),
                            else each of its messages fails, as the batch's call failed it

Whose failure is it? Once any call of the batch has returned (some half, at any level), the
failure is in some of its messages: every failed group is halved, down to single messages. While
none has -- the batch and both its halves failed -- it looks like the handler's dependency
(down, or refusing everything): the groups' messages fail as the batch's would have, each
counting one failure, and come back after their backoff, batched anew. But a failure that would
dead-letter a message (its last attempt, or a permanent failure: ``Reject``, ``non_retryable``)
is confirmed alone first: a group holding such a message is always halved. So a message reaches
the dead-letter queue only for a failure it met alone (or one a ``BatchResult`` named it for, or
its body failing to decode), never for its company. The failures it met in company earlier
still count toward its attempts (as Lambda counts them): a dependency that stays down ends, as
before, in the dead-letter queue after ``max_delivery_attempts`` -- for each message, after one
call of it alone.

What it costs, in calls of the handler for a batch of n messages:

* nothing fails: nothing (this module is not entered);
* k poison messages: about 2k·log2(n/k) calls more, once; at most 2n - 1 in all;
* every call fails (a dependency down): 2 more (the halves) per failed delivery of the batch,
  and at a message's last attempt the calls that isolate it (at most 2n - 1 for the batch);
  the deliveries themselves are paced by the backoff, as before.

Each call gets the route's in-process retries, and the batch's time limit (``timeout=``,
``LeasePolicy.max_lease_duration``, counted from receipt) bounds the whole bisection as it bounds
the batch's call. Once a stop began no call starts: what is undecided goes back to the broker,
uncounted, as a stopping batch's deliveries do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..middleware import Decision, Verdict
from ..policy import DeadLetterPolicy, RetryPolicy
from .lanes import Item, RunState

# A failed message and what it failed with.
Failure = tuple[Item, BaseException]


class Bisection:
    """Calls a failed batch's messages again in halves, deciding each group as its call ends.

    One per batch handler, built with its lane.

    Args:
        state: the run's switches (no call starts once a stop began).
        retry, dead_letter: the route's policies: which failure would dead-letter a message.
        call: one call of the handler for a group, with its in-process retries.
        returned: decides a group whose call returned what it returned (acks, and fails what a
            BatchResult names).
        fail: fails each message with its error (counted; redelivered or dead-lettered).
        give_back: gives back a group no call will be made for: nothing counted.
    """

    def __init__(
        self,
        state: RunState,
        retry: RetryPolicy,
        dead_letter: DeadLetterPolicy | None,
        *,
        call: Callable[[list[Item]], Awaitable[Decision]],
        returned: Callable[[list[Item], Any], None],
        fail: Callable[[list[Failure]], None],
        give_back: Callable[[list[Item]], None],
    ) -> None:
        self._state = state
        self._retry = retry
        # a failure is the last one a message may have before it is dead-lettered at this count
        self._last = None if dead_letter is None else dead_letter.max_delivery_attempts - 1
        self._call = call
        self._returned = returned
        self._fail = fail
        self._give_back = give_back

    async def run(self, items: list[Item], error: BaseException) -> None:
        """The call of ``items`` (two or more) failed with ``error``: find whose failure it is,
        and decide each of them."""
        returned = False  # a call of the batch returned: the failure is in some messages
        level = halves(items)
        while level:
            failed: list[tuple[list[Item], BaseException]] = []
            for group in level:
                if not self._state.accepting:  # a stop began: no call starts
                    self._give_back(group)
                    continue
                decision = await self._call(group)
                if decision.verdict is Verdict.ACK:
                    returned = True
                    self._returned(group, decision.result)
                    continue
                assert decision.error is not None
                if len(group) == 1:  # failed alone: its own failure
                    self._fail([(group[0], decision.error)])
                else:
                    failed.append((group, decision.error))
            level = []
            for group, error in failed:
                if returned or self._dead_letters(group, error):
                    level.extend(halves(group))
                else:  # nothing returned: as the batch's call failed them
                    self._fail([(item, error) for item in group])

    def _dead_letters(self, group: list[Item], error: BaseException) -> bool:
        """Whether failing ``group`` with ``error`` would dead-letter one of its messages."""
        last = self._last
        if last is None:
            return False
        return self._retry.is_permanent(error) or any(item.failures >= last for item in group)


def halves(items: list[Item]) -> list[list[Item]]:
    """``items`` in two, in order (the first half the smaller when their number is odd)."""
    middle = len(items) // 2
    return [items[:middle], items[middle:]]


__all__ = ["Bisection", "Failure", "halves"]
