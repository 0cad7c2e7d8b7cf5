"""What the running handler holds: :func:`current_claim`, for single and batch handlers."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

from ..dedup import Claimed
from ..message import Message

# The claim of the delivery whose handler the current task runs.
CURRENT_CLAIM: contextvars.ContextVar[Claimed | None] = contextvars.ContextVar(
    "reliable_sub_current_claim", default=None
)
# The deliveries a batch handler runs on, in the current task.
CURRENT_BATCH: contextvars.ContextVar[BatchClaims | None] = contextvars.ContextVar(
    "reliable_sub_current_batch", default=None
)


class BatchClaims:
    """The claims of a batch's deliveries, by message id (the map built when first asked)."""

    __slots__ = ("_by_id", "_items")

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = items
        self._by_id: dict[str, Claimed | None] | None = None

    def of(self, message: Message) -> Claimed | None:
        by_id = self._by_id
        if by_id is None:
            by_id = self._by_id = {item.message_id: item.claim for item in self._items}
        return by_id.get(message.id)


def current_claim(message: Message | None = None) -> Claimed | None:
    """The dedup claim the running handler holds (its key and fencing token), or None.

    In a batch handler, pass one of its messages: the claim held for that message. Pass
    ``claim.token`` to a system that can reject writes from a stale claim holder.
    """
    if message is not None:
        batch = CURRENT_BATCH.get()
        if batch is not None:
            return batch.of(message)
    return CURRENT_CLAIM.get()
