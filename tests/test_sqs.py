"""The SQS adapter beyond the shipped suite (tests/test_conformance.py runs that): what it does on
SQS's own terms, on the session's ElasticMQ (tests/sqs_processes.py), with a raw boto3 client
beside it for what another publisher sends and what the queue holds.

Where ElasticMQ differs from AWS (tests/sqs/FIDELITY.md), no test depends on the difference:
the stale-handle test checks that no call was made, not what ElasticMQ answers; the 12-hour cap
is checked on the parameters sent (ElasticMQ has no cap)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from reliable_sub import (
    ConfigurationError,
    DeadLetterPolicy,
    InvalidMessageError,
    LeasePolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    Subscriber,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from reliable_sub.clock import SystemClock
from reliable_sub.ports import Outgoing
from reliable_sub.testing.harness import Recorder
from reliable_sub.testing.timing import drive_until
from tests.sqs_processes import SqsServer

boto3 = pytest.importorskip("boto3", reason='the SQS tests need "reliable-sub[sqs]"')

from reliable_sub.adapters._sqs_leases import MAX_VISIBILITY, Leases  # noqa: E402
from reliable_sub.adapters._sqs_messages import largest_binary_payload  # noqa: E402
from reliable_sub.adapters.sqs import SqsAdapter  # noqa: E402

MIB = 1024 * 1024
# Seconds of real time a test waits for what it expects at most.
WITHIN = 30.0


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}-"


@pytest.fixture
def raw(sqs_server: SqsServer) -> Iterator[Any]:
    client = boto3.client("sqs", **sqs_server.client_options)
    yield client
    client.close()


@pytest_asyncio.fixture
async def adapter(sqs_server: SqsServer, prefix: str, raw: Any) -> AsyncIterator[SqsAdapter]:
    made = SqsAdapter(**sqs_server.client_options, queue_prefix=prefix)
    yield made
    await made.close()
    made.close_sync()
    for url in raw.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
        raw.delete_queue(QueueUrl=url)


async def until(predicate: Any, what: str, within: float = WITHIN) -> None:
    await drive_until(SystemClock(), predicate, within, what=what)


def url_of(raw: Any, name: str) -> str:
    return str(raw.get_queue_url(QueueName=name)["QueueUrl"])


# -- leases ----------------------------------------------------------------------------------


async def test_a_handler_running_three_visibility_timeouts_is_never_redelivered(
    adapter: SqsAdapter, raw: Any, prefix: str,
) -> None:
    """A 6 s handler on a queue of 2 s: the p99-sized lease keeps it hidden with fewer
    ChangeMessageVisibility calls than extending by the fixed deadline (the baseline: what a
    client that always asks for the queue's own timeout sends), and neither lets SQS hand it
    out again (its ApproximateReceiveCount stays 1, read by the raw client afterwards)."""
    runtime = 6.0

    async def extension_calls(name: str, lease: LeasePolicy) -> int:
        await adapter.ensure_subscription(name, name, ack_deadline=2)
        counting = SqsAdapter(endpoint_url=adapter._settings.endpoint_url,
                              region_name=adapter._settings.region_name,
                              queue_prefix=prefix, **adapter._settings.options)
        recorder = Recorder()
        subscriber = Subscriber(counting, lease=lease, on_outcome=recorder, receive_timeout=1)

        @subscriber.handler(name)
        async def slow(message: Message) -> None:
            recorder.handled.append(message)
            await asyncio.sleep(runtime)  # the work itself, not a synchronisation

        await adapter.publish(name, b"slow")
        async with subscriber:
            await until(lambda: recorder.count(Outcome.ACKED) == 1, "the slow ack")
        assert [m.delivery_attempt for m in recorder.handled] == [1]
        raw_url = url_of(raw, prefix + name)
        assert raw.get_queue_attributes(QueueUrl=raw_url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])[
            "Attributes"] == {"ApproximateNumberOfMessages": "0",
                              "ApproximateNumberOfMessagesNotVisible": "0"}
        return counting.stats["visibility_calls"]

    ours, fixed = await asyncio.gather(
        extension_calls("p99", LeasePolicy(min_extension=10.0)),
        extension_calls("fixed", LeasePolicy(min_extension=2.0, max_extension=2.0)))
    calls = {"p99": ours, "fixed": fixed}
    assert 1 <= calls["p99"] < calls["fixed"], calls
    assert calls["fixed"] >= runtime / 2, calls


async def test_a_stale_receipt_handle_is_refused_without_a_call(adapter: SqsAdapter) -> None:
    await adapter.ensure_subscription("orders", "orders", ack_deadline=1)
    await adapter.publish("orders", b"once")
    [first] = await adapter.receive("orders", 10, 1)
    [again] = await adapter.receive("orders", 10, 3)  # after the 1 s visibility lapsed
    assert again.message.id == first.message.id and again.ack_id != first.ack_id
    assert again.message.delivery_attempt == 2
    deletes = adapter.stats["delete_calls"]
    assert await adapter.ack([first]) == [first]
    assert await adapter.extend([first], 5) == [first]
    assert adapter.stats["delete_calls"] == deletes, "a stale handle never reaches SQS"
    assert await adapter.ack([again]) == []
    assert await adapter.ack([again]) == [], "an ack retried after it took effect"
    assert await adapter.receive("orders", 10, 2) == []


def test_extensions_and_delays_are_cut_to_12_hours_from_the_receive() -> None:
    """SQS refuses a visibility that would end over 12 h after the receive (ElasticMQ does not
    check: tests/sqs/FIDELITY.md); the lease's cap cuts what is asked for, rounding down."""
    leases = Leases()
    leases.received("q", "m", "h", asked_at=1000.0, returned_at=1000.2, visibility=30)
    lease = leases._held["h"]
    assert Leases.allowed(lease, 29.2, 1000.5) == 30, "rounded up, never shorter"
    assert Leases.allowed(lease, 50_000, 1000.5) == MAX_VISIBILITY - 1  # 0.5 s margin, 0.5 gone
    assert Leases.allowed(lease, 600, 1000 + MAX_VISIBILITY - 100.0) == 99
    assert Leases.allowed(lease, 600, 1000 + MAX_VISIBILITY) == 0


async def test_a_nack_past_12_hours_comes_back_at_the_cap_with_a_warning(
    adapter: SqsAdapter, caplog: pytest.LogCaptureFixture,
) -> None:
    await adapter.ensure_subscription("later", "later", ack_deadline=5)
    await adapter.publish("later", b"much later")
    [delivery] = await adapter.receive("later", 1, 1)
    sent: list[int] = []
    client = await adapter._client()

    def record(params: dict[str, Any], **_: Any) -> None:
        sent.extend(int(e["VisibilityTimeout"]) for e in params["Entries"])

    client.meta.events.register("provide-client-params.sqs.ChangeMessageVisibilityBatch",
                                record)
    await adapter.nack([delivery], 2 * 86_400)
    assert len(sent) == 1 and MAX_VISIBILITY - 5 <= sent[0] < MAX_VISIBILITY
    assert adapter.stats["delays_cut"] == 1
    assert "past SQS's limit (12 hours from the receive)" in caplog.text


# -- FIFO ------------------------------------------------------------------------------------


async def test_a_retry_after_the_fifo_window_is_caught_by_the_dedup_store_not_by_sqs(
    adapter: SqsAdapter, raw: Any, prefix: str,
) -> None:
    """Within SQS's 5-minute window, a second publish with the same idempotency key (its
    MessageDeduplicationId) is dropped by SQS. After the window SQS has forgotten the id and
    takes the copy: this test cannot wait 5 minutes, so it sends the copy as SQS sees it then,
    with the same body, attributes and idempotency key under a deduplication id SQS has not
    seen (the only thing the window's end changes). SQS delivers both; the dedup store runs
    the handler once."""
    await adapter.ensure_subscription("payments", "payments", ordering=True, ack_deadline=5)
    first = await adapter.publish("payments", b"charge 10 EUR", {"idempotency-key": "pay-7"},
                                  ordering_key="acct-1")
    within = await adapter.publish("payments", b"charge 10 EUR", {"idempotency-key": "pay-7"},
                                   ordering_key="acct-1")
    assert within == first, "SQS dropped the copy within its window"
    raw.send_message(QueueUrl=url_of(raw, prefix + "payments.fifo"), MessageBody="charge 10 EUR",
                     MessageGroupId="acct-1", MessageDeduplicationId="pay-7-after-the-window",
                     MessageAttributes={"idempotency-key": {"DataType": "String",
                                                            "StringValue": "pay-7"}})
    recorder, effects = Recorder(), Counter[str]()
    subscriber = Subscriber(adapter, dedup=MemoryDedupStore(), on_outcome=recorder,
                            receive_timeout=1)

    @subscriber.handler("payments")
    async def charge(message: Message) -> None:
        assert message.ordering_key == "acct-1"
        effects[message.idempotency_key] += 1

    async with subscriber:
        # one receive may bring both (a FIFO group is held back from other receives only):
        # the copy is deferred while the first holds the key's claim, then acked as a duplicate
        await until(lambda: recorder.count(Outcome.DUPLICATE) == 1, "the copy settled")
    assert recorder.count(Outcome.ACKED) == 1
    assert effects == {"pay-7": 1}


async def test_fifo_keys_too_long_for_sqs_are_hashed_and_bad_group_ids_refused(
    adapter: SqsAdapter,
) -> None:
    await adapter.ensure_subscription("fifo", "fifo", ordering=True)
    long_key = "k" * 500
    one = await adapter.publish("fifo", b"a", {"idempotency-key": long_key})
    two = await adapter.publish("fifo", b"a", {"idempotency-key": long_key})
    other = await adapter.publish("fifo", b"a", {"idempotency-key": long_key[:-1] + "j"})
    assert one == two != other
    with pytest.raises(InvalidMessageError, match="cannot be an SQS MessageGroupId"):
        await adapter.publish("fifo", b"a", ordering_key="with space")
    with pytest.raises(ConfigurationError, match="a queue's type cannot change"):
        await adapter.ensure_subscription("fifo", "fifo", ordering=False)


# -- layout ----------------------------------------------------------------------------------


async def test_a_topic_has_one_subscription_found_by_its_name_alone(
    adapter: SqsAdapter, sqs_server: SqsServer, prefix: str, raw: Any,
) -> None:
    await adapter.ensure_subscription("orders", "billing", ack_deadline=7)
    with pytest.raises(ConfigurationError, match="SQS has no fan-out"):
        await adapter.ensure_subscription("orders", "shipping")
    with pytest.raises(ConfigurationError, match="already exists on topic 'orders'"):
        await adapter.ensure_subscription("invoices", "billing")
    await adapter.ensure_subscription("orders", "billing", ack_deadline=7)  # idempotent
    with pytest.raises(UnknownTopicError, match="is a subscription of topic 'orders'"):
        await adapter.publish("billing", b"x")
    assert not await adapter.topic_exists("billing")
    await adapter.publish("orders", b"to billing")
    fresh = SqsAdapter(**sqs_server.client_options, queue_prefix=prefix)
    try:
        assert await fresh.subscription_topic("billing") == "orders"
        assert await fresh.subscription_ack_deadline("billing") == 7.0
        [delivery] = await fresh.receive("billing", 10, 1)
        assert (delivery.message.data, delivery.message.subscription) == (b"to billing",
                                                                          "billing")
        assert await fresh.ack([delivery]) == []
        with pytest.raises(UnknownSubscriptionError, match="its queue's messages go to"):
            await fresh.receive("orders", 10, 0)
        with pytest.raises(UnknownSubscriptionError, match="does not exist"):
            await fresh.receive("nothing", 10, 0)
    finally:
        await fresh.close()
    # a queue made by other means is its own topic and subscription
    raw.create_queue(QueueName=prefix + "legacy")
    raw.send_message(QueueUrl=url_of(raw, prefix + "legacy"), MessageBody="from elsewhere")
    [legacy] = await adapter.receive("legacy", 10, 1)
    assert legacy.message.data == b"from elsewhere"
    await adapter.ack([legacy])


async def test_the_redrive_policy_is_a_backstop_above_our_attempts(
    adapter: SqsAdapter, raw: Any, prefix: str,
) -> None:
    """After ``max_delivery_attempts`` receives the next receive moves the message to the
    backstop queue (SQS's count, whatever consumers said)."""
    await adapter.ensure_subscription("jobs", "jobs", ack_deadline=5,
                                      dead_letter=DeadLetterPolicy("jobs-parked", 2))
    await adapter.publish("jobs", b"stuck")
    for attempt in (1, 2):
        [delivery] = await adapter.receive("jobs", 10, 2)
        assert delivery.message.delivery_attempt == attempt
        await adapter.nack([delivery], 0)
    assert await adapter.receive("jobs", 10, 1) == []
    [parked] = await adapter.receive("jobs-parked", 10, 2)
    assert parked.message.data == b"stuck"
    await adapter.ack([parked])


# -- messages --------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    b"", b"plain text \r\n\t with a CRLF", "ключ 🙂".encode(), b"nul\x00inside",
    b"\xff\xfe\x00\x80 not UTF-8", b"x" * (256 * 1024), b"y" * MIB,
    bytes(range(256)) * (largest_binary_payload() // 256),
], ids=["empty", "crlf", "unicode", "nul", "binary", "256 KiB text", "1 MiB text",
        "largest binary"])
async def test_bodies_round_trip_byte_for_byte(adapter: SqsAdapter, data: bytes) -> None:
    await adapter.ensure_subscription("bodies", "bodies")
    await adapter.publish("bodies", data)
    [delivery] = await adapter.receive("bodies", 10, 2)
    assert delivery.message.data == data and delivery.malformed is None
    await adapter.ack([delivery])


async def test_a_message_over_the_limit_is_refused_before_it_is_sent(
    adapter: SqsAdapter,
) -> None:
    await adapter.ensure_subscription("big", "big")
    sent = adapter.stats["send_calls"]
    with pytest.raises(InvalidMessageError, match=r"1,048,577 bytes .* over the limit"):
        await adapter.publish("big", b"y" * (MIB + 1))
    with pytest.raises(InvalidMessageError, match="over the limit"):
        await adapter.publish("big", b"y" * (MIB - 10), {"tenant": "a longer value"})
    assert adapter.stats["send_calls"] == sent


async def test_a_text_body_and_plain_attributes_are_what_other_sqs_clients_read(
    adapter: SqsAdapter, raw: Any, prefix: str,
) -> None:
    await adapter.ensure_subscription("interop", "interop")
    plain = {f"k{n}": f"v{n}" for n in range(10)}
    await adapter.publish("interop", b"hello", plain)
    await adapter.publish("interop", b"\xff", {"odd name": "", "k": "v"})
    got = raw.receive_message(QueueUrl=url_of(raw, prefix + "interop"), MaxNumberOfMessages=10,
                              MessageAttributeNames=["All"], WaitTimeSeconds=1)["Messages"]
    while len(got) < 2:
        got += raw.receive_message(QueueUrl=url_of(raw, prefix + "interop"),
                                   MessageAttributeNames=["All"],
                                   WaitTimeSeconds=1).get("Messages", [])
    by_body = {m["Body"]: m for m in got}
    hello = by_body["hello"]
    assert {k: v["StringValue"] for k, v in hello["MessageAttributes"].items()} == plain
    [packed] = [m for m in got if m["Body"] != "hello"]
    assert base64.b64decode(packed["Body"]) == b"\xff"
    assert set(packed["MessageAttributes"]) == {"reliable-sub-body", "reliable-sub-attributes"}


async def test_attributes_of_every_sqs_type_from_another_publisher(
    adapter: SqsAdapter, raw: Any, prefix: str,
) -> None:
    await adapter.ensure_subscription("foreign", "foreign")
    raw.send_message(QueueUrl=url_of(raw, prefix + "foreign"), MessageBody="from boto3 ✓",
                     MessageAttributes={
                         "s": {"DataType": "String", "StringValue": "text"},
                         "n": {"DataType": "Number", "StringValue": "-12.50"},
                         "b": {"DataType": "Binary", "BinaryValue": "utf-8 ✓".encode()},
                         "raw": {"DataType": "Binary", "BinaryValue": b"\xff\x00\x01"},
                         "custom": {"DataType": "String.tenant", "StringValue": "acme"},
                         "int": {"DataType": "Number.int", "StringValue": "42"},
                         "gif": {"DataType": "Binary.gif", "BinaryValue": b"GIF89a"},
                     })
    [delivery] = await adapter.receive("foreign", 10, 2)
    assert delivery.malformed is None
    assert delivery.message.data == "from boto3 ✓".encode()
    assert delivery.message.attributes == {
        "s": "text", "n": "-12.50", "b": "utf-8 ✓", "raw": base64.b64encode(
            b"\xff\x00\x01").decode(), "custom": "acme", "int": "42", "gif": "GIF89a"}
    assert delivery.message.publish_time is not None
    await adapter.ack([delivery])


@pytest.mark.parametrize(("encoding", "body", "problem"), [
    ("base64", "not base64!", "says base64, but the body is not base64"),
    ("gzip", "H4sI", "no encoding this adapter writes"),
])
async def test_a_foreign_body_with_a_bad_encoding_is_dead_lettered_with_its_reason(
    adapter: SqsAdapter, raw: Any, prefix: str, encoding: str, body: str, problem: str,
) -> None:
    await adapter.ensure_subscription("mixed", "mixed")
    await adapter.ensure_subscription("mixed-dlq", "mixed-dlq")
    raw.send_message(QueueUrl=url_of(raw, prefix + "mixed"), MessageBody=body,
                     MessageAttributes={"reliable-sub-body": {"DataType": "String",
                                                              "StringValue": encoding}})
    await adapter.publish("mixed", b"canary")
    recorder, dead = Recorder(), []
    subscriber = Subscriber(adapter, on_outcome=recorder, receive_timeout=1,
                            dead_letter=DeadLetterPolicy("mixed-dlq", 3))
    subscriber.handler("mixed")(lambda message: recorder.handled.append(message))
    subscriber.handler("mixed-dlq")(lambda message: dead.append(message))
    async with subscriber:
        await until(lambda: bool(dead) and recorder.count(Outcome.ACKED) >= 1, "both settled")
    assert [m.data for m in recorder.handled] == [b"canary"]
    assert problem in dead[0].attributes["error-message"]
    assert dead[0].data == body.encode()


async def test_publish_many_sends_batches_and_refuses_one_message_alone(
    adapter: SqsAdapter,
) -> None:
    await adapter.ensure_subscription("bulk", "bulk")
    await adapter.ensure_subscription("bulk.fifo", "bulk.fifo")
    messages = [Outgoing("bulk", f"m{n}".encode()) for n in range(23)]
    messages += [Outgoing("bulk", b"y" * (MIB + 1)), Outgoing("missing", b"x")]
    messages += [Outgoing("bulk.fifo", f"f{n}".encode(), ordering_key="g") for n in range(12)]
    before = adapter.stats["send_calls"]
    results = await adapter.publish_many(messages)
    assert all(isinstance(r, str) for r in results[:23] + results[25:])
    assert isinstance(results[23], InvalidMessageError)
    assert isinstance(results[24], UnknownTopicError)
    assert adapter.stats["send_calls"] - before == 3 + 2
    got = []
    while len(got) < 12:
        batch = await adapter.receive("bulk.fifo", 10, 1)
        got += batch
        await adapter.ack(batch)
    assert [d.message.data for d in got] == [f"f{n}".encode() for n in range(12)]


async def test_figures_are_marked_approximate(adapter: SqsAdapter) -> None:
    await adapter.ensure_subscription("counted", "counted", ack_deadline=30)
    for n in range(3):
        await adapter.publish("counted", b"%d" % n)
    taken = await adapter.receive("counted", 1, 1)
    figures = await adapter.subscription_stats("counted")
    assert (figures.backlog, figures.in_flight, figures.approximate) == (3, 1, True)
    assert (figures.oldest_unacked_age, figures.ack_deadline) == (None, 30.0)
    await adapter.ack(taken)


# -- settings --------------------------------------------------------------------------------


def test_region_and_endpoint_come_from_the_usual_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_SQS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigurationError, match="needs an AWS region: pass region_name="):
        SqsAdapter()
    monkeypatch.setenv("AWS_REGION", "eu-west-3")  # what Lambda and ECS set; botocore reads not
    assert SqsAdapter().connection_attributes() == {
        "server.address": "sqs.eu-west-3.amazonaws.com", "server.port": 443}
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-north-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", "http://127.0.0.1:9324")
    assert SqsAdapter().connection_attributes() == {"server.address": "127.0.0.1",
                                                    "server.port": 9324}
    with pytest.raises(ConfigurationError, match="endpoint_url must be an http"):
        SqsAdapter(endpoint_url="sqs.eu-west-1.amazonaws.com")
    with pytest.raises(ConfigurationError, match="queue_prefix must be letters"):
        SqsAdapter(queue_prefix="bad prefix")
    with pytest.raises(ConfigurationError, match="cannot name a queue"):
        SqsAdapter().ensure_subscription_sync("a" * 81, "a" * 81)
