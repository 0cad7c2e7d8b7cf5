"""RabbitMQ figures from the management API (#28): ``RabbitMQAdapter(management_url=...)``.

On a private node with the management plugin (``rabbitmq_management_node``, tests/conftest.py;
the shared node runs without it), its figures published every second rather than every 5 s.
The figures trail the broker by that much, so each is polled until a deadline, then compared
exactly. A hung management API is the real one behind a stalled TcpProxy (it accepts, and
never answers); a management API that is down is a closed loopback port.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import quote

import pytest

from reliable_sub import (
    ConfigurationError,
    FlowControl,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
    TelemetryPolicy,
)
from reliable_sub.clock import SystemClock
from reliable_sub.errors import UnknownSubscriptionError
from reliable_sub.ports import SubscriptionStats
from reliable_sub.testing.otel import Recorded, recording_telemetry
from reliable_sub.testing.services import in_ci, rabbitmq_url
from reliable_sub.testing.tcp_proxy import TcpProxy
from reliable_sub.testing.timing import drive_until
from tests.rabbitmq_processes import RabbitNode
from tests.redis_processes import free_port

if importlib.util.find_spec("aio_pika") is None and not in_ci():
    pytest.skip('the RabbitMQ tests need pip install "reliable-sub[rabbitmq]"',
                allow_module_level=True)

import aio_pika

from reliable_sub.adapters.rabbitmq import RabbitMQAdapter

# Bound on every wait for figures (published every second here) or for handlers.
WITHIN = 20.0
# The backlog gauges' sampling interval in these tests (15 s by default).
SAMPLING = 0.1
# A hung management API's reading ends after this (the default is 5 s).
TIMEOUT = 0.5
BACKLOG, UNACKED, OLDEST = ("reliable_sub.subscription.backlog",
                            "reliable_sub.subscription.unacked",
                            "reliable_sub.subscription.oldest_age")
MANAGEMENT_LOGGER = "reliable_sub.adapters.rabbitmq"


@pytest.fixture
def node(rabbitmq_management_node: RabbitNode) -> RabbitNode:
    return rabbitmq_management_node


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    with recording_telemetry() as recorded:
        yield recorded


@pytest.fixture
def names() -> Iterator[Callable[[str], str]]:
    prefix = f"mg-{uuid.uuid4().hex[:8]}"
    yield lambda name: f"{prefix}-{name}"


def gauge(recorded: Recorded, name: str, subscription: str) -> float | None:
    """The gauge's point for ``subscription`` now (None: no point)."""
    for point in recorded.points(name):
        if point.attributes.get("messaging.destination.subscription.name") == subscription \
                or point.attributes.get("messaging.consumer.group.name") == subscription:
            return float(point.value)
    return None


async def gauges_become(recorded: Recorded, queue: str, backlog_and_unacked: tuple[int, int]
                        ) -> None:
    """Wait for the sampled backlog and unacked gauges of ``queue`` to read these (WITHIN)."""
    give_up = time.monotonic() + WITHIN
    found = (gauge(recorded, BACKLOG, queue), gauge(recorded, UNACKED, queue))
    while found != backlog_and_unacked and time.monotonic() < give_up:
        await asyncio.sleep(0.05)
        found = (gauge(recorded, BACKLOG, queue), gauge(recorded, UNACKED, queue))
    assert found == backlog_and_unacked


async def figures_when(adapter: RabbitMQAdapter, queue: str,
                       wanted: Callable[[SubscriptionStats], bool]) -> SubscriptionStats:
    """The first reading that is ``wanted``, or the last within WITHIN."""
    give_up = time.monotonic() + WITHIN
    figures = await adapter.subscription_stats(queue)
    while not wanted(figures) and time.monotonic() < give_up:
        await asyncio.sleep(0.05)
        figures = await adapter.subscription_stats(queue)
    return figures


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The adapter's warnings about the management API."""
    return [r.getMessage() for r in caplog.records if r.name == MANAGEMENT_LOGGER
            and r.levelno == logging.WARNING and "management API" in r.getMessage()]


@pytest.fixture
async def serving() -> AsyncIterator[Callable[[Subscriber], Any]]:
    """Start Subscribers serving; each is shut down at the end of the test."""
    running: list[tuple[Subscriber, asyncio.Future[None]]] = []

    async def start(sub: Subscriber) -> None:
        task = asyncio.ensure_future(sub.serve())
        running.append((sub, task))
        await drive_until(SystemClock(), lambda: sub.running or task.done(), WITHIN,
                          what="the Subscriber running")

    yield start
    for sub, task in running:
        await sub.shutdown(timeout=5)
        await task


# -- the figures -----------------------------------------------------------------------------------


async def test_the_sampled_backlog_counts_the_queue_its_delay_queues_and_what_handlers_hold(
        node: RabbitNode, names: Callable[[str], str], recorded: Recorded,
        serving: Callable[[Subscriber], Any]) -> None:
    """Ten messages, a window of four: the handlers hold four, five wait ready, and one that
    failed waits out its backoff in a delay queue -- the backlog is all ten, as on the other
    brokers (none is acked); four are unacked. Once the handlers finish, the one in the delay
    queue is the backlog, nothing is unacked; the oldest age has no point throughout."""
    adapter = RabbitMQAdapter(node.url, prefix=names("p"), management_url=node.management_url)
    topic, queue = names("orders"), names("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=30)
    release = asyncio.Event()
    held: list[str] = []
    sub = Subscriber(adapter, flow_control=FlowControl(max_messages=4), receive_timeout=0.2,
                     retry=RetryPolicy(min_backoff=600, max_backoff=600),
                     telemetry=TelemetryPolicy(backlog_interval=SAMPLING))

    @sub.handler(queue)
    async def hold(message: Message) -> None:
        if message.data == b"fail":
            raise RuntimeError("fails: waits out its backoff in a delay queue")
        held.append(message.id)
        await release.wait()

    await adapter.publish(topic, b"fail")
    for n in range(9):
        await adapter.publish(topic, f"m-{n}".encode())
    await serving(sub)
    try:
        await drive_until(SystemClock(), lambda: len(held) == 4, WITHIN, what="four held")
        await gauges_become(recorded, queue, (10, 4))
        assert gauge(recorded, OLDEST, queue) is None, "the age is unknown, never made up"
        figures = await adapter.subscription_stats(queue)
        assert (figures.backlog, figures.in_flight, figures.oldest_unacked_age,
                figures.ack_deadline) == (10, 4, None, 30.0)
    finally:
        release.set()
    await drive_until(SystemClock(), lambda: sub.stats[Outcome.ACKED] == 9, WITHIN,
                      what="nine acked")
    await gauges_become(recorded, queue, (1, 0))  # the one in the delay queue
    assert gauge(recorded, OLDEST, queue) is None


async def test_figures_of_a_queue_in_another_vhost_with_the_amqp_urls_credentials(
        node: RabbitNode, names: Callable[[str], str]) -> None:
    """The vhost comes from the AMQP URL (``/`` in its name quoted in the API's path); without
    credentials in management_url, the AMQP URL's are used; a queue name's ``.`` is matched as
    itself (a queue of the same topic whose name has another character there is not
    counted), and case counts (the API's own name filter ignores it)."""
    vhost = names("tenant/a")
    api = node.management_url
    call(api, "PUT", f"api/vhosts/{quote(vhost, safe='')}")
    call(api, "PUT", f"api/permissions/{quote(vhost, safe='')}/guest",
         {"configure": ".*", "write": ".*", "read": ".*"})
    url = f"{node.url}{quote(vhost, safe='')}"
    bare = api.replace("guest:guest@", "")
    adapter = RabbitMQAdapter(url, prefix=names("p"), management_url=bare)
    topic, queue = names("orders"), names("billing.v2")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    await adapter.ensure_subscription(topic, names("billingXv2"), ack_deadline=10)
    await adapter.ensure_subscription(topic, names("BILLING.v2"), ack_deadline=10)
    for n in range(3):
        await adapter.publish(topic, b"%d" % n)
    figures = await figures_when(adapter, queue, lambda f: f.backlog == 3)
    assert (figures.backlog, figures.in_flight) == (3, 0)
    await adapter.close()
    call(api, "DELETE", f"api/vhosts/{quote(vhost, safe='')}")


async def test_the_cli_shows_the_figures_with_amqp_management_url(
        node: RabbitNode, names: Callable[[str], str]) -> None:
    """``reliable-sub stats`` shows RabbitMQ's backlog (unknown without the option)."""
    from tests.test_cli import as_json, reliable_sub

    prefix = names("cli")
    adapter = RabbitMQAdapter(node.url, prefix=prefix)
    topic, queue = names("orders"), names("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    for n in range(4):
        await adapter.publish(topic, b"%d" % n)
    await adapter.close()
    args = ("--amqp-url", node.url, "--amqp-prefix", prefix)
    assert as_json(reliable_sub(*args, "stats", queue, "--json"))["backlog"] is None
    give_up = time.monotonic() + WITHIN
    while True:  # the broker's figures trail by up to a second on this node
        row = as_json(await asyncio.to_thread(
            reliable_sub, *args, "--amqp-management-url", node.management_url, "stats", queue,
            "--json"))
        if row["backlog"] == 4 or time.monotonic() > give_up:
            break
    assert (row["backlog"], row["in_flight"]) == (4, 0)


def call(api: str, method: str, path: str, body: Any = None) -> None:
    """One call to the management API as guest (setting up a test)."""
    request = urllib.request.Request(
        api.replace("guest:guest@", "") + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q=", "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10):
        pass


# -- a management API that does not answer -----------------------------------------------------


async def test_a_management_api_that_is_down_leaves_the_figures_unknown_and_consumption_going(
        node: RabbitNode, names: Callable[[str], str], recorded: Recorded,
        serving: Callable[[Subscriber], Any], caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens on the management port: each reading is refused at once, the gauges
    have no point, the Subscriber handles every message, and the outage is logged once."""
    closed = f"http://guest:guest@127.0.0.1:{free_port()}/"
    adapter = RabbitMQAdapter(node.url, prefix=names("p"), management_url=closed)
    topic, queue = names("orders"), names("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    sub = Subscriber(adapter, receive_timeout=0.2,
                     telemetry=TelemetryPolicy(backlog_interval=SAMPLING))
    sub.handler(queue)(lambda message: None)
    caplog.set_level(logging.INFO, logger=MANAGEMENT_LOGGER)
    await serving(sub)
    for n in range(5):
        await adapter.publish(topic, b"%d" % n)
    await drive_until(SystemClock(), lambda: sub.stats[Outcome.ACKED] == 5, WITHIN,
                      what="five handled")
    for _ in range(3):
        began = time.monotonic()
        figures = await adapter.subscription_stats(queue)
        assert time.monotonic() - began < TIMEOUT, "a refusal is known at once"
        assert figures == SubscriptionStats(None, None, None, 10.0,
                                            unknown_because=figures.unknown_because)
        assert figures.unknown_because is not None, "the reason comes with the unknowns"
        assert "did not answer" in figures.unknown_because
        assert "Connection refused" in figures.unknown_because
        assert "guest" not in figures.unknown_because, "no credentials in it"
    assert [gauge(recorded, name, queue) for name in (BACKLOG, UNACKED, OLDEST)] == [
        None, None, None]
    [warned] = warnings_of(caplog)
    assert "did not answer" in warned and "Connection refused" in warned
    assert "guest" not in warned, "no credentials in the log"


async def test_a_hung_management_api_costs_a_reading_its_timeout_then_it_recovers(
        node: RabbitNode, names: Callable[[str], str], serving: Callable[[Subscriber], Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """The management API behind a stalled proxy takes the connection and never answers: a
    reading returns unknown after management_timeout, the Subscriber goes on handling
    meanwhile; when the proxy resumes, the figures come back and that is logged."""
    port = int(node.management_url.rstrip("/").rsplit(":", 1)[1])
    caplog.set_level(logging.INFO, logger=MANAGEMENT_LOGGER)
    with TcpProxy("127.0.0.1", port) as proxy:
        adapter = RabbitMQAdapter(
            node.url, prefix=names("p"), management_timeout=TIMEOUT,
            management_url=f"http://guest:guest@127.0.0.1:{proxy.port}/")
        topic, queue = names("orders"), names("billing")
        await adapter.ensure_subscription(topic, queue, ack_deadline=10)
        sub = Subscriber(adapter, receive_timeout=0.2,
                         telemetry=TelemetryPolicy(backlog_interval=SAMPLING))
        sub.handler(queue)(lambda message: None)
        proxy.stall()
        await serving(sub)
        for n in range(3):
            await adapter.publish(topic, b"%d" % n)
        await drive_until(SystemClock(), lambda: sub.stats[Outcome.ACKED] == 3, WITHIN,
                          what="three handled while the API hangs")
        began = time.monotonic()
        figures = await adapter.subscription_stats(queue)
        took = time.monotonic() - began
        assert (figures.backlog, figures.in_flight, figures.ack_deadline) == (None, None, 10.0)
        assert figures.unknown_because is not None
        assert "no answer within the management timeout" in figures.unknown_because
        assert TIMEOUT <= took < TIMEOUT + 1.0, took
        [warned] = warnings_of(caplog)
        assert "no answer within the management timeout" in warned
        proxy.resume()
        figures = await figures_when(adapter, queue, lambda f: f.backlog is not None)
        assert (figures.backlog, figures.in_flight) == (0, 0)
        assert any("answers again" in r.getMessage() for r in caplog.records)


async def test_refused_credentials_leave_the_figures_unknown_and_say_what_the_user_needs(
        node: RabbitNode, names: Callable[[str], str],
        caplog: pytest.LogCaptureFixture) -> None:
    wrong = node.management_url.replace("guest:guest@", "guest:not-the-password@")
    adapter = RabbitMQAdapter(node.url, prefix=names("p"), management_url=wrong)
    topic, queue = names("orders"), names("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    for _ in range(2):
        assert (await adapter.subscription_stats(queue)).backlog is None
    [warned] = warnings_of(caplog)
    assert "HTTP 401" in warned and "'monitoring'" in warned
    assert "not-the-password" not in warned
    await adapter.close()


async def test_a_management_api_of_another_broker_is_not_believed(
        node: RabbitNode, names: Callable[[str], str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The queue is on the shared broker; the management API is the private node's, which
    lists no such queue: the figures are unknown, said once; a queue gone is still an
    UnknownSubscriptionError."""
    url = rabbitmq_url()
    adapter = RabbitMQAdapter(url, prefix=names("p"), management_url=node.management_url)
    topic, queue = names("orders"), names("billing")
    await adapter.ensure_subscription(topic, queue, ack_deadline=10)
    try:
        for _ in range(2):
            assert await adapter.subscription_stats(queue) == SubscriptionStats(
                None, None, None, 10.0)
        [warned] = warnings_of(caplog)
        assert "lists no queue" in warned and queue in warned
    finally:
        connection = await aio_pika.connect(url)
        channel = await connection.channel()
        for name in (queue, f"{names('p')}.settings.{queue}"):
            await channel.queue_delete(name)
        await channel.exchange_delete(topic)
        await connection.close()
    with pytest.raises(UnknownSubscriptionError, match="gone"):
        await adapter.subscription_stats(queue)
    await adapter.close()


# -- construction ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("management_url", "says"), [
    (15672, "must be a str"),
    (b"http://127.0.0.1:15672/", "must be a str"),
    ("amqp://guest:secret@127.0.0.1:5672/", "is not an http:// or https:// URL"),
    ("127.0.0.1:15672", "is not an http:// or https:// URL"),
    ("http://guest:secret@127.0.0.1:99999/", "not a number from 1 to 65535"),
    ("http://guest:secret@127.0.0.1:0/", "not a number from 1 to 65535"),
    ("http://:15672/", "must name a host"),
    ("http://guest:secret@127.0.0.1:15672/?vhost=a", "no query or fragment"),
])
def test_a_management_url_that_is_no_http_url_is_refused_naming_the_fix(
        management_url: Any, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RabbitMQAdapter(management_url=management_url)
    message = str(refused.value)
    assert "RabbitMQAdapter.management_url" in message and says in message
    assert "http://guest:guest@127.0.0.1:15672/" in message, "an example of what to give"
    assert "secret" not in message, "no password in the message"


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), "5", True])
def test_a_management_timeout_that_is_no_positive_number_is_refused(timeout: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"management_timeout must be seconds > 0"):
        RabbitMQAdapter(management_url="http://127.0.0.1:15672/", management_timeout=timeout)
