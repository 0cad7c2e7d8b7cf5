"""Transactional handlers: the handler's writes and its dedup record commit in one transaction.

``@sub.handler(subscription, transactional=True)`` wraps the handler once, at registration::

    BEGIN
      handler(message, connection)          -- your writes, on the connection you were given
      UPDATE processed SET state='completed', result=...
        WHERE namespace=... AND key=... AND owner=<this delivery's token> AND state='claimed'
    COMMIT                                  -- or ROLLBACK when the UPDATE matched no row

The completion is the last statement, so the dedup row is locked only for the commit, never
while the handler runs (a peer's claim of another key never waits on this transaction). If the
claim lapsed and a peer took the key over, the UPDATE matches nothing: the whole transaction,
the handler's writes included, is rolled back and :class:`ClaimLostError` tells the Subscriber
to defer the message to the peer. Otherwise the effect and the "completed" mark are one commit,
so a crash can never leave one without the other. The Subscriber then only acks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from .._callables import settled_result, unawaitable_result_error
from ..errors import ClaimLostError
from ..message import Message
from ..ports import Claimed


@runtime_checkable
class TransactionalStore(Protocol):
    """A dedup store whose completion can run inside the handler's own transaction."""

    def begin(self) -> AbstractAsyncContextManager[Any]:
        """An async connection in a transaction (committed on exit, rolled back on error)."""
        ...

    def begin_sync(self) -> AbstractContextManager[Any]:
        """The same, for a sync handler on a worker thread."""
        ...

    async def complete_in(
        self, connection: Any, claim: Claimed, result_json: str, ttl: float
    ) -> bool:
        """Mark ``claim`` completed inside ``connection``'s transaction, owner-fenced; False
        if a peer took the key over."""
        ...

    def complete_in_sync(
        self, connection: Any, claim: Claimed, result_json: str, ttl: float
    ) -> bool:
        """The same on a sync connection."""
        ...


class Committed:
    """A transactional handler's result, committed together with its dedup record."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result


def transactional_handler(
    handler: Callable[..., Any],
    store: TransactionalStore,
    *,
    retention: float,
    is_async: bool,
    claim_of: Callable[[], Claimed | None],
    encode: Callable[[Any, Message], str],
) -> Callable[[Message], Any]:
    """Wrap ``handler(message, connection)`` as a one-argument handler that runs it and its
    completion in one transaction and returns :class:`Committed` (sync or async, as given)."""

    name = getattr(handler, "__qualname__", None) or repr(handler)

    def claim_for(message: Message) -> Claimed:
        claim = claim_of()
        if claim is None:  # the Subscriber always claims first; this is a bug guard
            raise RuntimeError(f"message {message.id}: a transactional handler ran unclaimed")
        return claim

    def lost(message: Message, claim: Claimed) -> ClaimLostError:
        return ClaimLostError(
            f"the dedup claim of message {message.id} (key {claim.key.key!r}) was taken over "
            "by a peer before the transaction committed; rolled back, handler's writes included"
        )

    if is_async:

        async def run_async(message: Message) -> Committed:
            claim = claim_for(message)
            async with store.begin() as connection:
                result = handler(message, connection)
                if result is not None:
                    result = await settled_result(result, name)
                result_json = encode(result, message)
                if not await store.complete_in(connection, claim, result_json, retention):
                    raise lost(message, claim)  # leaving the block rolls back
            return Committed(result)

        return run_async

    def run_sync(message: Message) -> Committed:
        claim = claim_for(message)
        with store.begin_sync() as connection:
            result = handler(message, connection)
            if result is not None:
                _check_settled(result, name)
            result_json = encode(result, message)
            if not store.complete_in_sync(connection, claim, result_json, retention):
                raise lost(message, claim)
        return Committed(result)

    return run_sync


def _check_settled(result: Any, name: str) -> None:
    """Refuse (rolling the transaction back) what a sync transactional handler returned unrun:
    an awaitable cannot be awaited on its thread, inside its transaction."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(
            f"transactional handler {name} returned an awaitable from a sync call, so its work "
            "never ran in the transaction (rolled back); declare it 'async def' (or return "
            "the result itself)"
        )
    error = unawaitable_result_error(result, name)
    if error is not None:
        raise error


__all__ = ["Committed", "TransactionalStore", "transactional_handler"]
