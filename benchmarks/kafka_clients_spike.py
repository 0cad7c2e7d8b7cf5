"""Spike: confluent-kafka (librdkafka) against aiokafka on one local Kafka broker, to choose the
Kafka adapter's client. Raw client throughput only; no reliable-sub code runs.

    python -m benchmarks.kafka_clients_spike                 # 3 rounds, its own broker
    python -m benchmarks.kafka_clients_spike --rounds 2 --bootstrap 127.0.0.1:9092

Needs both clients: ``pip install -e ".[kafka]" aiokafka`` (aiokafka is no dependency of ours).

Starts a private broker (``tests/kafka_processes.py``, with the JIT's full tiers, unlike the
tests' quick-starting ones) unless given one. A topic of PARTITIONS partitions is filled with
RECORDS records (``--records``) of VALUE_SIZE bytes; each consume variant reads all of it as a
new group from the earliest offset, BATCH records a call, committing after each batch; each
produce variant sends as many to a fresh topic, idempotent with acks=all. Rounds run the
variants in alternating order; the table shows each round's msgs/s (timed from the first record
received, or the first send, to the last commit, or the last delivery report), the client
process's CPU per record (its librdkafka threads included), and the median's ratio to the first
variant of its kind. The confluent consumers set ``fetch.queue.backoff.ms`` (see _ck_config),
but for the one marked "librdkafka defaults".
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiokafka
import confluent_kafka
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.aio import AIOConsumer, AIOProducer

from tests.kafka_processes import JVM_OPTIONS, KafkaBroker

RECORDS = 100_000  # the default backlog (--records)
VALUE_SIZE = 100  # bytes: a small event
PARTITIONS = 4
BATCH = 500  # records a consume call, and a commit per batch
POLL_TIMEOUT = 1.0  # s a consume call may wait for records
FETCH_QUEUE_BACKOFF_MS = 10  # see _ck_config
LINGER_MS = 5  # librdkafka's default, set for aiokafka too (its default is 0)
# The benchmark's broker: the tests' JVM options less the C1-only flag (a broker that runs for
# minutes of throughput wants C2), so the broker is not what is measured.
BROKER_JVM_OPTIONS = tuple(option for option in JVM_OPTIONS if "TieredStopAtLevel" not in option)

Result = tuple[int, float, float]  # records, wall seconds, client CPU seconds


def _group() -> str:
    return f"spike-{uuid.uuid4().hex[:8]}"


def create_topic(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})  # alive until the answer came
    futures = admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    futures[topic].result(timeout=30)


def prefill(bootstrap: str, topic: str, count: int) -> None:
    create_topic(bootstrap, topic)
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    value = b"x" * VALUE_SIZE
    for number in range(count):
        while True:
            try:
                producer.produce(topic, value, key=str(number % 64).encode(),
                                 headers=[("attempt", b"\x00\x01")])
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(60) == 0


class Clock:
    """Wall and CPU time from the first record to the end."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def first(self) -> None:
        if not self.wall:
            self.wall, self.cpu = time.perf_counter(), time.process_time()

    def result(self, records: int) -> Result:
        return records, time.perf_counter() - self.wall, time.process_time() - self.cpu


def _ck_config(bootstrap: str, tuned: bool = True) -> dict[str, Any]:
    config = {"bootstrap.servers": bootstrap, "group.id": _group(), "enable.auto.commit": False,
              "auto.offset.reset": "earliest"}
    if tuned:
        # librdkafka stops fetching a partition once it holds queued.min.messages (100,000) of
        # it, and then waits this long (default 1000 ms) before fetching it again: on a backlog
        # larger than that the consumer idles a second at a time (~200k msgs/s over 500,000
        # records, the client's CPU mostly idle).
        config["fetch.queue.backoff.ms"] = FETCH_QUEUE_BACKOFF_MS
    return config


def ck_direct(bootstrap: str, topic: str, count: int, asynchronous: bool,
              tuned: bool = True) -> Result:
    consumer = confluent_kafka.Consumer(_ck_config(bootstrap, tuned))
    consumer.subscribe([topic])
    clock, seen, size = Clock(), 0, 0
    while seen < count:
        batch = consumer.consume(num_messages=BATCH, timeout=POLL_TIMEOUT)
        if batch:
            clock.first()
            seen += len(batch)
            size += sum(len(message.value()) for message in batch)
            consumer.commit(asynchronous=asynchronous)
    result = clock.result(seen)
    consumer.close()
    return result


async def ck_executor(bootstrap: str, topic: str, count: int, asynchronous: bool) -> Result:
    """The plain Consumer from asyncio: each consume in a worker thread; an asynchronous
    commit called on the loop (it only queues), a synchronous one in a thread too."""
    consumer = confluent_kafka.Consumer(_ck_config(bootstrap))
    consumer.subscribe([topic])
    clock, seen, size = Clock(), 0, 0
    while seen < count:
        batch = await asyncio.to_thread(consumer.consume, BATCH, POLL_TIMEOUT)
        if batch:
            clock.first()
            seen += len(batch)
            size += sum(len(message.value()) for message in batch)
            if asynchronous:
                consumer.commit(asynchronous=True)
            else:
                await asyncio.to_thread(consumer.commit, asynchronous=False)
    result = clock.result(seen)
    consumer.close()
    return result


async def ck_aio(bootstrap: str, topic: str, count: int, asynchronous: bool) -> Result:
    """confluent_kafka.aio.AIOConsumer: every call awaited through its thread pool."""
    consumer = AIOConsumer(_ck_config(bootstrap), max_workers=2)
    await consumer.subscribe([topic])
    clock, seen, size = Clock(), 0, 0
    while seen < count:
        batch = await consumer.consume(num_messages=BATCH, timeout=POLL_TIMEOUT)
        if batch:
            clock.first()
            seen += len(batch)
            size += sum(len(message.value()) for message in batch)
            await consumer.commit(asynchronous=asynchronous)
    result = clock.result(seen)
    await consumer.close()
    return result


async def aiokafka_getmany(bootstrap: str, topic: str, count: int, background: bool) -> Result:
    """aiokafka's commit is always a round trip awaited; ``background``: in a task, one in
    flight at a time (a batch's commit is skipped while the previous one runs: the next one
    covers it), the nearest to librdkafka's asynchronous commit."""
    consumer = aiokafka.AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=_group(),
                                         enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    clock, seen, size = Clock(), 0, 0
    committing: asyncio.Task[None] | None = None
    while seen < count:
        batches = await consumer.getmany(timeout_ms=int(POLL_TIMEOUT * 1000), max_records=BATCH)
        if batches:
            clock.first()
            for records in batches.values():
                seen += len(records)
                size += sum(len(record.value) for record in records)
            if not background:
                await consumer.commit()
            elif committing is None or committing.done():
                committing = asyncio.create_task(consumer.commit())
    if committing is not None:
        await committing
        await consumer.commit()  # the last batches' offsets
    result = clock.result(seen)
    await consumer.stop()
    return result


def ck_produce(bootstrap: str, topic: str, count: int) -> Result:
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": "all",
                                         "enable.idempotence": True, "linger.ms": LINGER_MS})
    value, clock, failed = b"x" * VALUE_SIZE, Clock(), []
    clock.first()
    for _ in range(count):
        while True:
            try:
                producer.produce(topic, value, on_delivery=lambda error, _m: error and
                                 failed.append(error))
                break
            except BufferError:  # the local queue is full: serve delivery reports
                producer.poll(0.01)
        producer.poll(0)
    assert producer.flush(60) == 0 and not failed, failed[:3]
    return clock.result(count)


async def ck_aio_produce(bootstrap: str, topic: str, count: int) -> Result:
    """confluent_kafka.aio.AIOProducer: buffers, hands batches to its thread pool (it refuses
    headers in this mode)."""
    producer = AIOProducer({"bootstrap.servers": bootstrap, "acks": "all",
                            "enable.idempotence": True, "linger.ms": LINGER_MS})
    value, clock = b"x" * VALUE_SIZE, Clock()
    clock.first()
    futures = [await producer.produce(topic, value) for _ in range(count)]
    await producer.flush()
    await asyncio.gather(*futures)
    result = clock.result(count)
    await producer.close()
    return result


async def aiokafka_produce(bootstrap: str, topic: str, count: int) -> Result:
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all",
                                         enable_idempotence=True, linger_ms=LINGER_MS)
    await producer.start()
    value, clock = b"x" * VALUE_SIZE, Clock()
    clock.first()
    futures = [await producer.send(topic, value) for _ in range(count)]
    await asyncio.gather(*futures)
    result = clock.result(count)
    await producer.stop()
    return result


Variant = Callable[[str, str, int], Result]  # (bootstrap, topic, records) -> result


def _sync(function: Callable[..., Result], *args: Any) -> Variant:
    return lambda bootstrap, topic, count: function(bootstrap, topic, count, *args)


def _async(function: Callable[..., Awaitable[Result]], *args: Any) -> Variant:
    return lambda bootstrap, topic, count: asyncio.run(function(bootstrap, topic, count, *args))


CONSUMERS: dict[str, Variant] = {
    "confluent consume(), async commit": _sync(ck_direct, True),
    "confluent consume(), async commit, librdkafka defaults": _sync(ck_direct, True, False),
    "confluent consume(), sync commit": _sync(ck_direct, False),
    "confluent to_thread(consume), async commit": _async(ck_executor, True),
    "confluent to_thread(consume), sync commit": _async(ck_executor, False),
    "confluent.aio AIOConsumer, async commit": _async(ck_aio, True),
    "confluent.aio AIOConsumer, sync commit": _async(ck_aio, False),
    "aiokafka getmany(), await commit()": _async(aiokafka_getmany, False),
    "aiokafka getmany(), commit in a task": _async(aiokafka_getmany, True),
}
PRODUCERS: dict[str, Variant] = {
    "confluent Producer.produce()": _sync(ck_produce),
    "confluent.aio AIOProducer": _async(ck_aio_produce),
    "aiokafka send()": _async(aiokafka_produce),
}


def run(bootstrap: str, rounds: int, count: int) -> None:
    source = f"spike-source-{uuid.uuid4().hex[:8]}"
    prefill(bootstrap, source, count)
    # every produce run gets a topic of its own, made now: one made just before its run would
    # still be electing leaders (the first sends retried on NOT_LEADER_OR_FOLLOWER)
    fresh = [f"spike-produce-{uuid.uuid4().hex[:8]}" for _ in range(rounds * len(PRODUCERS))]
    for topic in fresh:
        create_topic(bootstrap, topic)
    results: dict[str, list[Result]] = {name: [] for name in [*CONSUMERS, *PRODUCERS]}
    for round_number in range(rounds):
        order = [*CONSUMERS.items(), *PRODUCERS.items()]
        for name, variant in order if round_number % 2 == 0 else reversed(order):
            topic = fresh.pop() if name in PRODUCERS else source
            records, wall, cpu = variant(bootstrap, topic, count)
            assert records >= count, (name, records)
            results[name].append((records, wall, cpu))
            print(f"  round {round_number + 1}: {name}: {records / wall:,.0f} msgs/s", flush=True)
    print_table(results, rounds)


def print_table(results: dict[str, list[Result]], rounds: int) -> None:
    header = " | ".join(f"round {number + 1}" for number in range(rounds))
    print(f"\n| variant | {header} | median msgs/s | client CPU µs/msg | ratio |")
    print("|---" * (rounds + 4) + "|")
    for names in (CONSUMERS, PRODUCERS):
        baseline = None
        for name in names:
            rates = [records / wall for records, wall, _ in results[name]]
            median = statistics.median(rates)
            baseline = baseline or median
            cpu = statistics.median(cpu / records * 1e6 for records, _, cpu in results[name])
            cells = " | ".join(f"{rate:,.0f}" for rate in rates)
            print(f"| {name} | {cells} | {median:,.0f} | {cpu:.1f} | {median / baseline:.2f}× |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=RECORDS)
    parser.add_argument("--bootstrap", help="an existing broker's host:port (else start one)")
    arguments = parser.parse_args()
    print(f"confluent-kafka {confluent_kafka.version()} (librdkafka "
          f"{confluent_kafka.libversion()[0]}), aiokafka {aiokafka.__version__}; "
          f"{arguments.records:,} records of {VALUE_SIZE} B, {PARTITIONS} partitions, "
          f"batches of {BATCH}")
    if arguments.bootstrap:
        run(arguments.bootstrap, arguments.rounds, arguments.records)
        return
    with tempfile.TemporaryDirectory(prefix="kafka-spike-") as directory:
        broker = KafkaBroker(Path(directory), jvm_options=BROKER_JVM_OPTIONS)
        try:
            broker.start()
            run(broker.bootstrap, arguments.rounds, arguments.records)
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
