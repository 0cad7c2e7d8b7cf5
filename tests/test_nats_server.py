"""The private NATS server the NATS adapter's tests will use (#16, groundwork): JetStream is on,
a durable pull consumer redelivers what is not acked, and the store survives a SIGKILL."""

from __future__ import annotations

import uuid

import pytest

from tests.nats_processes import NatsServer

nats = pytest.importorskip("nats", reason='the NATS tests need "reliable-sub[nats]"')
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig  # noqa: E402


async def test_a_message_not_acked_comes_back_and_the_stream_survives_a_kill(
    nats_server: NatsServer,
) -> None:
    name = f"groundwork-{uuid.uuid4().hex[:8]}"
    client = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    try:
        js = client.jetstream()
        await js.add_stream(StreamConfig(name=name, subjects=[f"{name}.>"]))
        await js.add_consumer(name, ConsumerConfig(durable_name="billing",
                                                   ack_policy=AckPolicy.EXPLICIT, ack_wait=30))
        ack = await js.publish(f"{name}.orders", b"pay 10 EUR",
                               headers={"Nats-Msg-Id": "order-1"})
        again = await js.publish(f"{name}.orders", b"pay 10 EUR",
                                 headers={"Nats-Msg-Id": "order-1"})
        assert (again.seq, again.duplicate) == (ack.seq, True), "deduplicated by Nats-Msg-Id"
        pull = await js.pull_subscribe_bind("billing", stream=name)
        [first] = await pull.fetch(1, timeout=5)
        await first.nak()  # not done: delivered again, with the count the server keeps
        [second] = await pull.fetch(1, timeout=5)
        assert second.data == b"pay 10 EUR"
        assert second.metadata.num_delivered == 2
        await second.ack_sync()
    finally:
        await client.close()

    nats_server.kill()
    nats_server.start()
    client = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    try:
        info = await client.jetstream().stream_info(name)
        assert info.state.messages == 1, "the stream was kept on disk"
        await client.jetstream().delete_stream(name)
    finally:
        await client.close()
