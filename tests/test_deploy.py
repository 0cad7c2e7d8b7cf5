"""A rolling deploy must not double an effect (issue #7's reproduction, as a test).

Consumer processes run ``sub.run()`` on Redis Streams with a RedisDedupStore and a backlog of
slow sync handlers. Each is stopped with SIGTERM mid-backlog, and another is started, as a
deployment replaces pods; the effect of every order is counted outside the consumers (a Redis
hash, written by the handler). Every order must be charged exactly once, none lost, nothing
left pending, and every consumer must exit 0 after its graceful stop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import textwrap
import uuid
from pathlib import Path

import pytest

from reliable_sub.testing.services import redis_url
from tests.redis_processes import EXIT_TIMEOUT, Child, poll_until

if importlib.util.find_spec("redis") is None and os.environ.get("CI", "").lower() != "true":
    pytest.skip('the Redis tests need pip install "reliable-sub[redis]"', allow_module_level=True)

import redis.asyncio as aioredis

ORDERS = 150
# A charge takes this long in the handler's thread: long enough that a SIGTERM always finds
# handlers running and deliveries queued behind them.
CHARGE_SECONDS = 0.3
WORKERS = 8
WITHIN = 60.0

CONSUMER = textwrap.dedent(
    """
    import json, logging, sys, time

    import redis

    from reliable_sub import LeasePolicy, Message, Subscriber
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.dedup import RedisDedupStore

    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="LOG %(levelname)s %(message)s")
    effects = redis.Redis.from_url(cfg["url"])
    adapter = RedisStreamsAdapter(cfg["url"], consumer=cfg["consumer"], key_prefix=cfg["prefix"])
    sub = Subscriber(adapter, dedup=RedisDedupStore(cfg["url"], prefix=cfg["prefix"] + ":dedup"),
                     sync_workers=cfg["workers"], lease=LeasePolicy(min_extension=2))

    @sub.handler(cfg["subscription"])
    def charge(message: Message) -> dict:
        order = json.loads(message.data)["order"]
        time.sleep(cfg["charge_seconds"])  # the payment provider's call
        effects.hincrby(cfg["effects"], order, 1)
        return {"charged": order}

    print("READY", flush=True)
    sub.run()
    print("EXITED", json.dumps({k.value: n for k, n in sub.stats.outcomes.items()}), flush=True)
    """
)


@pytest.fixture
async def redis_names(tmp_path: Path):
    url = redis_url()
    prefix = f"test-deploy-{uuid.uuid4().hex[:10]}"
    client = aioredis.Redis.from_url(url)
    try:
        yield url, prefix, client
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_sigterm_mid_backlog_then_restart_charges_every_order_exactly_once(
    redis_names, tmp_path: Path
) -> None:
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

    url, prefix, client = redis_names
    stream, subscription, effects = f"{prefix}:orders", "billing", f"{prefix}:effects"
    admin = RedisStreamsAdapter(url, key_prefix=prefix)
    await admin.ensure_subscription(stream, subscription, ack_deadline=5.0)
    for order in range(ORDERS):
        await admin.publish(stream, json.dumps({"order": order}).encode(),
                            {"idempotency-key": f"order-{order}"})
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)

    def start(name: str) -> Child:
        settings = {"url": url, "prefix": prefix, "consumer": name, "workers": WORKERS,
                    "subscription": subscription, "effects": effects,
                    "charge_seconds": CHARGE_SECONDS}
        return Child(script, json.dumps(settings))

    async def charged() -> int:
        return len(await client.hgetall(effects))

    children: list[Child] = []
    try:
        # three deploys: each consumer is replaced by SIGTERM after a share of the backlog
        for generation in range(3):
            child = start(f"pod-{generation}")
            children.append(child)
            await child.line("READY")
            target = await charged() + 20  # this pod charges some, then it is replaced
            await poll_until(lambda n=target: _at_least(charged, n), f"{target} charged",
                             within=WITHIN)
            child.process.send_signal(signal.SIGTERM)
            exited = await child.line("EXITED", timeout=WITHIN)
            assert await asyncio.to_thread(child.process.wait, EXIT_TIMEOUT) == 0, child.output
            outcomes = json.loads(exited.split(" ", 1)[1])
            assert outcomes.get("stopped", 0) > 0, "it stopped with a backlog in flight"
        last = start("pod-final")
        children.append(last)
        await poll_until(lambda: _at_least(charged, ORDERS), "every order charged",
                         within=WITHIN)
        last.process.send_signal(signal.SIGTERM)
        await last.line("EXITED", timeout=WITHIN)
        assert await asyncio.to_thread(last.process.wait, EXIT_TIMEOUT) == 0, last.output
    finally:
        for child in children:
            child.kill()
    counts = {int(k): int(v) for k, v in (await client.hgetall(effects)).items()}
    doubled = {order: n for order, n in counts.items() if n != 1}
    assert doubled == {}, f"orders charged more than once: {doubled}"
    assert sorted(counts) == list(range(ORDERS)), "an order was never charged"
    assert (await client.xpending(stream, subscription))["pending"] == 0
    for child in children:
        assert "stop requested" in child.output and "drained" in child.output, child.output
        assert "Traceback" not in child.output, child.output
    await admin.close()


async def _at_least(count, n: int) -> bool:  # type: ignore[no-untyped-def]
    return bool(await count() >= n)
