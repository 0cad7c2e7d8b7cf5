"""Per-handler retry and dead-letter policies: each handler's own where it gave them, the
Subscriber's otherwise, checked at registration."""

from __future__ import annotations

import pytest

from reliable_sub import (
    ConfigurationError,
    DeadLetterPolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
    UnknownTopicError,
)
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serve_until, serving, setup


async def test_each_handler_fails_by_its_own_policies() -> None:
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 4),
                               retry=RetryPolicy(min_backoff=1, max_backoff=2))
    broker.ensure_subscription_sync("orders-dlq", "orders-dlq-ops")
    broker.ensure_subscription_sync("shipments", "shipping")
    broker.ensure_subscription_sync("shipments-dlq", "shipments-dlq-ops")
    broker.ensure_subscription_sync("refunds", "refunding")
    calls: dict[str, list[float]] = {"billing": [], "shipping": [], "refunding": []}

    @sub.handler("billing")
    async def bill(message: Message) -> None:
        calls["billing"].append(clock.now())
        raise KeyError("sku")

    @sub.handler("shipping", dead_letter=DeadLetterPolicy("shipments-dlq", 2),
                 retry=RetryPolicy(min_backoff=30, max_backoff=30))
    async def ship(message: Message) -> None:
        calls["shipping"].append(clock.now())
        raise KeyError("address")

    @sub.handler("refunding", non_retryable=(KeyError,))
    async def refund(message: Message) -> None:
        calls["refunding"].append(clock.now())
        raise KeyError("account")

    for topic in ("orders", "shipments", "refunds"):
        broker.publish_sync(topic, b"x")
    await serve_until(sub, lambda: sub.stats[Outcome.DEAD_LETTERED] == 3, "three dead letters",
                      600, clock)
    assert [len(calls[name]) for name in ("billing", "shipping", "refunding")] == [4, 2, 1]
    assert calls["shipping"][1] - calls["shipping"][0] >= 30, "the handler's own backoff"
    assert calls["billing"][1] - calls["billing"][0] < 30, "the Subscriber's backoff"
    assert sub.stats["rejected"] == 1
    assert len(await broker.receive("orders-dlq-ops", 10, 0)) == 2  # billing's and refunding's
    [shipped] = await broker.receive("shipments-dlq-ops", 10, 0)
    assert shipped.message.attributes["original-subscription"] == "shipping"


async def test_a_handler_s_dead_letter_topic_must_exist_at_start() -> None:
    _, _, sub = setup()

    @sub.handler("billing", dead_letter=DeadLetterPolicy("nowhere"))
    async def bill(message: Message) -> None: ...

    with pytest.raises(UnknownTopicError, match="'nowhere' does not exist"):
        await sub.serve()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"retry": "3 times"}, r"handler 'billing' retry must be a RetryPolicy.*RetryPolicy\("),
        ({"dead_letter": "dlq"}, r"dead_letter must be a DeadLetterPolicy.*DeadLetterPolicy\("),
        ({"non_retryable": [KeyError]}, r"non_retryable must be a tuple of exception types"),
        ({"non_retryable": (KeyError, "ValueError")}, r"non_retryable must be a tuple"),
        ({"in_process_retry": 0}, r"in_process_retry must be an int in \[1, inf\), got 0"),
        ({"in_process_retry": "3"}, r"in_process_retry must be an int"),
    ],
)
def test_wrong_handler_policies_are_refused_at_registration(options: dict, error: str) -> None:
    _, _, sub = setup()
    with pytest.raises(ConfigurationError, match=error):
        sub.handler("billing", **options)


def test_a_handler_s_policies_must_fit_the_dedup_window() -> None:
    _, _, sub = setup(dedup=MemoryDedupStore(), dedup_ttl=4000,
                      dead_letter=DeadLetterPolicy("orders-dlq", 3))
    with pytest.raises(ConfigurationError, match=r"handler 'billing': Subscriber\.dedup_ttl=4000s"):
        sub.handler("billing", retry=RetryPolicy(min_backoff=3600, max_backoff=3600))
    sub.handler("billing", retry=RetryPolicy(min_backoff=1, max_backoff=2))(lambda m: None)


async def test_a_handler_s_timeout_is_its_own_max_lease_duration() -> None:
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 1))
    broker.ensure_subscription_sync("orders-dlq", "orders-dlq-ops")
    broker.ensure_subscription_sync("shipments", "shipping")
    finished: list[str] = []

    @sub.handler("billing", timeout=20)
    async def bill(message: Message) -> None:
        await clock.sleep(100)
        finished.append("billing")

    @sub.handler("shipping")
    async def ship(message: Message) -> None:
        await clock.sleep(100)
        finished.append("shipping")

    broker.publish_sync("orders", b"x")
    broker.publish_sync("shipments", b"x")
    settled = (Outcome.ACKED, Outcome.DEAD_LETTERED)
    await serve_until(sub, lambda: [sub.stats[o] for o in settled] == [1, 1], "both settled",
                      600, clock)
    assert finished == ["shipping"]
    [dead] = await broker.receive("orders-dlq-ops", 10, 0)
    assert dead.message.attributes["error-type"] == "reliable_sub.errors.HandlerTimeoutError"
    assert "max_lease_duration=20s" in dead.message.attributes["error-message"]


@pytest.mark.parametrize(("timeout", "error"), [
    ("5", "timeout must be a number of seconds"),
    (True, "timeout must be a number of seconds"),
    (-1, "handler 'billing' timeout: LeasePolicy.max_lease_duration"),
])
def test_a_wrong_timeout_is_refused_at_registration(timeout: object, error: str) -> None:
    _, _, sub = setup()
    with pytest.raises(ConfigurationError, match=error):
        sub.handler("billing", timeout=timeout)  # type: ignore[arg-type]


async def test_max_concurrency_bounds_one_handler_s_messages_in_flight() -> None:
    import asyncio

    from reliable_sub.testing.timing import pass_time

    clock, broker, sub = setup()
    broker.ensure_subscription_sync("shipments", "shipping")
    release = asyncio.Event()
    running = {"billing": 0, "shipping": 0}
    peak = dict(running)

    async def work(name: str) -> None:
        running[name] += 1
        peak[name] = max(peak[name], running[name])
        await release.wait()
        running[name] -= 1

    @sub.handler("billing", max_concurrency=2)
    async def bill(message: Message) -> None:
        await work("billing")

    @sub.handler("shipping")
    async def ship(message: Message) -> None:
        await work("shipping")

    for _ in range(6):
        broker.publish_sync("orders", b"x")
        broker.publish_sync("shipments", b"x")
    task = await serving(sub, clock)
    try:
        await drive_until(clock, lambda: running == {"billing": 2, "shipping": 6}, 60,
                          what="both handlers' messages to start")
        await pass_time(clock, 30)  # receive loops go round: billing's stays at its bound
        assert peak == {"billing": 2, "shipping": 6}
        release.set()
        await drive_until(clock, lambda: sub.stats[Outcome.ACKED] == 12, 60, what="all acked")
    finally:
        release.set()
        await sub.shutdown()
        await task


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_a_wrong_max_concurrency_is_refused_at_registration(value: object) -> None:
    _, _, sub = setup()
    with pytest.raises(ConfigurationError, match="max_concurrency must be an int >= 1 or None"):
        sub.handler("billing", max_concurrency=value)  # type: ignore[arg-type]


async def test_in_process_retry_is_the_handler_s_own() -> None:
    clock, broker, sub = setup()
    broker.ensure_subscription_sync("shipments", "shipping")
    calls = {"billing": 0, "shipping": 0}

    @sub.handler("billing", in_process_retry=3)
    async def bill(message: Message) -> None:
        calls["billing"] += 1
        if calls["billing"] < 3:
            raise ConnectionError("blip")

    @sub.handler("shipping")  # the Subscriber's: one call per delivery
    async def ship(message: Message) -> None:
        calls["shipping"] += 1
        if calls["shipping"] < 3:
            raise ConnectionError("blip")

    broker.publish_sync("orders", b"x")
    broker.publish_sync("shipments", b"x")
    await serve_until(sub, lambda: sub.stats[Outcome.ACKED] == 2, "two acks", 600, clock)
    assert calls == {"billing": 3, "shipping": 3}
    assert sub.stats[Outcome.RETRY] == 2  # shipping's two failed deliveries; billing's none


@pytest.mark.parametrize("timeout", [3.0, 9.0])
async def test_a_timeout_shorter_than_the_ack_deadline_cuts_the_handler_when_it_ends(
        timeout: float) -> None:
    """The memory broker's deadline is 10 s. The lease manager looked at a delivery's maximum
    duration only when its lease fell due for extension (8 s): ``timeout=3`` cut at 8 s, and
    ``timeout=9`` at 8 s too, a second early. Now within a tick of the limit, either way."""
    import asyncio

    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 1))
    started: list[float] = []
    cut: list[float] = []

    @sub.handler("billing", timeout=timeout)
    async def bill(message: Message) -> None:
        started.append(clock.now())
        try:
            await clock.sleep(100)
        except asyncio.CancelledError:
            cut.append(clock.now())
            raise

    broker.publish_sync("orders", b"x")
    await serve_until(sub, lambda: sub.stats[Outcome.DEAD_LETTERED] == 1, "the timeout", 60,
                      clock)
    [began], [ended] = started, cut
    assert timeout <= ended - began <= timeout + 0.1, (began, ended)


async def test_deferrals_and_store_failures_wait_by_the_handler_s_own_retry() -> None:
    """A message deferred behind a peer's claim, and one given back because the dedup store
    failed, waited by the Subscriber's RetryPolicy even where the handler had its own (here:
    two minutes instead of a second)."""
    from reliable_sub import DedupKey

    class FailingOnce(MemoryDedupStore):
        failed = False

        async def claim_many(self, keys, lease_ttl, tokens=None):  # type: ignore[no-untyped-def]
            if not self.failed and any(key.key == "2" for key in keys):
                self.failed = True
                raise ConnectionError("the store is restarting")
            return await super().claim_many(keys, lease_ttl, tokens)

    events = []
    store = FailingOnce()
    clock, broker, sub = setup(dedup=store, on_event=events.append,
                               retry=RetryPolicy(min_backoff=60, max_backoff=120))
    store._clock = clock
    sub.handler("billing", retry=RetryPolicy(min_backoff=0.5, max_backoff=1))(
        lambda message: None)
    namespace = broker.dedup_namespace("billing")
    await store.claim(DedupKey(namespace, "1"), 30)  # a peer runs message 1 for 30 s
    broker.publish_sync("orders", b"held by a peer")
    broker.publish_sync("orders", b"meets a failing store")
    await serve_until(sub, lambda: sub.stats[Outcome.DEFERRED] >= 1
                      and sub.stats[Outcome.RETRY] >= 1, "a deferral and a store failure",
                      300, clock)
    delays = {event.outcome: event.delay for event in events
              if event.outcome in (Outcome.DEFERRED, Outcome.RETRY)}
    assert delays[Outcome.DEFERRED] <= 1.0
    assert delays[Outcome.RETRY] <= 1.0
