"""Quickstart: the reliable-sub guarantees, shown on the in-memory broker in a few seconds.

One ``charge`` handler consumes the ``billing`` subscription of the ``orders`` topic. Five orders
show the five things that page people at night:

* A-1   a normal order: handled once, acked;
* A-1'  the same charge published again (same ``idempotency-key``): skipped, the handler is not
        called a second time;
* B-2   a transient failure (the gateway times out on attempt 1): redelivered after a backoff,
        succeeds on attempt 2;
* C-3   a poison message (fails every time): dead-lettered after 3 attempts, then read back from
        the dead-letter subscription;
* D-4   a slow handler (3 s against a 1 s ack deadline): kept alive by lease extensions,
        delivered exactly once.

Run it with ``python examples/quickstart.py``. It exits with status 1 if any of these did not
happen as described, so CI can run it as a check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from reliable_sub import (
    DeadLetterPolicy,
    LeasePolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.adapters.memory import MemoryAdapter

TOPIC = "orders"
SUBSCRIPTION = "billing"
DEAD_LETTER_TOPIC = "orders-dead-letter"
DEAD_LETTER_SUBSCRIPTION = "orders-dead-letter-inspect"

# Short durations so the whole run takes a few seconds of real time.
ACK_DEADLINE = 1.0  # seconds the broker gives a fresh delivery before redelivering it
SLOW_HANDLER_SECONDS = 3.0  # three ack deadlines: without lease extension it would be redelivered
MAX_ATTEMPTS = 3
WAIT_LIMIT = 10.0  # seconds to wait for each expected outcome before declaring failure
POLL_INTERVAL = 0.02


class Journal:
    """What happened, recorded from the handler threads and the Subscriber's event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: dict[str, list[int]] = defaultdict(list)  # order id -> delivery attempts
        self.outcomes: dict[str, list[Outcome]] = defaultdict(list)  # order id -> outcomes

    def call(self, order_id: str, attempt: int) -> None:
        with self._lock:
            self.calls[order_id].append(attempt)

    def outcome(self, message: Message, outcome: Outcome) -> None:
        order_id = json.loads(message.data)["id"]
        with self._lock:
            self.outcomes[order_id].append(outcome)
        say(f"  {order_id}: delivery attempt {message.delivery_attempt} -> {outcome.value}")

    def outcomes_of(self, order_id: str) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes[order_id])

    def calls_of(self, order_id: str) -> list[int]:
        with self._lock:
            return list(self.calls[order_id])


_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def wait_until(condition: Callable[[], bool], what: str) -> bool:
    """Poll ``condition`` until it holds or WAIT_LIMIT passes; report a timeout."""
    give_up_at = time.monotonic() + WAIT_LIMIT
    while time.monotonic() < give_up_at:
        if condition():
            return True
        time.sleep(POLL_INTERVAL)
    say(f"  timed out after {WAIT_LIMIT:g}s waiting for {what}")
    return False


def publish(broker: MemoryAdapter, order: dict[str, object], **attributes: str) -> None:
    broker.publish_sync(TOPIC, json.dumps(order).encode(), attributes)


def read_dead_letters(broker: MemoryAdapter) -> list[Message]:
    """Receive (and ack) whatever is on the dead-letter subscription."""

    async def receive() -> list[Message]:
        deliveries = await broker.receive(DEAD_LETTER_SUBSCRIPTION, 10, timeout=1.0)
        await broker.ack(deliveries)
        return [delivery.message for delivery in deliveries]

    return asyncio.run(receive())


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="  (log %(levelname)s) %(message)s")
    journal = Journal()
    failures: list[str] = []

    def check(ok: bool, description: str) -> None:
        say(f"{'ok  ' if ok else 'FAIL'} {description}")
        if not ok:
            failures.append(description)

    broker = MemoryAdapter()
    broker.ensure_subscription_sync(TOPIC, SUBSCRIPTION, ack_deadline=ACK_DEADLINE)
    broker.ensure_subscription_sync(DEAD_LETTER_TOPIC, DEAD_LETTER_SUBSCRIPTION)

    sub = Subscriber(
        broker,
        dedup=MemoryDedupStore(),
        lease=LeasePolicy(min_extension=ACK_DEADLINE, max_lease_duration=60.0),
        retry=RetryPolicy(min_backoff=0.2, max_backoff=1.0),
        dead_letter=DeadLetterPolicy(DEAD_LETTER_TOPIC, max_delivery_attempts=MAX_ATTEMPTS),
        # Must outlive the longest redelivery span (backoffs + max_lease_duration), else the
        # Subscriber refuses to start with a ConfigurationError.
        dedup_ttl=3600.0,
        on_outcome=journal.outcome,
    )

    @sub.handler(SUBSCRIPTION)
    def charge(message: Message) -> dict[str, str]:
        """A sync handler: runs in a worker thread; its return value is stored as JSON."""
        order = json.loads(message.data)
        journal.call(order["id"], message.delivery_attempt)
        behaviour = order.get("behaviour", "ok")
        if behaviour == "flaky" and message.delivery_attempt == 1:
            raise ConnectionError("payment gateway timed out")
        if behaviour == "poison":
            raise ValueError(f"order {order['id']} has no amount")
        if behaviour == "slow":
            time.sleep(SLOW_HANDLER_SECONDS)
        return {"charged": order["id"]}

    sub.start()
    started = time.monotonic()
    try:
        say(f"D-4: slow handler ({SLOW_HANDLER_SECONDS:g}s, ack deadline {ACK_DEADLINE:g}s)")
        publish(broker, {"id": "D-4", "amount": 40, "behaviour": "slow"})

        say("A-1: normal order")
        publish(broker, {"id": "A-1", "amount": 10}, **{"idempotency-key": "charge-A-1"})
        wait_until(lambda: Outcome.ACKED in journal.outcomes_of("A-1"), "A-1 to be acked")

        say("A-1 again: same idempotency-key, published after the first was handled")
        publish(broker, {"id": "A-1", "amount": 10}, **{"idempotency-key": "charge-A-1"})

        say("B-2: transient failure on attempt 1")
        publish(broker, {"id": "B-2", "amount": 20, "behaviour": "flaky"})

        say(f"C-3: poison message (fails every attempt; dead-lettered after {MAX_ATTEMPTS})")
        publish(broker, {"id": "C-3", "amount": 30, "behaviour": "poison"})

        wait_until(lambda: Outcome.DUPLICATE in journal.outcomes_of("A-1"), "A-1 duplicate")
        wait_until(lambda: Outcome.ACKED in journal.outcomes_of("B-2"), "B-2 to be acked")
        wait_until(lambda: Outcome.DEAD_LETTERED in journal.outcomes_of("C-3"), "C-3 dead-lettered")
        wait_until(lambda: Outcome.ACKED in journal.outcomes_of("D-4"), "D-4 to be acked")

        dead = read_dead_letters(broker)
        for message in dead:
            say(
                f"  dead letter {json.loads(message.data)['id']}: "
                f"error-type={message.attributes.get('error-type')} "
                f"delivery-attempts={message.attributes.get('delivery-attempts')} "
                f"error-message={message.attributes.get('error-message')!r}"
            )
        lease_stats = sub.lease_manager(SUBSCRIPTION).stats
        say(
            f"  lease manager: {lease_stats.extend_calls} extend calls "
            f"({lease_stats.extended_ack_ids} ack ids extended)"
        )
    finally:
        sub.stop(timeout=5.0)
    elapsed = time.monotonic() - started

    say("")
    say(f"summary (after {elapsed:.1f}s):")
    check(
        journal.outcomes_of("A-1") == [Outcome.ACKED, Outcome.DUPLICATE]
        and journal.calls_of("A-1") == [1],
        "A-1 handled once; its duplicate was acked without calling the handler",
    )
    check(
        journal.outcomes_of("B-2") == [Outcome.RETRY, Outcome.ACKED]
        and journal.calls_of("B-2") == [1, 2],
        "B-2 failed on attempt 1 and succeeded on attempt 2",
    )
    check(
        journal.outcomes_of("C-3") == [Outcome.RETRY, Outcome.RETRY, Outcome.DEAD_LETTERED]
        and journal.calls_of("C-3") == [1, 2, 3],
        f"C-3 dead-lettered after {MAX_ATTEMPTS} attempts",
    )
    check(
        len(dead) == 1
        and dead[0].attributes.get("error-type") == "builtins.ValueError"
        and dead[0].attributes.get("delivery-attempts") == str(MAX_ATTEMPTS),
        "the dead-letter copy of C-3 names the error and the attempts",
    )
    check(
        journal.outcomes_of("D-4") == [Outcome.ACKED] and journal.calls_of("D-4") == [1],
        "D-4 was delivered once although it ran for three ack deadlines",
    )
    check(lease_stats.extend_calls >= 1, "the lease manager extended D-4's deadline")
    if failures:
        say(f"{len(failures)} expectation(s) failed")
        return 1
    say("all expectations met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
