"""Publishing one round's rows so that each ordering key's rows reach the broker in order.

A round may hold several rows of one ordering key (oldest first). They go out in *waves*: wave
``n`` holds the ``n``-th row of every key whose earlier rows were all confirmed, and every row
without a key goes in the first wave. Each wave is one
:meth:`~reliable_sub.ports.BatchPublisher.publish_many` call where the adapter has it (else
concurrent ``publish`` calls). When a row fails, the rest of its key's rows are not sent this
round, so a later row never reaches the broker before an earlier one did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.context import Context

from ..ports import BatchPublisher, Outgoing, Publisher


class NotSent:
    """The outcome of a row that was not sent this round (an earlier row of its key failed, or
    the round ran out of time first): it stays pending, its attempts unchanged."""

    def __repr__(self) -> str:
        return "NOT_SENT"


NOT_SENT = NotSent()

Outcome = BaseException | NotSent | None  # None: published


async def publish_in_key_order(
    publisher: Publisher,
    messages: Sequence[Outgoing],
    timeout: float,
    contexts: Sequence[Context] | None = None,
) -> list[Outcome]:
    """Publish ``messages`` (oldest first), each key's in order; per message None (published),
    the exception that refused it, or :data:`NOT_SENT`. ``timeout`` seconds for all of it: the
    wave under way then counts as failed, later waves as not sent. ``contexts``: the trace
    context to publish each message under (its send span), where the adapter publishes one
    message per call."""
    outcomes: list[Outcome] = [NOT_SENT] * len(messages)
    in_flight: list[int] = []
    try:
        await asyncio.wait_for(_waves(publisher, messages, contexts, outcomes, in_flight),
                               timeout)
    except asyncio.TimeoutError:
        error = TimeoutError(f"the publish took longer than publish_timeout ({timeout:g}s)")
        for index in in_flight:
            outcomes[index] = error
    return outcomes


async def _waves(
    publisher: Publisher,
    messages: Sequence[Outgoing],
    contexts: Sequence[Context] | None,
    outcomes: list[Outcome],
    in_flight: list[int],
) -> None:
    chains: dict[Any, list[int]] = {}
    for index, message in enumerate(messages):
        # rows without a key each form a chain of their own
        key = message.ordering_key if message.ordering_key is not None else ("", index)
        chains.setdefault(key, []).append(index)
    active = [chain[::-1] for chain in chains.values()]  # pop() takes the oldest
    while active:
        wave = [chain.pop() for chain in active]
        in_flight[:] = wave
        try:
            results = await _publish_all(
                publisher, [messages[i] for i in wave],
                None if contexts is None else [contexts[i] for i in wave])
        except Exception as error:  # the whole call failed (e.g. the connection)
            results = [error] * len(wave)
        in_flight.clear()
        for index, result in zip(wave, results, strict=True):
            outcomes[index] = result if isinstance(result, BaseException) else None
        active = [chain for chain, index in zip(active, wave, strict=True)
                  if chain and outcomes[index] is None]


async def _publish_all(
    publisher: Publisher, messages: Sequence[Outgoing], contexts: Sequence[Context] | None,
) -> list[Any]:
    """Each message's id or error: one ``publish_many`` call where the adapter has it, else
    concurrent ``publish`` calls (each in its own task, under its context if given)."""
    if isinstance(publisher, BatchPublisher):
        return await publisher.publish_many(messages)
    calls = []
    for index, message in enumerate(messages):
        token = None if contexts is None else otel_context.attach(contexts[index])
        try:  # the task copies the current context: its publish runs under the span
            calls.append(asyncio.ensure_future(publisher.publish(*message)))
        finally:
            if token is not None:
                otel_context.detach(token)
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, asyncio.CancelledError):
            raise result
    return results


__all__ = ["NOT_SENT", "NotSent", "Outcome", "publish_in_key_order"]
