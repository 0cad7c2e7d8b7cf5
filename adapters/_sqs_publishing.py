"""Publishing to SQS: what a refusal means, and ``publish_many`` as ``SendMessageBatch`` calls.

A batch call takes at most ``MAX_BATCH`` messages and ``MAX_BATCH_SIZE`` bytes in all (the sum of
its messages' sizes as SQS counts them); each entry succeeds or fails on its own. A FIFO queue's
batches go one after another, so a group's messages reach it in the order given; a standard
queue's go together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from reliable_sub.adapters._sqs_client import QUEUE_DOES_NOT_EXIST, access_checked, error_code
from reliable_sub.adapters._sqs_messages import MAX_MESSAGE_SIZE
from reliable_sub.adapters._sqs_topology import Queue
from reliable_sub.errors import AdapterError, InvalidMessageError, UnknownTopicError

if TYPE_CHECKING:
    from types_aiobotocore_sqs import SQSClient

MAX_BATCH = 10
MAX_BATCH_SIZE = MAX_MESSAGE_SIZE
# The codes by which SQS refuses a message's contents (ElasticMQ names most of them
# InvalidAttributeValue, AWS's name in the message).
REFUSED_CONTENTS = frozenset({"InvalidMessageContents", "InvalidParameterValue",
                              "InvalidAttributeValue", "InvalidAttributeName",
                              "MessageTooLong", "InvalidParameterCombination",
                              "InvalidBatchEntryId"})


def publish_error(error: ClientError, topic: str) -> Exception:
    """What SQS's refusal of a publish to ``topic`` means, as this library's error."""
    code = error_code(error)
    if code == QUEUE_DOES_NOT_EXIST:
        return UnknownTopicError(f"topic {topic!r} does not exist (its queue is gone); create "
                                 "it with ensure_topic or ensure_subscription")
    if code in REFUSED_CONTENTS:
        return InvalidMessageError(f"publish to {topic!r}: SQS refused the message ({code}: "
                                   f"{error.response.get('Error', {}).get('Message')})")
    return access_checked(error, f"publishing to {topic!r}")


def size_of(params: dict[str, Any]) -> int:
    """A SendMessage entry's size as SQS counts it."""
    size = len(params["MessageBody"].encode())
    for name, field in (params.get("MessageAttributes") or {}).items():
        size += len(name.encode()) + len(field["DataType"]) + len(
            field.get("StringValue", "").encode())
    return size


def _batches(entries: list[tuple[int, dict[str, Any]]], limit: int
             ) -> list[list[tuple[int, dict[str, Any]]]]:
    batches: list[list[tuple[int, dict[str, Any]]]] = []
    current: list[tuple[int, dict[str, Any]]] = []
    size = 0
    for item in entries:
        item_size = size_of(item[1])
        if current and (len(current) == MAX_BATCH or size + item_size > limit):
            batches.append(current)
            current, size = [], 0
        current.append(item)
        size += item_size
    if current:
        batches.append(current)
    return batches


async def send_batches(client: SQSClient, queue: Queue, topic: str,
                       entries: list[tuple[int, dict[str, Any]]],
                       results: list[str | Exception | None], counts: dict[str, int],
                       refusal: Callable[[ClientError, str], Exception],
                       limit: int = MAX_BATCH_SIZE) -> None:
    """Send ``entries`` (each with its index in ``results``) to ``queue``; each one's message
    id or error is written to ``results``."""

    async def one(batch: list[tuple[int, dict[str, Any]]]) -> bool:
        """Whether every message of ``batch`` was sent."""
        counts["send_calls"] += 1
        try:
            batch_entries: list[Any] = [{"Id": str(n), **params}
                                        for n, (_, params) in enumerate(batch)]
            reply = await client.send_message_batch(QueueUrl=queue.url, Entries=batch_entries)
        except ClientError as error:
            failed = refusal(error, topic)
            for index, _ in batch:
                results[index] = failed
            return False
        except Exception as error:  # a connection: every message of the batch failed
            for index, _ in batch:
                results[index] = error
            return False
        for done in reply.get("Successful", []):
            results[batch[int(done["Id"])][0]] = str(done["MessageId"])
        for failure in reply.get("Failed", []):
            code, text = failure.get("Code"), failure.get("Message")
            results[batch[int(failure["Id"])][0]] = (
                InvalidMessageError(f"publish to {topic!r}: SQS refused the message ({code}: "
                                    f"{text})") if failure.get("SenderFault", True)
                else AdapterError(f"publish to {topic!r}: SQS failed the message on its side "
                                  f"({code}: {text}); publish it again"))
        return not reply.get("Failed")

    batches = _batches(entries, limit)
    if queue.fifo:  # in order: after a failure nothing later may overtake the failed one
        for n, batch in enumerate(batches):
            if not await one(batch):
                for later in batches[n + 1:]:
                    for index, _ in later:
                        results[index] = AdapterError(
                            f"publish to {topic!r}: not sent, an earlier message to this FIFO "
                            "queue failed (sent now, it could overtake that one); publish it "
                            "again after that one")
                return
    else:
        await asyncio.gather(*(one(batch) for batch in batches))
