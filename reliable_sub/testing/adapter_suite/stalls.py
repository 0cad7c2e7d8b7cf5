"""A broker connection that stalls (no byte moves, nothing is closed) under a running
Subscriber: ``healthy()`` must tell it within ``unhealthy_after`` and a little, and the consumer
must handle what waited once the stall ends.

Outside trials found adapters healthy through such stalls: receives answered from a local buffer,
acks that are unanswered writes, empty fetches counted as successes. The test needs the harness's
``url`` and ``new_adapter_for`` (an adapter for the address of a TCP proxy in front of the
broker); harnesses without them (in-process brokers, clusters whose nodes give their own
addresses) skip it.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

from reliable_sub import Message, Outcome
from reliable_sub.clock import SystemClock
from reliable_sub.testing.harness import Harness, Recorder
from reliable_sub.testing.tcp_proxy import TcpProxy

# Messages published while the consumer's connection stalls: the backlog that waits.
BACKLOG = 5


def _via(url: str, port: int) -> str:
    """``url`` with its port replaced by ``port`` on the loopback address."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@127.0.0.1:{port}" if credentials else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def test_a_stalled_connection_shows_in_health_and_the_backlog_is_handled_after(
    harness: Harness,
) -> None:
    if harness.url is None or harness.new_adapter_for is None:
        pytest.skip(f"{harness.name}'s harness gives no broker address to stall")
    if not isinstance(harness.clock, SystemClock):
        pytest.skip("a stall is real time")
    parts = urlsplit(harness.url)
    assert parts.hostname is not None and parts.port is not None, harness.url
    publisher = await harness.adapter()
    topic, sub = await harness.topic_and_subscription()
    unhealthy_after = 2 * harness.ack_deadline
    # a stalled call is bounded by a receive's timeout or a broker call's bound, then failed
    # calls must last unhealthy_after; generous on a loaded machine
    tell_within = unhealthy_after + 10 * harness.ack_deadline + 20
    with TcpProxy(parts.hostname, parts.port) as proxy:
        consumer = await harness.new_adapter_for(_via(harness.url, proxy.port))
        harness.adapters.append(consumer)
        recorder = Recorder()
        subscriber = harness.subscriber(consumer, on_outcome=recorder,
                                        unhealthy_after=unhealthy_after)

        @subscriber.handler(sub)
        async def handle(message: Message) -> None:
            recorder.handled.append(message)

        await publisher.publish(topic, b"before")
        try:
            async with harness.serving(subscriber):
                await harness.wait_until(lambda: recorder.count(Outcome.ACKED) == 1,
                                         within=10 * harness.ack_deadline, what="the first ack")
                proxy.stall()
                for n in range(BACKLOG):
                    await publisher.publish(topic, f"during-{n}".encode())
                await harness.wait_until(lambda: not subscriber.healthy(), within=tell_within,
                                         what="healthy() to tell the stalled connection")
                assert subscriber.problems(), "unhealthy, and problems() says why"
                proxy.resume()
                await harness.wait_until(
                    lambda: {m.data for m in recorder.handled} >= {
                        f"during-{n}".encode() for n in range(BACKLOG)},
                    within=tell_within, what="the backlog handled after the stall")
                await harness.wait_until(subscriber.healthy, within=tell_within,
                                         what="healthy again after the stall")
        finally:
            proxy.resume()


__all__ = ["test_a_stalled_connection_shows_in_health_and_the_backlog_is_handled_after"]
