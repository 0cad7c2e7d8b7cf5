"""The SQS benchmark's pieces: its server, its queues, the requests it counts, its consumers.

:class:`Queues` makes each run's queue on the private ElasticMQ and fills it with
``SendMessageBatch`` (untimed), and afterwards checks it is empty and deletes it.
:class:`Requests` counts what one aiobotocore client asks of the server, through botocore's
event system: every HTTP request sent (``request-created``, so a retry counts), each operation
(``before-call``), the messages each ``ReceiveMessage`` brought and the entries each
``DeleteMessageBatch`` deleted (``after-call``); a run is settled once the deletes reach the
backlog. :class:`RoundTrips` counts what (d)'s dedup store sends to Redis. :class:`RawLoop` is
(a), :class:`SqsSubscriber` is (c) and (d).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from redis.commands.core import AsyncScript

from benchmarks._brokers import LoopConsumer, SubscriberConsumer, Tally, count_in
from reliable_sub import Subscriber
from reliable_sub.adapters.sqs import DEFAULT_RECEIVE_CALLS, SqsAdapter
from reliable_sub.dedup import RedisDedupStore
from tests.sqs_processes import ElasticMqServer

BATCH = 10  # SQS's most messages per receive and entries per batch call
BODY = "x" * 64
ACK_DEADLINE = 30  # every queue's VisibilityTimeout
# (a)'s receive loops: as many as the calls one receive of the adapter makes at most, its
# default receive_calls (a long poll, then, when it came back full, the others at once).
RAW_LOOPS = DEFAULT_RECEIVE_CALLS
# (a)'s long poll. A run never waits on it (the backlog is there); once the queue is empty the
# other loops' last polls end within it, after the clock.
RAW_WAIT = 1
FILL_CALLS = 8  # SendMessageBatch calls in flight while filling (untimed)
POOL = 50  # HTTP connections of every client: the adapter's default max_pool_connections
# The Subscriber's stop timeout. The adapter's receive is not cancel-safe: a stop waits this
# long for the idle long poll in flight (receive_timeout, 5 s) before it cancels it, after the
# clock.
SHUTDOWN_TIMEOUT = 0.5
# The server's JVM for a throughput benchmark: the full JIT (not the tests' client compiler
# only), one GC thread (the machine is shared), a heap for a backlog of 20,000 messages.
SERVER_JVM_OPTIONS = ("-XX:+UseSerialGC", "-Xmx1g")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def server(directory: Path) -> ElasticMqServer:
    """ElasticMQ in memory (no H2 store: with it the store is the bottleneck, ~1,500 msgs/s in
    ``benchmarks/sqs_clients_spike.py``), on a free port."""
    return ElasticMqServer(directory, persistent=False, jvm_options=SERVER_JVM_OPTIONS)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


# -- counting ------------------------------------------------------------------------------------


@dataclass
class Requests:
    """What one client asked of the server since :meth:`reset`, seen through botocore's events."""

    http: int = 0  # requests sent (request-created: retries count)
    operations: Counter[str] = field(default_factory=Counter)  # calls, by operation
    received: int = 0  # messages the receives brought
    empty_receives: int = 0
    deleted: int = 0  # entries the deletes took
    delete_failed: int = 0
    # seconds × calls in flight, by operation, from before-call to after-call (sent, answered,
    # parsed); divided by a run's seconds: the mean number in flight
    busy: dict[str, float] = field(default_factory=dict)
    _in_flight: Counter[str] = field(default_factory=Counter)
    _since: dict[str, float] = field(default_factory=dict)

    def install(self, client: Any) -> None:
        events = client.meta.events
        events.register("request-created.sqs", self._request)
        events.register("before-call.sqs", self._call)
        events.register("after-call.sqs", self._answered)
        events.register("after-call.sqs.ReceiveMessage", self._received)
        events.register("after-call.sqs.DeleteMessageBatch", self._deleted)

    def reset(self) -> None:
        self.http = self.received = self.empty_receives = self.deleted = self.delete_failed = 0
        self.operations.clear()
        self.busy.clear()
        now = time.perf_counter()
        self._since = dict.fromkeys(self._in_flight, now)

    def _request(self, **_: Any) -> None:
        self.http += 1

    def _moved(self, operation: str, by: int) -> None:
        now = time.perf_counter()
        spent = now - self._since.get(operation, now)
        self.busy[operation] = self.busy.get(operation, 0.0) + self._in_flight[operation] * spent
        self._since[operation] = now
        self._in_flight[operation] += by

    def _call(self, model: Any, **_: Any) -> None:
        self.operations[model.name] += 1
        self._moved(model.name, 1)

    def _answered(self, model: Any, **_: Any) -> None:
        self._moved(model.name, -1)

    def _received(self, parsed: dict[str, Any], **_: Any) -> None:
        count = len(parsed.get("Messages", []))
        self.received += count
        self.empty_receives += count == 0

    def _deleted(self, parsed: dict[str, Any], **_: Any) -> None:
        self.deleted += len(parsed.get("Successful", []))
        self.delete_failed += len(parsed.get("Failed", []))

    def snapshot(self) -> Counts:
        for operation in list(self._in_flight):  # the time in flight up to now
            self._moved(operation, 0)
        return Counts(self.http, dict(self.operations), self.received, self.empty_receives,
                      self.deleted, dict(self.busy))


@dataclass(frozen=True)
class Counts:
    """:class:`Requests` at one moment (the end of a run's clock)."""

    http: int
    operations: dict[str, int]
    received: int
    empty_receives: int
    deleted: int
    busy: dict[str, float]  # call-seconds in flight, by operation

    def calls(self, operation: str) -> int:
        return self.operations.get(operation, 0)


class RoundTrips:
    """Round trips a ``redis.asyncio.Redis`` client sends, by command (a pipeline is one; an
    EVALSHA is named by the attribute of the store that holds its script), from
    :meth:`install` on (instance attributes wrap ``execute_command`` and ``pipeline``)."""

    def __init__(self) -> None:
        self.round_trips: Counter[str] = Counter()
        self.script_names: dict[str, str] = {}

    def name_scripts(self, owner: object) -> None:
        """``_claim_script`` is labelled ``EVALSHA claim``, ``_complete`` ``EVALSHA complete``."""
        for attribute, value in vars(owner).items():
            if isinstance(value, AsyncScript):
                name = attribute.strip("_").removesuffix("_script")
                self.script_names[value.sha] = f"EVALSHA {name}"

    def _label(self, args: tuple[Any, ...]) -> str:
        command = str(args[0]).upper()
        if command == "EVALSHA" and len(args) > 1:
            return self.script_names.get(str(args[1]), "EVALSHA (other)")
        return command

    def install(self, client: Any) -> None:
        send = client.execute_command
        make_pipeline = client.pipeline

        async def execute_command(*args: Any, **options: Any) -> Any:
            self.round_trips[self._label(args)] += 1
            return await send(*args, **options)

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make_pipeline(*args, **kwargs)
            run = pipe.execute

            async def execute(raise_on_error: bool = True) -> Any:
                self.round_trips["pipeline"] += 1
                return await run(raise_on_error)

            pipe.execute = execute
            return pipe

        client.execute_command = execute_command
        client.pipeline = pipeline


async def client_of(options: dict[str, str]) -> tuple[Any, Any]:
    """An aiobotocore SQS client for ``options`` (the server's), with POOL connections, and its
    context (to close it with ``__aexit__``)."""
    settings: dict[str, Any] = dict(options)
    context = get_session().create_client("sqs", config=AioConfig(max_pool_connections=POOL),
                                           **settings)
    return await context.__aenter__(), context


# -- queues --------------------------------------------------------------------------------------


@dataclass
class Queues:
    """Makes, fills, checks and deletes the runs' queues, with a control client of its own."""

    client: Any

    async def make(self, name: str, messages: int) -> str:
        """A standard queue ``name`` (VisibilityTimeout ACK_DEADLINE) holding ``messages``."""
        url = str((await self.client.create_queue(
            QueueName=name, Attributes={"VisibilityTimeout": str(ACK_DEADLINE)}))["QueueUrl"])
        starts = iter(range(0, messages, BATCH))

        async def sender() -> None:
            for start in starts:
                reply = await self.client.send_message_batch(QueueUrl=url, Entries=[
                    {"Id": str(n), "MessageBody": BODY}
                    for n in range(min(BATCH, messages - start))])
                if reply.get("Failed"):
                    raise RuntimeError(f"{name}: sends refused: {reply['Failed']}")

        await asyncio.gather(*(sender() for _ in range(FILL_CALLS)))
        held = await self.held(url)
        if held != (messages, 0):
            raise RuntimeError(f"{name}: holds (visible, in flight) {held}, not "
                               f"({messages}, 0)")
        return url

    async def held(self, url: str) -> tuple[int, int]:
        """(visible + delayed, in flight) messages of the queue: ElasticMQ's counts are exact."""
        reply = await self.client.get_queue_attributes(QueueUrl=url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed"])
        found = {name: int(value) for name, value in reply["Attributes"].items()}
        return (found["ApproximateNumberOfMessages"] + found["ApproximateNumberOfMessagesDelayed"],
                found["ApproximateNumberOfMessagesNotVisible"])

    async def check_empty(self, url: str, variant: str) -> None:
        held = await self.held(url)
        if held != (0, 0):
            raise RuntimeError(f"{variant}: the queue still holds (visible, in flight) {held}")

    async def delete(self, url: str) -> None:
        await self.client.delete_queue(QueueUrl=url)


# -- consumers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """What one run's consumer gets: the server's client options, its queue, its tally."""

    options: dict[str, str]
    queue: str  # the queue's name
    url: str
    messages: int
    requests: Requests = field(default_factory=Requests)
    tally: Tally = field(default_factory=Tally)


class RawLoop(LoopConsumer):
    """(a): RAW_LOOPS loops on one aiobotocore client, each ``ReceiveMessage(10)`` → ``await
    handler(message)`` for each → one ``DeleteMessageBatch`` of what it got, until the backlog
    is deleted."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup.tally, setup.messages)
        self.setup = setup
        self.client: Any = None
        self.context: Any = None
        self.deleted = 0

    async def prepare(self) -> None:
        self.client, self.context = await client_of(self.setup.options)
        self.setup.requests.install(self.client)

    async def handle(self, message: dict[str, Any]) -> None:
        """The handler under test: does nothing but count."""
        self.tally.handled += 1

    async def receiver(self) -> None:
        client, url = self.client, self.setup.url
        while self.deleted < self.total:
            reply = await client.receive_message(QueueUrl=url, MaxNumberOfMessages=BATCH,
                                                 WaitTimeSeconds=RAW_WAIT,
                                                 VisibilityTimeout=ACK_DEADLINE)
            messages = reply.get("Messages", [])
            if not messages:
                continue
            for message in messages:
                await self.handle(message)
            done = await client.delete_message_batch(QueueUrl=url, Entries=[
                {"Id": str(n), "ReceiptHandle": message["ReceiptHandle"]}
                for n, message in enumerate(messages)])
            if done.get("Failed"):
                raise RuntimeError(f"deletes refused: {done['Failed']}")
            self.deleted += len(messages)

    async def loop(self) -> None:
        await asyncio.gather(*(self.receiver() for _ in range(RAW_LOOPS)))

    async def close(self) -> None:
        if self.context is not None:
            await self.context.__aexit__(None, None, None)


class SqsSubscriber(SubscriberConsumer):
    """(c)/(d): our Subscriber on the SqsAdapter (its defaults), with default policies, without
    or with a RedisDedupStore; the adapter's own client is counted."""

    def __init__(self, setup: Setup, *, redis_url: str | None = None,
                 dedup_prefix: str = "") -> None:
        self.setup = setup
        options = setup.options
        self.adapter = SqsAdapter(endpoint_url=options["endpoint_url"],
                                  region_name=options["region_name"],
                                  aws_access_key_id=options["aws_access_key_id"],
                                  aws_secret_access_key=options["aws_secret_access_key"])
        self.dedup_prefix = dedup_prefix
        self.store = (None if redis_url is None
                      else RedisDedupStore(redis_url, prefix=dedup_prefix))
        self.redis: RoundTrips | None = None
        super().__init__(setup.tally, setup.messages, Subscriber(self.adapter, dedup=self.store),
                         SHUTDOWN_TIMEOUT)
        count_in(self.subscriber, setup.queue, setup.tally, batch=False)

    async def prepare(self) -> None:
        # the queue exists: this reads its settings (the subscription is the queue itself)
        await self.adapter.ensure_subscription(self.setup.queue, self.setup.queue,
                                               ack_deadline=ACK_DEADLINE)
        # the client the adapter makes on first use in this loop, made now to count its calls
        self.setup.requests.install(await self.adapter._client())
        if self.store is not None:
            await self.store.client.ping()
            self.redis = RoundTrips()
            self.redis.install(self.store.client)
            self.redis.name_scripts(self.store)

    async def release(self) -> None:
        await self.adapter.close()
        if self.store is not None:
            await self.store.close()

