"""Acks and visibility changes as SQS batch calls, judged entry by entry.

``DeleteMessageBatch`` and ``ChangeMessageVisibilityBatch`` take at most ``MAX_BATCH`` entries;
the chunks of one call go out together. A batch call succeeds as a whole and reports each entry
apart: an entry SQS refuses as the sender's fault (``ReceiptHandleIsInvalid``: a stale or
unknown handle) is refused, only that one; an entry that failed on SQS's side is sent once more
in a batch of its own kind, and if it fails again the call raises (after the others took
effect), so the caller tries again. On ElasticMQ a repeated delete of a deleted message is
refused; on AWS it succeeds: neither is counted on (see ``_sqs_leases``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from reliable_sub.adapters._sqs_client import QUEUE_DOES_NOT_EXIST, access_checked, error_code
from reliable_sub.errors import AdapterError, UnknownSubscriptionError
from reliable_sub.message import Delivery

if TYPE_CHECKING:
    from types_aiobotocore_sqs import SQSClient

# SQS's most entries per batch call.
MAX_BATCH = 10


@dataclass(frozen=True, slots=True)
class Entry:
    """One delivery of a batch call, and the visibility to set (None: a delete)."""

    delivery: Delivery
    queue_url: str
    seconds: int | None = None


@dataclass
class Outcome:
    """What a batch call did: the entries that took effect, those refused."""

    done: list[Entry]
    refused: list[Entry]


async def apply(client: SQSClient, entries: Sequence[Entry], counts: dict[str, int]
                ) -> Outcome:
    """Delete (``seconds`` None) or change the visibility of every entry, by queue, in chunks
    of ``MAX_BATCH`` sent together."""
    chunks: list[list[Entry]] = []
    by_queue: dict[tuple[str, bool], list[Entry]] = {}
    for entry in entries:
        by_queue.setdefault((entry.queue_url, entry.seconds is None), []).append(entry)
    for group in by_queue.values():
        chunks.extend(group[i:i + MAX_BATCH] for i in range(0, len(group), MAX_BATCH))
    results = await asyncio.gather(*(_chunk(client, chunk, counts) for chunk in chunks),
                                   return_exceptions=True)
    outcome = Outcome([], [])
    failure: BaseException | None = None
    for result in results:
        if isinstance(result, BaseException):
            failure = failure or result
            continue
        outcome.done.extend(result.done)
        outcome.refused.extend(result.refused)
    if failure is not None:
        if outcome.done or outcome.refused:
            # what took effect is recorded by the caller before the error reaches it
            raise PartialFailure(outcome, failure) from failure
        raise failure
    return outcome


class PartialFailure(AdapterError):
    """Some chunks of a batch took effect, another failed: ``outcome`` has what took effect."""

    def __init__(self, outcome: Outcome, error: BaseException) -> None:
        super().__init__(f"an SQS batch call failed: {error!r}")
        self.outcome = outcome
        self.error = error


async def _chunk(client: SQSClient, chunk: list[Entry], counts: dict[str, int],
                 again: bool = True) -> Outcome:
    queue_url = chunk[0].queue_url
    try:
        reply = await _call(client, queue_url, chunk, counts)
    except ClientError as error:
        if error_code(error) == QUEUE_DOES_NOT_EXIST:
            raise UnknownSubscriptionError(
                f"the queue {queue_url.rsplit('/', 1)[-1]!r} of subscription "
                f"{chunk[0].delivery.message.subscription!r} is gone; create it again with "
                "ensure_subscription") from error
        raise access_checked(error, f"a batch call on queue {queue_url!r}") from error
    outcome = Outcome([], [])
    failed = {str(f["Id"]): f for f in reply.get("Failed", [])}
    retry: list[Entry] = []
    for n, entry in enumerate(chunk):
        failure = failed.get(str(n))
        if failure is None:
            outcome.done.append(entry)
        elif failure.get("SenderFault", True):
            outcome.refused.append(entry)
        else:
            retry.append(entry)
    if retry:
        if not again:
            reasons = sorted({str(failed[str(chunk.index(e))].get("Code")) for e in retry})
            raise AdapterError(f"SQS failed {len(retry)} entries of a batch call on its side "
                               f"({', '.join(reasons)}), twice; the call is tried again")
        more = await _chunk(client, retry, counts, again=False)
        outcome.done.extend(more.done)
        outcome.refused.extend(more.refused)
    return outcome


async def _call(client: SQSClient, queue_url: str, chunk: list[Entry],
                counts: dict[str, int]) -> Any:
    if chunk[0].seconds is None:
        counts["delete_calls"] += 1
        return await client.delete_message_batch(QueueUrl=queue_url, Entries=[
            {"Id": str(n), "ReceiptHandle": e.delivery.ack_id} for n, e in enumerate(chunk)])
    counts["visibility_calls"] += 1
    return await client.change_message_visibility_batch(QueueUrl=queue_url, Entries=[
        {"Id": str(n), "ReceiptHandle": e.delivery.ack_id,
         "VisibilityTimeout": int(e.seconds or 0)} for n, e in enumerate(chunk)])
