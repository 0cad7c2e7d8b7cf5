"""The NATS JetStream adapter beyond the shared suite: JetStream's own dedup window, stale acks,
what other publishers send, bad input, and a consumer process SIGKILLed mid-flight.

The conformance suite (tests/test_conformance.py) runs with publish dedup off; these tests use
the adapter's defaults. All run on the session's private ``nats-server -js``
(tests/conftest.py); the takeover tests also use the shared Redis for the dedup store and for
counting effects outside the consumers.
"""

from __future__ import annotations

import asyncio
import json
import signal
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from reliable_sub import (
    ConfigurationError,
    DeadLetterPolicy,
    InvalidMessageError,
    LeasePolicy,
    Message,
    Outcome,
    Subscriber,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from reliable_sub.testing.harness import delete_nats_streams
from reliable_sub.testing.services import redis_url
from tests.nats_processes import NatsServer
from tests.redis_processes import Child, free_port, poll_until

nats = pytest.importorskip("nats", reason='the NATS tests need "reliable-sub[nats]"')
from reliable_sub.adapters._nats_connection import CONNECT_TIMEOUT  # noqa: E402
from reliable_sub.adapters.nats_jetstream import (  # noqa: E402
    ATTRIBUTES_HEADER,
    CONSUMER_CHECK_INTERVAL,
    NatsJetStreamAdapter,
)

ACK_DEADLINE = 1.0
# Bound on every wait for something that should take about one ack deadline.
WITHIN = 10.0


@pytest.fixture
async def adapter(nats_server: NatsServer) -> AsyncIterator[NatsJetStreamAdapter]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    made = NatsJetStreamAdapter(nats_server.url, prefix=prefix)
    try:
        yield made
    finally:
        await made.close()
        await delete_nats_streams(nats_server.url, prefix)


def prefix_of(adapter: NatsJetStreamAdapter) -> str:
    """The adapter's (unique) prefix, as its dedup namespaces show it."""
    return adapter.dedup_namespace("x").split(":")[1]


def names(adapter: NatsJetStreamAdapter) -> tuple[str, str]:
    """A topic and a subscription named after the adapter's prefix."""
    prefix = prefix_of(adapter)
    return f"{prefix}-orders", f"{prefix}-billing"


async def with_dead_letter_topic(adapter: NatsJetStreamAdapter) -> tuple[str, str, str, str]:
    """A topic and subscription, and a dead-letter topic with a subscription of its own."""
    topic, sub = names(adapter)
    dlq_topic, dlq_sub = f"{topic}-dlq", f"{sub}-dlq"
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    await adapter.ensure_subscription(dlq_topic, dlq_sub, ack_deadline=ACK_DEADLINE)
    return topic, sub, dlq_topic, dlq_sub


async def stream_messages(adapter: NatsJetStreamAdapter, topic: str) -> int:
    js = await adapter._js()
    info = await js.stream_info(topic.replace(".", "_"))
    return int(info.state.messages)


# -- JetStream's dedup window ---------------------------------------------------------------------


async def test_a_producer_retry_inside_the_window_never_reaches_a_consumer(
    adapter: NatsJetStreamAdapter,
) -> None:
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    first = await adapter.publish(topic, b"charge 10 EUR", {"idempotency-key": "payment-42"})
    retries = [await adapter.publish(topic, b"charge 10 EUR", {"idempotency-key": "payment-42"})
               for _ in range(2)]
    other = await adapter.publish(topic, b"charge 5 EUR", {"idempotency-key": "payment-43"})

    assert retries == [first, first], "a retry gets the original's stream sequence"
    assert other != first
    assert await stream_messages(adapter, topic) == 2
    assert adapter.stats["duplicate_publishes"] == 2
    got = await adapter.receive(sub, 10, timeout=1.0)
    assert sorted(d.message.attributes["idempotency-key"] for d in got) == [
        "payment-42", "payment-43"]
    assert await adapter.ack(got) == []


HOSTILE_KEYS = {
    "newline": "order\n42", "nul": "order\x0042", "lone surrogate": "order-\udc80",
    "nfc": "caf\u00e9", "nfd": "cafe\u0301", "10 KB": "k" * 10_240, "10 KB, last differs":
    "k" * 10_239 + "j", "colon and star": "order:*:42", "emoji": "order-\U0001f4b8",
}


async def test_hostile_idempotency_keys_deduplicate_at_the_stream_and_are_never_confused(
    adapter: NatsJetStreamAdapter,
) -> None:
    """Keys a header cannot carry as they are go as their SHA-256: each publish succeeds, its
    retry is dropped, and no two keys are taken for one (NFC and NFD stay apart)."""
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    first = {name: await adapter.publish(topic, name.encode(), {"idempotency-key": key})
             for name, key in HOSTILE_KEYS.items()}
    again = {name: await adapter.publish(topic, name.encode(), {"idempotency-key": key})
             for name, key in HOSTILE_KEYS.items()}
    assert again == first
    assert len(set(first.values())) == len(HOSTILE_KEYS)
    got: list = []
    while len(got) < len(HOSTILE_KEYS):
        batch = await adapter.receive(sub, 100, timeout=1.0)
        assert batch, "messages went missing"
        got.extend(batch)
    assert {d.message.data.decode(): d.message.attributes["idempotency-key"] for d in got} == (
        HOSTILE_KEYS)
    await adapter.ack(got)


async def test_an_ordering_key_of_any_text_arrives_unchanged(
    adapter: NatsJetStreamAdapter,
) -> None:
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    keys = ["line\nbreak", "caf\u00e9", "order-\udc80", " spaced "]
    for key in keys:
        await adapter.publish(topic, b"x", ordering_key=key)
    got = await adapter.receive(sub, 10, timeout=1.0)
    assert sorted(d.message.ordering_key or "" for d in got) == sorted(keys)
    await adapter.ack(got)


async def test_a_replay_of_a_dead_letter_inside_the_window_is_not_taken_for_a_retry(
    adapter: NatsJetStreamAdapter,
) -> None:
    """The dead-letter tools mark a replay with ``replayed-from``; two replays of one copy are
    one publish (a retried replay), replays of different copies are two."""
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    original = await adapter.publish(topic, b"ship", {"idempotency-key": "order-1"})
    replay = {"idempotency-key": "order-1", "replayed-from": "7"}
    replayed = await adapter.publish(topic, b"ship", replay)
    retried_replay = await adapter.publish(topic, b"ship", replay)
    second_replay = await adapter.publish(topic, b"ship", {**replay, "replayed-from": "9"})

    assert len({original, replayed, second_replay}) == 3
    assert retried_replay == replayed
    assert await stream_messages(adapter, topic) == 3


async def test_a_dead_letter_replayed_within_the_window_is_handled_again(
    adapter: NatsJetStreamAdapter,
) -> None:
    from reliable_sub.dead_letters import DeadLetterQueue

    topic, sub, dlq_topic, dlq_sub = await with_dead_letter_topic(adapter)
    fixed = threading.Event()
    outcomes: list[Outcome] = []
    runs: list[str] = []
    subscriber = Subscriber(adapter, dead_letter=DeadLetterPolicy(dlq_topic,
                                                                  max_delivery_attempts=1),
                            on_outcome=lambda m, o: outcomes.append(o), receive_timeout=0.2)

    @subscriber.handler(sub)
    async def ship(message: Message) -> None:
        runs.append(message.idempotency_key)
        if not fixed.is_set():
            raise ValueError("the warehouse is down")

    task = asyncio.create_task(subscriber.serve())
    try:
        await adapter.publish(topic, b"ship order-1", {"idempotency-key": "order-1"})
        await poll_until(lambda: Outcome.DEAD_LETTERED in outcomes, "the dead letter", WITHIN)
        fixed.set()
        report = await DeadLetterQueue(adapter, dlq_sub, wait=0.5).replay()
        assert len(report.replayed) == 1, report
        await poll_until(lambda: Outcome.ACKED in outcomes, "the replay handled", WITHIN)
    finally:
        await subscriber.shutdown(timeout=5)
        await task
    assert runs == ["order-1", "order-1"], "the replay ran, within the 2 min window"


# -- leases and stale acks ------------------------------------------------------------------------


async def test_a_stale_ack_is_refused_and_never_settles_the_peers_delivery(
    adapter: NatsJetStreamAdapter, nats_server: NatsServer,
) -> None:
    """The server matches acks by stream sequence: had the stale ack been sent, it would have
    acked the peer's delivery and the message would not come back."""
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    peer = NatsJetStreamAdapter(nats_server.url, prefix=prefix_of(adapter))
    try:
        await adapter.publish(topic, b"once")
        [late] = await adapter.receive(sub, 10, timeout=1.0)
        [taken] = await peer.receive(sub, 10, timeout=3 * ACK_DEADLINE)  # after the deadline
        assert taken.message.id == late.message.id and taken.message.delivery_attempt == 2

        assert await adapter.ack([late]) == [late], "refused: its lease ran out"
        assert await adapter.extend([late], ACK_DEADLINE) == [late]
        await adapter.nack([late], 0.0)  # not sent either
        assert adapter.stats["refused_as_stale"] == 3

        [again] = await peer.receive(sub, 10, timeout=3 * ACK_DEADLINE)  # peer never acked
        assert (again.message.id, again.message.delivery_attempt) == (late.message.id, 3)
        assert await peer.ack([again]) == []
        assert await peer.receive(sub, 10, timeout=2 * ACK_DEADLINE) == []
    finally:
        await peer.close()


async def test_a_batch_given_back_comes_back_whole_at_once(
    adapter: NatsJetStreamAdapter,
) -> None:
    """nats-server 2.9 answered a plain -NAK of a batch, now and then, by holding one message
    back until AckWait and sending another twice (7 of 30 batches of 3). The adapter's naks
    carry a delay of at least 1 ms, which it handles right."""
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=10.0)
    for trial in range(30):
        ids = {await adapter.publish(topic, f"{trial}-{n}".encode()) for n in range(3)}
        taken = await receive_all(adapter, sub, 3)
        assert await adapter.receive(sub, 100, timeout=0.1) == []  # a fetch that waited in vain
        await adapter.nack(taken, 0.0)
        again = await receive_all(adapter, sub, 3)
        assert sorted((d.message.id, d.message.delivery_attempt) for d in again) == sorted(
            (i, 2) for i in ids), f"trial {trial}"
        assert await adapter.ack(again) == []


async def receive_all(adapter: NatsJetStreamAdapter, sub: str, count: int) -> list:
    """``count`` deliveries, received within 2 s (far less than the 10 s AckWait)."""
    got: list = []
    give_up = time.monotonic() + 2.0
    while len(got) < count and time.monotonic() < give_up:
        got.extend(await adapter.receive(sub, 100, timeout=0.2))
    assert len(got) == count, [(d.message.id, d.message.delivery_attempt) for d in got]
    return got


async def test_in_progress_acks_hold_a_message_past_its_deadline(
    adapter: NatsJetStreamAdapter, nats_server: NatsServer,
) -> None:
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    peer = NatsJetStreamAdapter(nats_server.url, prefix=prefix_of(adapter))
    try:
        await adapter.publish(topic, b"long")
        [held] = await adapter.receive(sub, 10, timeout=1.0)
        until = time.monotonic() + 3 * ACK_DEADLINE
        while time.monotonic() < until:
            assert await adapter.extend([held], 10 * ACK_DEADLINE) == []
            assert await peer.receive(sub, 10, timeout=0.5 * ACK_DEADLINE) == []
        assert await adapter.ack([held]) == []
        assert await peer.receive(sub, 10, timeout=2 * ACK_DEADLINE) == []
    finally:
        await peer.close()


async def test_a_deleted_consumer_or_stream_is_created_again_and_nothing_stored_is_lost(
    adapter: NatsJetStreamAdapter,
) -> None:
    """A fetch from a missing consumer only comes back empty: without a check, the consumer
    would wait for ever. Its unacked messages are delivered from the recreated consumer."""
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    before = await adapter.publish(topic, b"before")
    js = await adapter._js()
    assert await adapter.receive(sub, 10, timeout=0.1) != []  # taken, never acked
    await js.delete_consumer(topic, sub)

    got = await receive_within(adapter, sub, 2 * CONSUMER_CHECK_INTERVAL)
    assert [d.message.id for d in got] == [before]
    assert await adapter.ack(got) == []

    await js.delete_stream(topic)  # the server lost its store, say
    async def stream_back() -> bool:
        assert await adapter.receive(sub, 10, timeout=0.1) == []
        return await adapter.topic_exists(topic)

    await poll_until(stream_back, "the stream made again by a receiving consumer", WITHIN)
    after = await adapter.publish(topic, b"after")
    got = await receive_within(adapter, sub, 2 * CONSUMER_CHECK_INTERVAL)
    assert [d.message.id for d in got] == [after]
    await adapter.ack(got)


async def receive_within(adapter: NatsJetStreamAdapter, sub: str, seconds: float) -> list:
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        got = await adapter.receive(sub, 10, timeout=0.2)
        if got:
            return got
    raise AssertionError(f"nothing received from {sub!r} within {seconds}s")


# -- what other publishers send, and bad input ----------------------------------------------------


async def test_plain_headers_are_attributes_and_a_broken_attributes_header_is_malformed(
    adapter: NatsJetStreamAdapter,
) -> None:
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    js = await adapter._js()
    await js.publish(topic, b"from a Go service", headers={"traceparent": "00-abc-def-01",
                                                          "Nats-Msg-Id": "go-1"})
    await js.publish(topic, b"broken", headers={ATTRIBUTES_HEADER: "{not json"})
    await js.publish(topic, b"not strings", headers={ATTRIBUTES_HEADER: '{"n": 1}'})

    got = await adapter.receive(sub, 10, timeout=1.0)
    by_data = {d.message.data: d for d in got}
    assert by_data[b"from a Go service"].message.attributes == {"traceparent": "00-abc-def-01",
                                                                "nats-msg-id": "go-1"}
    assert by_data[b"from a Go service"].malformed is None
    assert "not JSON" in (by_data[b"broken"].malformed or "")
    assert "'n' is a int" in (by_data[b"not strings"].malformed or "")
    await adapter.ack(got)


async def test_a_foreign_nats_msg_id_is_an_attribute_through_a_dead_letter_and_its_replay(
    adapter: NatsJetStreamAdapter,
) -> None:
    """#44 item 12 on NATS: another publisher's ``Nats-Msg-Id`` was dropped with the other
    ``Nats-`` headers; it is the attribute ``nats-msg-id`` now (never sent as the header again:
    a replay inside the duplicate window would be dropped). FastStream's own headers
    (``correlation_id``, ``reply_to``) were plain headers, so attributes, already."""
    from reliable_sub.dead_letters import DeadLetterQueue

    topic, sub, dlq_topic, dlq_sub = await with_dead_letter_topic(adapter)
    js = await adapter._js()
    foreign = {"Nats-Msg-Id": "go-7", "correlation_id": "corr-7", "reply_to": "replies"}
    await js.publish(topic, b"from a Go service", headers=foreign)
    await adapter.publish(topic, b"ours", {"idempotency-key": "k-1"})
    expected = {"nats-msg-id": "go-7", "correlation_id": "corr-7", "reply_to": "replies"}
    seen: list[Message] = []
    outcomes: list[Outcome] = []
    subscriber = Subscriber(adapter, dead_letter=DeadLetterPolicy(dlq_topic, 1),
                            on_outcome=lambda m, o: outcomes.append(o), receive_timeout=0.2)

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        seen.append(message)
        if message.data != b"ours":
            raise ValueError("refused")

    async with subscriber:
        await poll_until(lambda: len(outcomes) == 2, "both settled", WITHIN)
    by_data = {m.data: m.attributes for m in seen}
    assert by_data == {b"from a Go service": expected, b"ours": {"idempotency-key": "k-1"}}
    queue = DeadLetterQueue(adapter, dlq_sub, wait=0.5)
    [letter] = await queue.peek()
    assert letter.attributes == expected
    assert (await queue.replay([letter.id])).replayed == [letter.id]
    [again] = await adapter.receive(sub, 10, timeout=WITHIN)
    assert {k: again.message.attributes.get(k) for k in expected} == expected
    await adapter.ack([again])


async def test_a_malformed_message_is_dead_lettered_and_the_consumer_goes_on(
    adapter: NatsJetStreamAdapter,
) -> None:
    topic, sub, dlq_topic, dlq_sub = await with_dead_letter_topic(adapter)
    outcomes: list[tuple[bytes, Outcome]] = []
    subscriber = Subscriber(adapter, dead_letter=DeadLetterPolicy(dlq_topic),
                            on_outcome=lambda m, o: outcomes.append((m.data, o)),
                            receive_timeout=0.2)
    handled: list[bytes] = []

    @subscriber.handler(sub)
    async def handle(message: Message) -> None:
        handled.append(message.data)

    js = await adapter._js()
    await js.publish(topic, b"poison", headers={ATTRIBUTES_HEADER: "[1, 2]"})
    await adapter.publish(topic, b"fine")
    async with subscriber:
        await poll_until(lambda: len(outcomes) == 2, "both settled", WITHIN)
    assert sorted(outcomes) == [(b"fine", Outcome.ACKED), (b"poison", Outcome.DEAD_LETTERED)]
    assert handled == [b"fine"]
    [letter] = await adapter.receive(dlq_sub, 10, timeout=1.0)
    assert letter.message.data == b"poison"
    assert "a JSON list, not an object" in letter.message.attributes["error-message"]


async def test_a_message_over_max_payload_by_its_headers_is_refused_before_sending(
    adapter: NatsJetStreamAdapter,
) -> None:
    """The server closes a connection that sends more than its max_payload (data and headers
    together): every call in flight on it would fail. The adapter refuses such a message."""
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    client = await adapter._connections.get().nats()
    data = b"x" * (client.max_payload - 100)
    with pytest.raises(InvalidMessageError, match="max_payload"):
        await adapter.publish(topic, data, {"note": "y" * 200})
    assert not client.is_closed
    message_id = await adapter.publish(topic, data)
    [got] = await adapter.receive(sub, 10, timeout=1.0)
    assert (got.message.id, len(got.message.data)) == (message_id, len(data))
    await adapter.ack([got])


async def test_a_connection_closed_for_good_is_replaced_on_the_next_call(
    adapter: NatsJetStreamAdapter,
) -> None:
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    await (await adapter._connections.get().nats()).close()  # as the server closing it would
    await adapter.publish(topic, b"after")
    [got] = await adapter.receive(sub, 10, timeout=1.0)
    assert got.message.data == b"after" and await adapter.ack([got]) == []


@pytest.mark.parametrize("topic", ["orders.*", "orders >", "", "a..b", "orders/eu"])
async def test_a_topic_that_is_no_plain_subject_is_refused_by_name(
    adapter: NatsJetStreamAdapter, topic: str,
) -> None:
    with pytest.raises(ConfigurationError, match="NATS topic"):
        await adapter.ensure_subscription(topic, "billing")


async def test_bad_settings_are_refused_with_what_is_wrong(
    adapter: NatsJetStreamAdapter,
) -> None:
    topic, sub = names(adapter)
    with pytest.raises(ConfigurationError, match="unknown options"):
        await adapter.ensure_subscription(topic, sub, ordering=True)
    with pytest.raises(ConfigurationError, match="ack_deadline"):
        await adapter.ensure_subscription(topic, sub, ack_deadline=0)
    with pytest.raises(ConfigurationError, match="max_deliver"):
        await adapter.ensure_subscription(topic, sub, max_deliver=0)
    with pytest.raises(ConfigurationError, match="subscription name"):
        await adapter.ensure_subscription(topic, "bill.ing")
    with pytest.raises(ConfigurationError, match="stream_options"):
        NatsJetStreamAdapter(stream_options={"subjects": ["x"]})
    with pytest.raises(ConfigurationError, match="max_agee"):
        NatsJetStreamAdapter(stream_options={"max_agee": 3600})


async def test_a_subscription_name_belongs_to_one_topic(adapter: NatsJetStreamAdapter) -> None:
    topic, sub = names(adapter)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)
    await adapter.ensure_subscription(topic, sub, ack_deadline=ACK_DEADLINE)  # idempotent
    with pytest.raises(ConfigurationError) as refused:
        await adapter.ensure_subscription(f"{topic}.eu", sub)
    assert topic in str(refused.value) and f"{topic}.eu" in str(refused.value)
    assert await adapter.subscription_topic(sub) == topic
    assert await adapter.subscription_ack_deadline(sub) == ACK_DEADLINE


async def test_unknown_topics_and_subscriptions_are_named(adapter: NatsJetStreamAdapter) -> None:
    topic, sub = names(adapter)
    with pytest.raises(UnknownTopicError, match=topic):
        await adapter.publish(topic, b"nowhere")
    assert not await adapter.topic_exists(topic)
    with pytest.raises(UnknownSubscriptionError, match=sub):
        await adapter.receive(sub, 1, timeout=0.1)
    await adapter.ensure_topic(f"{topic}.created")
    assert await adapter.topic_exists(f"{topic}.created")
    with pytest.raises(ConfigurationError, match="does not capture"):
        await adapter.ensure_topic(f"{topic}_created")  # the same stream name


async def test_an_unreachable_server_fails_within_the_connect_timeout_naming_it() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    adapter = NatsJetStreamAdapter(url)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=url):
        await adapter.ensure_subscription("orders", "billing")
    assert time.monotonic() - started < CONNECT_TIMEOUT + 2.0
    await adapter.close()


@pytest.mark.parametrize(("url", "what"), [
    ("redis://127.0.0.1:6379", "scheme 'redis://'"),
    ("http://user:secret@127.0.0.1:4222", "scheme 'http://'"),
    ("nats://127.0.0.1:4222,redis://127.0.0.1:6379", "scheme 'redis://'"),
    ("nats://127.0.0.1:4222,,nats://127.0.0.1:4223", "an empty server"),
    ("", "needs a URL"),
])
def test_a_url_it_cannot_serve_fails_at_once_naming_the_scheme_and_the_accepted_ones(
    url: str, what: str,
) -> None:
    """nats-py would read redis://host as a server named 'redis' and fail later, at the first
    call, as an unreachable server."""
    with pytest.raises(ConfigurationError) as refused:
        NatsJetStreamAdapter(url)
    message = str(refused.value)
    assert what in message
    assert all(scheme in message for scheme in ("nats://", "tls://", "ws://", "wss://"))
    assert "secret" not in message, "a password is never shown"
    with pytest.raises(ConfigurationError, match="mixes WebSocket"):
        NatsJetStreamAdapter("nats://127.0.0.1:4222,ws://127.0.0.1:8080")


async def test_several_comma_separated_servers_are_a_cluster(nats_server: NatsServer) -> None:
    """The documented form for a cluster, which nats-py refused ("invalid connect url option")
    as one string: the first server here listens nowhere, the second is the real one."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    url = f"nats://127.0.0.1:{free_port()}, {nats_server.url}, 127.0.0.1:{nats_server.port}"
    adapter = NatsJetStreamAdapter(url, prefix=prefix)
    try:
        await adapter.ensure_subscription(f"{prefix}-orders", f"{prefix}-billing")
        assert await adapter.publish(f"{prefix}-orders", b"x") == "1"
    finally:
        await adapter.close()
        await delete_nats_streams(nats_server.url, prefix)


def test_the_blocking_twins_work_from_threads_without_a_loop(nats_server: NatsServer) -> None:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    adapter = NatsJetStreamAdapter(nats_server.url, prefix=prefix)
    topic, sub = f"{prefix}-orders", f"{prefix}-billing"
    try:
        adapter.ensure_subscription_sync(topic, sub, ack_deadline=ACK_DEADLINE)
        ids: list[str] = []
        threads = [threading.Thread(target=lambda n=n: ids.append(
            adapter.publish_sync(topic, f"m{n}".encode(), {"n": str(n)}))) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WITHIN)

        async def receive_all() -> list[str]:
            got = await adapter.receive(sub, 10, timeout=1.0)
            await adapter.ack(got)
            await adapter.close()
            return sorted(d.message.id for d in got)

        assert asyncio.run(receive_all()) == sorted(ids) and len(ids) == 4
    finally:
        adapter.close_sync()
        asyncio.run(delete_nats_streams(nats_server.url, prefix))


# -- a consumer process SIGKILLed mid-flight ------------------------------------------------------

LEASE = LeasePolicy(min_extension=0.5, max_extension=ACK_DEADLINE)

# The consumer that gets killed. argv[1]: its settings as JSON. It prints
#   STARTED <id> <attempt>  when its handler starts (mode "mid-handler": then blocks forever);
#   ACKING <ids>            when the Subscriber acks (mode "after-effect": then blocks forever,
#                           after the dedup completion was written and the effect made).
CHILD = textwrap.dedent(
    """
    import asyncio, json, sys, threading

    import redis

    from reliable_sub import LeasePolicy, Subscriber
    from reliable_sub.adapters.nats_jetstream import NatsJetStreamAdapter
    from reliable_sub.dedup import RedisDedupStore

    cfg = json.loads(sys.argv[1])
    effects = redis.Redis.from_url(cfg["redis"])


    class AckNeverReturns(NatsJetStreamAdapter):
        async def ack(self, deliveries):
            print("ACKING", " ".join(d.message.id for d in deliveries), flush=True)
            await asyncio.Event().wait()  # never set: the kill lands here, before the ack


    async def main():
        kind = AckNeverReturns if cfg["mode"] == "after-effect" else NatsJetStreamAdapter
        adapter = kind(cfg["nats"], prefix=cfg["prefix"])
        store = RedisDedupStore(cfg["redis"], prefix=cfg["dedup_prefix"], owner="doomed")
        sub = Subscriber(adapter, dedup=store, lease=LeasePolicy(
            min_extension=cfg["min_extension"], max_extension=cfg["max_extension"]))

        @sub.handler(cfg["subscription"])
        def handle(message):
            if cfg["mode"] == "mid-handler":
                print("STARTED", message.id, message.delivery_attempt, flush=True)
                threading.Event().wait()  # never set: the kill lands here
            effects.rpush(cfg["effects"], f"{message.id} doomed")
            return {"effect": message.id}

        await sub.serve()


    asyncio.run(main())
    """
)


@dataclass
class Scene:
    nats_url: str
    redis: str
    tmp_path: Path
    prefix: str = field(default_factory=lambda: f"crash-{uuid.uuid4().hex[:10]}")
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        import redis.asyncio as aioredis

        self.topic, self.subscription = f"{self.prefix}-orders", f"{self.prefix}-billing"
        self.effects = f"{self.prefix}:effects"
        self.dedup_prefix = f"{self.prefix}:dedup"
        self.adapter = NatsJetStreamAdapter(self.nats_url, prefix=self.prefix)
        self.raw = aioredis.Redis.from_url(self.redis)

    def spawn(self, mode: str) -> Child:
        script = self.tmp_path / "consumer.py"
        script.write_text(CHILD)
        settings = {"nats": self.nats_url, "redis": self.redis, "mode": mode,
                    "prefix": self.prefix, "dedup_prefix": self.dedup_prefix,
                    "subscription": self.subscription, "effects": self.effects,
                    "min_extension": LEASE.min_extension, "max_extension": LEASE.max_extension}
        child = Child(script, json.dumps(settings))
        self.children.append(child)
        return child

    async def effect_list(self) -> list[str]:
        return [item.decode() for item in await self.raw.lrange(self.effects, 0, -1)]

    async def cleanup(self) -> None:
        for child in self.children:
            child.kill()
        keys = [key async for key in self.raw.scan_iter(match=f"{self.prefix}*", count=1000)]
        if keys:
            await self.raw.delete(*keys)
        await self.raw.aclose()
        await self.adapter.close()
        await delete_nats_streams(self.nats_url, self.prefix)


@pytest.fixture
async def scene(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Scene]:
    made = Scene(nats_server.url, redis_url(), tmp_path)
    await made.adapter.ensure_subscription(made.topic, made.subscription,
                                           ack_deadline=ACK_DEADLINE)
    try:
        yield made
    finally:
        await made.cleanup()


@asynccontextmanager
async def survivor(scene: Scene) -> AsyncIterator[list[tuple[str, int, Outcome]]]:
    """A second consumer of the subscription in this loop, serving until the block ends."""
    from reliable_sub.dedup import RedisDedupStore

    store = RedisDedupStore(scene.redis, prefix=scene.dedup_prefix, owner="survivor")
    outcomes: list[tuple[str, int, Outcome]] = []
    sub = Subscriber(scene.adapter, dedup=store, lease=LEASE,
                     on_outcome=lambda m, o: outcomes.append((m.id, m.delivery_attempt, o)))

    @sub.handler(scene.subscription)
    async def handle(message: Message) -> dict[str, str]:
        await scene.raw.rpush(scene.effects, f"{message.id} survivor")
        return {"effect": message.id}

    async with sub:
        yield outcomes
    await store.close()


def killed(child: Child) -> None:
    status = child.kill()
    assert status == -signal.SIGKILL, f"child ended with {status}, not by SIGKILL:\n{child.output}"


async def test_a_consumer_killed_mid_handler_leaves_its_message_to_a_peer(scene: Scene) -> None:
    child = scene.spawn("mid-handler")
    message_id = await scene.adapter.publish(scene.topic, b"order-1")
    assert await child.line("STARTED") == f"STARTED {message_id} 1", child.output
    killed(child)
    assert await scene.effect_list() == [], "the killed handler had no effect"

    async with survivor(scene) as outcomes:
        await poll_until(lambda: any(o is Outcome.ACKED for _, _, o in outcomes),
                         "the survivor to handle it", WITHIN)
    acked = [(i, attempt) for i, attempt, o in outcomes if o is Outcome.ACKED]
    deferred = [o for _, _, o in outcomes if o is Outcome.DEFERRED]
    # the dead claim may outlive the broker's AckWait by a moment: a takeover inside that
    # window is deferred once (and counted as a delivery by the server)
    assert acked == [(message_id, 2 + len(deferred))], outcomes
    assert len(outcomes) == len(acked) + len(deferred), outcomes
    assert await scene.effect_list() == [f"{message_id} survivor"], "exactly one effect"


async def test_a_consumer_killed_between_completion_and_ack_is_deduplicated(
    scene: Scene,
) -> None:
    child = scene.spawn("after-effect")
    message_id = await scene.adapter.publish(scene.topic, b"order-1")
    assert await child.line("ACKING") == f"ACKING {message_id}", child.output
    killed(child)
    assert await scene.effect_list() == [f"{message_id} doomed"]

    async with survivor(scene) as outcomes:
        await poll_until(lambda: len(outcomes) >= 1, "the survivor to settle it", WITHIN)
    assert outcomes == [(message_id, 2, Outcome.DUPLICATE)]
    assert await scene.effect_list() == [f"{message_id} doomed"], "still exactly one effect"

# -- the lease tick never waits on the receive path (#24 item 13) ------------------------------
# On NATS a nack without delay waits for the subscription's fetch lock (a redelivery must not
# land in the fetch in flight), which a receive holds for a whole fetch (receive_timeout).
# Giving back a sync handler past max_lease_duration is such a nack, and the lease tick used to
# await it: every other delivery then missed its extension and ran twice. A 6 s sync handler
# passes a 3 s max_lease_duration beside a 2.5 s one: the 2.5 s one must run once.

GIVE_BACK_LEASE = LeasePolicy(min_extension=0.5, max_extension=ACK_DEADLINE,
                              max_lease_duration=3.0)


async def _wait_real(predicate: object, what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(0.01)


async def test_giving_back_an_overrunning_sync_handler_does_not_stall_other_leases(
    adapter: NatsJetStreamAdapter,
) -> None:
    topic, subscription = f"{uuid.uuid4().hex[:8]}-orders", f"{uuid.uuid4().hex[:8]}-billing"
    await adapter.ensure_subscription(topic, subscription, ack_deadline=ACK_DEADLINE)
    runs: Counter[bytes] = Counter()
    outcomes: list[tuple[bytes, Outcome]] = []
    long_started = threading.Event()
    started_at: list[float] = []
    done = threading.Event()

    sub = Subscriber(adapter, lease=GIVE_BACK_LEASE, stop_timeout=10,
                     on_outcome=lambda m, o: outcomes.append((m.data, o)))

    @sub.handler(subscription)
    def work(message: Message) -> None:
        runs[message.data] += 1
        if message.data == b"long":
            started_at.append(time.monotonic())
            long_started.set()
            done.wait(6.0)
        elif message.data == b"short":
            done.wait(2.5)

    serving = asyncio.ensure_future(sub.serve())
    try:
        await _wait_real(lambda: sub.running, "the Subscriber to start")
        await adapter.publish(topic, b"long")
        await _wait_real(long_started.is_set, "the long handler")
        # the schedule, not a synchronisation: the short one then runs from about 1.5 s to 4 s
        # after the long one began, across its give-back at 3 s, and within its own 3 s
        await _wait_real(lambda: time.monotonic() >= started_at[0] + 1.5, "1.5 s to pass")
        await adapter.publish(topic, b"short")
        await _wait_real(lambda: any(data == b"short" for data, _ in outcomes),
                         "the short one to settle")
        assert runs[b"short"] == 1, (
            "the short handler ran again while it still ran: its lease lapsed while the lease "
            "tick waited on the long one's give-back")
        assert (b"short", Outcome.ACKED) in outcomes
        assert sub.lease_manager(subscription).stats.max_lease_reached >= 1
    finally:
        done.set()
        await sub.shutdown(timeout=10)
        await serving
