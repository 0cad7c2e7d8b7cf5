"""Clean-ups of what a conformance run made on a shared broker (its names hold the run's
prefix): RabbitMQ cannot list queues over AMQP, so the names given are deleted with every
queue they may have made; NATS streams are found by a fragment of their name, SQS queues by
their prefix; Kafka topics and consumer groups are deleted by name."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

# Seconds a Kafka clean-up request may take.
KAFKA_CLEANUP_TIMEOUT = 30.0


async def delete_rabbitmq_names(url: str, prefix: str, names: list[str]) -> None:
    """Delete the queues and exchanges of ``names`` (AMQP cannot list them), and their
    settings queues; a name never used is fine."""
    import aio_pika

    from reliable_sub.adapters._rabbitmq_topology import delay_lengths

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        lengths = delay_lengths()  # the delay queues a nack may have made
        for name in names:
            targets = [("queue_delete", name), ("exchange_delete", name),
                       ("queue_delete", f"{prefix}.settings.{name}")]
            if "-sub-" in name:
                targets += [("queue_delete", f"{prefix}.delay.{name}.{ms}") for ms in lengths]
            for delete, target in targets:
                if channel.is_closed:
                    channel = await connection.channel()
                with contextlib.suppress(Exception):
                    await getattr(channel, delete)(target)
    finally:
        await connection.close()


async def delete_nats_streams(url: str, fragment: str) -> None:
    """Delete the streams (and so the consumers and key-value buckets) of the NATS server at
    ``url`` whose names hold ``fragment``."""
    import nats

    client = await nats.connect(url, max_reconnect_attempts=0)
    try:
        js = client.jetstream()
        for info in await js.streams_info():
            name = info.config.name or ""
            if fragment in name:
                await js.delete_stream(name)
    finally:
        await client.close()


async def delete_kafka_names(bootstrap: str, names: Sequence[str]) -> None:
    """Delete the topics and consumer groups named ``names`` on the Kafka cluster at
    ``bootstrap`` (a name that is neither is fine)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    topics = set(admin.list_topics(timeout=KAFKA_CLEANUP_TIMEOUT).topics) & set(names)
    groups = [name for name in names if name not in topics]
    futures = list(admin.delete_topics(sorted(topics), operation_timeout=KAFKA_CLEANUP_TIMEOUT
                                       ).values()) if topics else []
    if groups:
        futures += admin.delete_consumer_groups(
            groups, request_timeout=KAFKA_CLEANUP_TIMEOUT).values()
    for future in futures:
        with contextlib.suppress(KafkaException):  # a group never made, or one with members
            await asyncio.wrap_future(future)



async def delete_sqs_queues(client_options: dict[str, Any], prefix: str) -> None:
    """Delete the SQS queues whose names start with ``prefix`` (the server's at
    ``client_options``: boto3's client arguments)."""
    from aiobotocore.session import get_session

    async with get_session().create_client("sqs", **client_options) as client:
        listed = await client.list_queues(QueueNamePrefix=prefix, MaxResults=1000)
        for url in listed.get("QueueUrls", []):
            with contextlib.suppress(Exception):
                await client.delete_queue(QueueUrl=url)


__all__ = ["delete_kafka_names", "delete_nats_streams", "delete_rabbitmq_names",
           "delete_sqs_queues"]
