"""A broker connection that hangs (not refused) under a running Subscriber, on the real Redis
through a TCP proxy that stalls (#24: healthy while handling nothing). The Redis adapter's
client has no read timeout, so a receive on a stalled connection waited for ever while
``healthy()`` said True. Every receive is bounded now: the consumer reports the outage, and
handles again soon after the stall ends.
"""

from __future__ import annotations

import importlib.util
import os
import time
import uuid
from collections.abc import Iterator

import pytest

from reliable_sub import Message, Outcome, Subscriber
from reliable_sub._runtime.settler import CALL_BOUND
from reliable_sub.testing.services import redis_url
from reliable_sub.testing.tcp_proxy import TcpProxy

if importlib.util.find_spec("redis") is None and os.environ.get("CI", "").lower() != "true":
    pytest.skip('the Redis tests need pip install "reliable-sub[redis]"', allow_module_level=True)

import redis

from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

RECEIVE_TIMEOUT = 0.5
WITHIN = 30.0


def wait_for(predicate: object, what: str, within: float = WITHIN) -> float:
    """Poll until ``predicate()``; returns the seconds it took."""
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        if time.monotonic() - start > within:
            raise AssertionError(f"timed out after {within:g}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.fixture
def names() -> Iterator[tuple[str, str]]:
    suffix = uuid.uuid4().hex[:10]
    yield f"bstall-{suffix}", f"bstall-sub-{suffix}"
    client = redis.Redis.from_url(redis_url())
    try:
        for key in client.scan_iter(f"*{suffix}*"):
            client.delete(key)
    finally:
        client.close()


def test_a_hung_broker_connection_is_reported_and_recovered_from(
    names: tuple[str, str],
) -> None:
    topic, subscription = names
    url = redis_url()
    setup = RedisStreamsAdapter(url)
    setup.ensure_subscription_sync(topic, subscription, ack_deadline=5.0)
    handled: list[bytes] = []
    with TcpProxy("127.0.0.1", 6379) as proxy:
        sub = Subscriber(RedisStreamsAdapter(f"redis://127.0.0.1:{proxy.port}/0"),
                         receive_timeout=RECEIVE_TIMEOUT, unhealthy_after=2.0, stop_timeout=5)

        @sub.handler(subscription)
        def record(message: Message) -> None:
            handled.append(message.data)

        sub.start()
        try:
            setup.publish_sync(topic, b"before")
            # acked, not only handled: an ack still waiting as the stall begins may see its
            # lease (5 s) lapse under load, and the redelivery is handled again (as it should
            # be without a dedup store): a loaded run saw b"before" twice
            wait_for(lambda: sub.stats[Outcome.ACKED] == 1, "the first message's ack")
            assert handled == [b"before"]
            proxy.stall()
            wait_for(lambda: not sub.healthy(), "healthy() to tell the stall")
            assert any(problem.startswith(f"receiving from {subscription!r} has failed")
                       and "did not answer within" in problem for problem in sub.problems())
            setup.publish_sync(topic, b"during")
            proxy.resume()
            recovery = wait_for(lambda: b"during" in handled, "handling after the stall")
            wait_for(sub.healthy, "healthy again")
            # an ack sent as the stall began may wait for its reply until the settler's
            # bound on one call (CALL_BOUND) gives it up and retries it: the promise is that
            # bound, so the wait allows it (a loaded run once needed more than 30 s here)
            wait_for(lambda: sub.stats[Outcome.ACKED] == 2, "both acks",
                     within=CALL_BOUND + WITHIN)
        finally:
            proxy.resume()
            sub.stop(timeout=5)
            setup.close_sync()
    assert handled == [b"before", b"during"]
    assert sub.stats[Outcome.ACKED] == 2
    # one bound (2 x 0.5 s + 2 s) and a retry wait of at most 2 s: seconds, not minutes (the
    # bound is generous for a loaded machine)
    assert recovery < 20.0, f"handled {recovery:.1f}s after the stall ended"
