"""The ``reliable-sub`` command end to end: the console script run as a subprocess against real
Redis, PostgreSQL and the Pub/Sub emulator, its output and exit codes checked."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from reliable_sub import Message
from reliable_sub.adapters.pubsub import PubSubAdapter
from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
from reliable_sub.middleware.dead_letter import dead_letter_attributes
from reliable_sub.outbox import Outbox
from reliable_sub.testing.services import emulator_host, postgres_url, redis_url

SCRIPT = Path(sys.executable).with_name("reliable-sub")
TIMEOUT = 60


def reliable_sub(*args: str, input: str | None = None,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "reliable_sub.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, input=input,
                          timeout=TIMEOUT, check=False,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def as_json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


class RedisWorld:
    """A prefix of its own on the shared Redis: topic ``orders`` with subscription ``billing``,
    and the dead-letter topic ``orders-dlq`` with the queue ``dlq-ops``."""

    def __init__(self) -> None:
        self.url = redis_url()
        self.prefix = f"cli-{uuid.uuid4().hex[:10]}"
        self.topic, self.sub = f"{self.prefix}-orders", f"{self.prefix}-billing"
        self.dlq_topic, self.dlq = f"{self.prefix}-orders-dlq", f"{self.prefix}-dlq-ops"
        self.adapter = RedisStreamsAdapter(self.url, consumer="test", key_prefix=self.prefix)
        self.adapter.ensure_subscription_sync(self.topic, self.sub, ack_deadline=30.0)
        self.adapter.ensure_subscription_sync(self.dlq_topic, self.dlq, ack_deadline=30.0)

    def args(self, *args: str) -> list[str]:
        return ["--redis-url", self.url, "--redis-prefix", self.prefix, *args]

    def dead_letter(self, data: bytes, message_id: str, **attributes: str) -> str:
        """A dead-letter copy, as the Subscriber writes one."""
        original = Message(id=message_id, data=data, attributes=attributes,
                           subscription=self.sub)
        return self.adapter.publish_sync(
            self.dlq_topic, data, dead_letter_attributes(original, 3, ValueError("no stock")))

    def tear_down(self) -> None:
        self.adapter.close_sync()
        client = redis.Redis.from_url(self.url)
        keys = list(client.scan_iter(f"*{self.prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def world() -> Iterator[RedisWorld]:
    world = RedisWorld()
    yield world
    world.tear_down()


async def test_a_dead_letter_queue_listed_shown_replayed_and_purged(world: RedisWorld) -> None:
    first = world.dead_letter(b"order-1", "1-0", **{"idempotency-key": "order-1"})
    second = world.dead_letter(b"\xff\xfe", "2-0", shop="a")

    listed = as_json(reliable_sub(*world.args("dlq", "list", world.dlq, "--json",
                                              "--wait", "0.2")))
    assert [letter["id"] for letter in listed] == [first, second]
    assert listed[0]["error_type"] == "builtins.ValueError"
    assert listed[0]["error_message"] == "no stock"
    assert listed[0]["handler_failures"] == 3
    assert listed[1]["data_base64"] == "//4=" and listed[1]["attributes"] == {"shop": "a"}
    table = reliable_sub(*world.args("dlq", "list", world.dlq, "--wait", "0.2"))
    assert table.returncode == 0 and "2 dead letters" in table.stdout and first in table.stdout

    peeked = as_json(reliable_sub(*world.args("dlq", "peek", world.dlq, "--json",
                                              "--wait", "0.2")))
    assert peeked == listed[:1], "the oldest, in full"
    assert [p["id"] for p in as_json(reliable_sub(*world.args(
        "dlq", "peek", world.dlq, "--limit", "5", "--json", "--wait", "0.2")))] == [
        first, second]
    narrow = reliable_sub(*world.args("dlq", "peek", world.dlq, "--wait", "0.2"),
                          env={"COLUMNS": "80"})
    assert narrow.returncode == 0 and f"dead letter {first}" in narrow.stdout
    assert "no stock" in narrow.stdout and "order-1" in narrow.stdout
    assert second not in narrow.stdout, "one by default"
    fits_80_columns(narrow.stdout)
    fits_80_columns(reliable_sub(*world.args("dlq", "list", world.dlq, "--wait", "0.2"),
                                 env={"COLUMNS": "80"}).stdout)

    shown = as_json(reliable_sub(*world.args("dlq", "show", world.dlq, first, "--json",
                                             "--wait", "0.2")))
    assert (shown["data"], shown["idempotency_key"]) == ("order-1", "order-1")
    unknown = reliable_sub(*world.args("dlq", "show", world.dlq, "9-9", "--wait", "0.2"))
    assert unknown.returncode == 4 and "9-9" in unknown.stderr

    replayed = as_json(reliable_sub(*world.args("dlq", "replay", world.dlq, second, "--json",
                                                "--wait", "0.2")))
    assert replayed == {"replayed": [second], "failed": {}, "missing": []}
    [back] = await world.adapter.receive(world.sub, 10, 1.0)
    assert back.message.data == b"\xff\xfe"
    assert back.message.attributes == {"shop": "a", "idempotency-key": "2-0",
                                       "replayed-from": second}, (
        "the publisher's attributes, and the original idempotency key")
    partly = reliable_sub(*world.args("dlq", "replay", world.dlq, "9-9", "--wait", "0.2"))
    assert partly.returncode == 1 and "not in the queue: 9-9" in partly.stderr

    declined = reliable_sub(*world.args("dlq", "purge", world.dlq, "--wait", "0.2"), input="n\n")
    assert declined.returncode == 5 and "Purge every dead letter" in declined.stderr
    assert "nothing done" in declined.stderr
    assert len(as_json(reliable_sub(*world.args("dlq", "list", world.dlq, "--json",
                                                "--wait", "0.2")))) == 1
    purged = as_json(reliable_sub(*world.args("dlq", "purge", world.dlq, "--yes", "--json",
                                              "--wait", "0.2")))
    assert purged == {"purged": 1, "missing": []}
    assert as_json(reliable_sub(*world.args("dlq", "list", world.dlq, "--json",
                                            "--wait", "0.2"))) == []


async def test_seek_snapshots_and_stats_on_redis(world: RedisWorld) -> None:
    for n in range(3):
        world.adapter.publish_sync(world.topic, f"order-{n}".encode())
    taken = await world.adapter.receive(world.sub, 10, 1.0)
    assert await world.adapter.ack(taken[:2]) == []  # one left in flight

    figures = as_json(reliable_sub(*world.args("stats", world.sub, "--json",
                                               "--dead-letter-subscription", world.dlq)))
    assert (figures["backlog"], figures["in_flight"]) == (1, 1)
    assert figures["ack_deadline_seconds"] == 30.0 and figures["dead_lettered_waiting"] == 0
    assert 0 <= figures["oldest_unacked_age_seconds"] < 60

    made = as_json(reliable_sub(*world.args("snapshot", "create", world.sub, "before",
                                            "--json")))
    assert (made["name"], made["subscription"]) == ("before", world.sub)
    taken_again = reliable_sub(*world.args("snapshot", "create", world.sub, "before"))
    assert taken_again.returncode == 1 and "already exists" in taken_again.stderr
    sought = as_json(reliable_sub(*world.args("seek", world.sub, "--to", "-1h", "--json")))
    assert sought["mode"] == "skip-processed" and sought["epoch"] is None
    again = await world.adapter.receive(world.sub, 10, 1.0)
    assert sorted(d.message.data for d in again) == [b"order-0", b"order-1", b"order-2"]
    await world.adapter.ack(again)

    assert reliable_sub(*world.args("seek", world.sub, "--snapshot", "before")).returncode == 0
    [unacked] = await world.adapter.receive(world.sub, 10, 1.0)
    assert unacked.message.data == b"order-2", "the snapshot's one unacked message"
    listed = as_json(reliable_sub(*world.args("snapshot", "list", world.sub, "--json")))
    assert [snap["name"] for snap in listed] == ["before"]
    assert reliable_sub(*world.args("snapshot", "delete", "before")).returncode == 0
    gone = reliable_sub(*world.args("snapshot", "delete", "before"))
    assert gone.returncode == 4 and "before" in gone.stderr


def test_a_seek_that_purges_asks_first_and_reprocess_needs_the_store(
    world: RedisWorld,
) -> None:
    world.adapter.publish_sync(world.topic, b"order-1")
    declined = reliable_sub(*world.args("seek", world.sub, "--to", "now"), input="n\n")
    assert declined.returncode == 5 and "count as acknowledged" in declined.stderr
    no_terminal = reliable_sub(*world.args("seek", world.sub, "--to", "now"), input="")
    assert no_terminal.returncode == 5, "no answer is no"
    needs_store = reliable_sub(*world.args("seek", world.sub, "--to", "-1h", "--mode",
                                           "reprocess"))
    assert needs_store.returncode == 2 and "--dedup-url" in needs_store.stderr
    reprocess = as_json(reliable_sub(*world.args(
        "--dedup-url", world.url, "--dedup-prefix", f"{world.prefix}:dedup",
        "seek", world.sub, "--to", "-1h", "--mode", "reprocess", "--json")))
    assert reprocess["epoch"] == 1
    bad_time = reliable_sub(*world.args("seek", world.sub, "--to", "yesterday"))
    assert bad_time.returncode == 2 and "is not a time" in bad_time.stderr


def test_exit_codes_for_unknown_names_unreachable_brokers_and_bad_usage(
    world: RedisWorld,
) -> None:
    unknown = reliable_sub(*world.args("stats", "no-such-subscription"))
    assert unknown.returncode == 4 and "no-such-subscription" in unknown.stderr

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    unreachable = reliable_sub("--redis-url", f"redis://127.0.0.1:{closed}/0",
                               "stats", world.sub)
    assert unreachable.returncode == 3 and "cannot reach" in unreachable.stderr

    no_broker = reliable_sub("stats", world.sub, env={"RELIABLE_SUB_REDIS_URL": ""})
    assert no_broker.returncode == 2 and "--redis-url" in no_broker.stderr
    from_env = reliable_sub("stats", world.sub, "--json", env={
        "RELIABLE_SUB_REDIS_URL": world.url, "RELIABLE_SUB_REDIS_PREFIX": world.prefix})
    assert as_json(from_env)["backlog"] == 0


def test_the_outbox_status_retry_and_purge(tmp_path: Path) -> None:
    url = postgres_url()
    box = Outbox(url, table=f"cli_outbox_{uuid.uuid4().hex[:10]}")
    box.create_schema_sync()
    t = box.table
    try:
        with box.sync_engine.begin() as connection:
            keys = [box.add(connection, "orders", f"order-{n}".encode()) for n in range(4)]
            connection.execute(t.update().where(t.c.key == keys[0])
                               .values(failed_at=time.time(), attempts=10))
            connection.execute(t.update().where(t.c.key == keys[1])
                               .values(published_at=time.time() - 3600))
        args = ["--database-url", url, "--outbox-table", t.name, "outbox"]

        status = as_json(reliable_sub(*args, "status", "--json"))
        assert (status["pending"], status["parked"]) == (2, 1)
        assert status["oldest_pending_age_seconds"] >= 0
        retried = reliable_sub(*args, "retry-failed")
        assert retried.returncode == 0 and "1 parked rows are pending again" in retried.stdout
        assert as_json(reliable_sub(*args, "status", "--json"))["pending"] == 3
        purged = reliable_sub(*args, "purge", "--older-than", "60", "--yes")
        assert purged.returncode == 0 and "deleted 1 published rows" in purged.stdout
        wrong_table = reliable_sub("--database-url", url, "--outbox-table", "no_such_table",
                                   "outbox", "status")
        assert wrong_table.returncode == 2 and "no_such_table" in wrong_table.stderr
    finally:
        with box.sync_engine.begin() as connection:
            box.metadata.drop_all(connection)
        box.close_sync()


def test_run_starts_a_subscriber_of_the_user_s_code_and_stops_on_sigterm(
    world: RedisWorld, tmp_path: Path,
) -> None:
    counter = f"{world.prefix}:handled"
    (tmp_path / "shipping_app.py").write_text(textwrap.dedent(f"""
        import redis
        from reliable_sub import Message, Subscriber
        from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

        effects = redis.Redis.from_url({world.url!r})
        sub = Subscriber(RedisStreamsAdapter({world.url!r}, key_prefix={world.prefix!r}))

        @sub.handler({world.sub!r})
        def ship(message: Message) -> None:
            effects.incr({counter!r})
    """))
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "reliable_sub.cli"]
    process = subprocess.Popen([*command, "run", "shipping_app:sub", "--log-level", "info"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    client = redis.Redis.from_url(world.url)
    try:
        world.adapter.publish_sync(world.topic, b"order-1")
        deadline = time.monotonic() + 30
        while client.get(counter) != b"1":
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "the message was not handled"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        client.close()
    assert process.returncode == 0, output
    assert "running shipping_app:sub" in output

    missing = reliable_sub("run", "shipping_app:nothing")
    assert missing.returncode == 2 and "cannot import" in missing.stderr


async def test_dead_letters_seek_and_snapshots_on_the_emulator() -> None:
    host = emulator_host()
    run = uuid.uuid4().hex[:8]
    project = "reliable-sub-cli"
    topic, sub, dlq_topic, dlq = (f"cli-{run}-orders", f"cli-{run}-billing",
                                  f"cli-{run}-dlq", f"cli-{run}-dlq-ops")
    adapter = PubSubAdapter(project)
    try:
        adapter.ensure_subscription_sync(topic, sub, retain_acked_messages=True)
        adapter.ensure_subscription_sync(dlq_topic, dlq)
        original = Message(id="42", data=b"order-1", attributes={}, subscription=sub)
        await adapter.publish(dlq_topic, b"order-1",
                              dead_letter_attributes(original, 2, KeyError("sku")))
        env = {"PUBSUB_EMULATOR_HOST": host, "RELIABLE_SUB_PUBSUB_PROJECT": project}

        [letter] = as_json(reliable_sub("dlq", "list", dlq, "--json", "--wait", "1", env=env))
        assert (letter["error_type"], letter["original_subscription"]) == (
            "builtins.KeyError", sub)
        replayed = as_json(reliable_sub("dlq", "replay", dlq, "--json", "--wait", "1",
                                        env=env))
        assert replayed["replayed"] == [letter["id"]]
        [back] = await adapter.receive(sub, 10, 5.0)
        assert back.message.attributes == {"idempotency-key": "42",
                                           "replayed-from": letter["id"]}
        await adapter.ack([back])

        assert reliable_sub("snapshot", "create", sub, f"snap-{run}", env=env).returncode == 0
        assert reliable_sub("seek", sub, "--to", "-1h", env=env).returncode == 0
        [again] = await adapter.receive(sub, 10, 5.0)
        assert again.message.data == b"order-1", "acked, retained, replayed"
        await adapter.ack([again])
        assert reliable_sub("seek", sub, "--snapshot", f"snap-{run}",
                            env=env).returncode == 0
        [listed] = as_json(reliable_sub("snapshot", "list", sub, "--json", env=env))
        # the emulator keeps no labels: the snapshot is found by its topic, and whose it is
        # goes unsaid (Pub/Sub itself keeps them)
        assert (listed["name"], listed["topic"], listed["subscription"]) == (
            f"snap-{run}", topic, None)
        assert reliable_sub("snapshot", "delete", f"snap-{run}", env=env).returncode == 0
        figures = as_json(reliable_sub("stats", sub, "--json", env=env))
        assert figures["backlog"] is None and figures["ack_deadline_seconds"] == 10.0
    finally:
        await adapter.close()
        adapter.close_sync()


def fits_80_columns(output: str) -> None:
    assert output.strip(), "something was printed"
    too_wide = [line for line in output.splitlines() if len(line) > 80]
    assert too_wide == [], f"{len(too_wide)} lines wider than 80 columns"


async def test_stats_and_top_show_one_row_per_subscription_in_80_columns(
        world: RedisWorld) -> None:
    """#28: several subscriptions, one row each (lag per subscription), a table that fits an
    80-column terminal; ``top`` is ``stats --watch``."""
    other = f"{world.prefix}-shipping-and-handling-for-the-european-warehouses"
    world.adapter.ensure_subscription_sync(world.topic, other, ack_deadline=30.0)
    for n in range(2):
        world.adapter.publish_sync(world.topic, b"order-%d" % n)
    await world.adapter.receive(other, 1, 1.0)  # one of other's in flight
    rows = as_json(reliable_sub(*world.args("stats", world.sub, other, "--json",
                                            "--dead-letter-subscription", world.dlq)))
    assert [(r["subscription"], r["backlog"], r["in_flight"], r["dead_lettered_waiting"])
            for r in rows] == [(world.sub, 2, 0, 0), (other, 2, 1, 0)]
    table = reliable_sub(*world.args("stats", world.sub, other, "--dead-letter-subscription",
                                     world.dlq), env={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    fits_80_columns(table.stdout)
    assert "oldest" in table.stdout and "in flight" in table.stdout
    assert "30.0 s" in table.stdout
    watched = reliable_sub(*world.args("top", world.sub, other, "--interval", "0.05",
                                       "--iterations", "2", "--json"))
    assert watched.returncode == 0, watched.stderr
    readings = [json.loads(line) for line in watched.stdout.splitlines()]
    assert [[r["subscription"] for r in reading] for reading in readings] == [
        [world.sub, other]] * 2
    fits_80_columns(reliable_sub(*world.args("top", world.sub, "--interval", "0.05",
                                             "--iterations", "1"),
                                 env={"COLUMNS": "80"}).stdout)
    nothing = reliable_sub(*world.args("stats"))
    assert nothing.returncode == 2 and "SUBSCRIPTION" in nothing.stderr


async def test_stats_watch_reads_again_every_interval(world: RedisWorld) -> None:
    """#28: ``stats --watch`` (here as JSON lines, three readings): the backlog as it goes."""
    world.adapter.publish_sync(world.topic, b"order-1")
    done = reliable_sub(*world.args("stats", world.sub, "--json", "--watch", "0.05",
                                    "--iterations", "3"))
    assert done.returncode == 0, done.stdout + done.stderr
    readings = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["subscription"], r["backlog"], r["in_flight"]) for r in readings] == [
        (world.sub, 1, 0)] * 3
    table = reliable_sub(*world.args("stats", world.sub, "--watch", "0.05", "--iterations", "2"))
    assert table.returncode == 0, table.stderr
    assert table.stdout.count("in flight") == 2, "not a terminal: one table per reading"
    assert "dead letters" not in table.stdout
    alone = reliable_sub(*world.args("stats", world.sub, "--iterations", "2"))
    assert alone.returncode == 2 and "--watch" in alone.stderr
    for bad in ("0", "-1", "nan", "inf"):
        refused = reliable_sub(*world.args("stats", world.sub, "--watch", bad))
        assert refused.returncode == 2 and "not a duration" in refused.stderr, bad


async def test_stats_on_nats_shows_each_subscriptions_lag(nats_server: Any) -> None:
    """#28: ``stats`` on every adapter: NATS JetStream's consumer figures (num_pending and
    num_ack_pending) per subscription."""
    from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter

    prefix = f"cli{uuid.uuid4().hex[:8]}"
    adapter = NatsJetStreamAdapter(nats_server.url, prefix=prefix)
    topic, billing, shipping = f"{prefix}-orders", f"{prefix}-billing", f"{prefix}-shipping"
    try:
        for subscription in (billing, shipping):
            await adapter.ensure_subscription(topic, subscription, ack_deadline=30)
        for n in range(3):
            await adapter.publish(topic, b"order-%d" % n)
        await adapter.receive(shipping, 1, 2.0)
        rows = as_json(reliable_sub("--nats-url", nats_server.url, "--nats-prefix", prefix,
                                    "stats", billing, shipping, "--json"))
    finally:
        await adapter.close()
    assert [(r["subscription"], r["backlog"], r["in_flight"], r["ack_deadline_seconds"])
            for r in rows] == [(billing, 3, 0, 30.0), (shipping, 3, 1, 30.0)]


async def test_the_cli_reaches_rabbitmq() -> None:
    """#29: ``--amqp-url``: stats (AMQP tells no backlog: unknown) and the dead-letter tools."""
    from reliable_sub.adapters.rabbitmq import RabbitMQAdapter
    from reliable_sub.testing.services import rabbitmq_url

    url = rabbitmq_url()
    prefix = f"cli-{uuid.uuid4().hex[:8]}"
    adapter = RabbitMQAdapter(url, prefix=prefix)
    topic, sub = f"{prefix}-orders", f"{prefix}-billing"
    dlq_topic, dlq = f"{prefix}-orders-dlq", f"{prefix}-dlq-ops"
    await adapter.ensure_subscription(topic, sub, ack_deadline=30.0)
    await adapter.ensure_subscription(dlq_topic, dlq, ack_deadline=30.0)
    original = Message(id="m-1", data=b"order-1", attributes={}, subscription=sub)
    await adapter.publish(dlq_topic, b"order-1",
                          dead_letter_attributes(original, 3, ValueError("no stock")))
    args = ("--amqp-url", url, "--amqp-prefix", prefix)
    try:
        figures = as_json(reliable_sub(*args, "stats", sub, "--json"))
        assert (figures["backlog"], figures["ack_deadline_seconds"]) == (None, 30.0)
        [letter] = as_json(reliable_sub(*args, "dlq", "peek", dlq, "--json", "--wait", "0.5"))
        assert (letter["data"], letter["error_message"]) == ("order-1", "no stock")
        missing = reliable_sub(*args, "stats", f"{prefix}-nothing")
        assert missing.returncode == 4, missing.stderr
    finally:
        import aio_pika

        connection = await aio_pika.connect(url)
        channel = await connection.channel()
        for name in (sub, dlq, f"{prefix}.settings.{sub}", f"{prefix}.settings.{dlq}"):
            await channel.queue_delete(name)
        for name in (topic, dlq_topic):
            await channel.exchange_delete(name)
        await connection.close()
        await adapter.close()


async def test_the_cli_reaches_kafka(kafka_broker: Any) -> None:
    """#45: ``--kafka-bootstrap``: exact backlogs (another process's deliveries out are unknown
    to the command), the dead-letter tools, a missing subscription, an unreachable cluster."""
    pytest.importorskip("confluent_kafka", reason='the Kafka tests need "reliable-sub[kafka]"')
    from reliable_sub.adapters.kafka import KafkaAdapter
    from reliable_sub.testing.cleanup import delete_kafka_names

    prefix = f"cli-{uuid.uuid4().hex[:8]}"
    adapter = KafkaAdapter(kafka_broker.bootstrap, prefix=prefix, partitions=1)
    topic, billing, shipping = f"{prefix}-orders", f"{prefix}-billing", f"{prefix}-shipping"
    dlq_topic, dlq = f"{prefix}-orders-dlq", f"{prefix}-dlq-ops"
    args = ("--kafka-bootstrap", kafka_broker.bootstrap, "--kafka-prefix", prefix)
    try:
        for subscription in (billing, shipping):
            await adapter.ensure_subscription(topic, subscription, ack_deadline=30)
        await adapter.ensure_subscription(dlq_topic, dlq, ack_deadline=30)
        for n in range(3):
            await adapter.publish(topic, b"order-%d" % n)
        [taken] = await adapter.receive(shipping, 1, 10.0)
        await adapter.ack([taken])
        original = Message(id="m-1", data=b"order-1", attributes={}, subscription=billing)
        await adapter.publish(dlq_topic, b"order-1",
                              dead_letter_attributes(original, 3, ValueError("no stock")))
        deadline = time.monotonic() + TIMEOUT
        while True:  # the consumer commits its ack a moment later
            rows = as_json(reliable_sub(*args, "stats", billing, shipping, "--json"))
            if rows[1]["backlog"] == 2 or time.monotonic() > deadline:
                break
        assert [(r["subscription"], r["backlog"], r["in_flight"], r["ack_deadline_seconds"])
                for r in rows] == [(billing, 3, None, 30.0), (shipping, 2, None, 30.0)]
        [letter] = as_json(reliable_sub(*args, "dlq", "peek", dlq, "--json", "--wait", "1"))
        assert (letter["data"], letter["error_message"]) == ("order-1", "no stock")
        missing = reliable_sub(*args, "stats", f"{prefix}-nothing")
        assert missing.returncode == 4, missing.stderr
    finally:
        await adapter.close()
        await delete_kafka_names(kafka_broker.bootstrap, [
            topic, dlq_topic, billing, shipping, dlq, f"{prefix}-subscriptions"])
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    started = time.monotonic()
    unreachable = reliable_sub("--connect-timeout", "1", "--kafka-bootstrap",
                               f"127.0.0.1:{port}", "stats", billing)
    assert unreachable.returncode == 3, unreachable.stderr
    assert time.monotonic() - started < 20


async def test_the_cli_reaches_sqs(sqs_server: Any) -> None:
    """#49: ``--sqs-endpoint`` with ``--sqs-queue-prefix`` (region and credentials from the
    usual AWS settings): stats show SQS's estimates as such, and a missing subscription says
    so."""
    from reliable_sub.adapters.sqs import SqsAdapter

    prefix = f"cli-{uuid.uuid4().hex[:8]}-"
    adapter = SqsAdapter(**sqs_server.client_options, queue_prefix=prefix)
    env = {k: v for k, v in sqs_server.environment.items() if k != "AWS_ENDPOINT_URL_SQS"}
    args = ("--sqs-endpoint", sqs_server.endpoint_url, "--sqs-queue-prefix", prefix)
    try:
        await adapter.ensure_subscription("orders", "billing", ack_deadline=30)
        for n in range(3):
            await adapter.publish("orders", b"order-%d" % n)
        [taken] = await adapter.receive("billing", 1, 2.0)
        figures = as_json(reliable_sub(*args, "stats", "billing", "--json", env=env))
        assert (figures["backlog"], figures["in_flight"], figures["approximate"],
                figures["ack_deadline_seconds"]) == (3, 1, True, 30.0)
        table = reliable_sub(*args, "stats", "billing", env=env)
        assert table.returncode == 0 and "~3" in table.stdout, table.stdout + table.stderr
        missing = reliable_sub(*args, "stats", "nothing", env=env)
        assert missing.returncode == 4, missing.stderr
        await adapter.ack([taken])
    finally:
        await adapter.close()
        from reliable_sub.testing.cleanup import delete_sqs_queues

        await delete_sqs_queues(sqs_server.client_options, prefix)
