"""The first hour's mistakes (#47) each get one error that names the fix: a decorator without
its parentheses, no adapter (the hint lists every adapter installed, from the entry points, so
it stays complete), and ``run()`` called where an event loop already runs."""

from __future__ import annotations

import asyncio
import uuid
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import sqlalchemy

from reliable_sub import ConfigurationError, Message, Subscriber
from reliable_sub._registry import adapter_names, installed
from reliable_sub.adapters.memory import MemoryAdapter

ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"


def test_a_handler_decorator_without_parentheses_says_how_to_write_it() -> None:
    sub = Subscriber(MemoryAdapter())
    with pytest.raises(ConfigurationError) as refused:

        @sub.handler  # type: ignore[arg-type]
        async def charge(message: Message) -> None:
            pass

    assert str(refused.value) == ('@handler needs the subscription\'s name: write '
                                  '@sub.handler("<subscription>") above charge, not @sub.handler')


def test_no_adapter_lists_every_adapter_installed() -> None:
    with pytest.raises(ConfigurationError) as refused:
        Subscriber(None)  # type: ignore[arg-type]
    text = str(refused.value)
    assert text.startswith("Subscriber(adapter) must be a broker adapter, got None")
    assert text.endswith("the adapters installed: MemoryAdapter, RedisStreamsAdapter, "
                         "PubSubAdapter, NatsJetStreamAdapter, RabbitMQAdapter, KafkaAdapter, "
                         "SqsAdapter")


def test_the_registry_names_every_shipped_adapter_module_and_each_loads() -> None:
    """Every public module of adapters/ but base.py is an entry point whose class exists, so
    the hint above cannot leave one out again (it left out RabbitMQ, Kafka and SQS)."""
    modules = {path.stem for path in ADAPTERS.glob("*.py")
               if not path.stem.startswith("_") and path.stem != "base"}
    points = {point.value.partition(":")[0].rpartition(".")[2]: point for point in installed()}
    assert set(points) >= modules, f"not in pyproject's entry points: {modules - set(points)}"
    for point in points.values():
        assert point.load().__name__ == point.value.rpartition(":")[2]
    assert len(adapter_names()) == len(points)


async def test_run_inside_a_running_loop_points_to_serve_and_leaves_no_coroutine() -> None:
    sub = Subscriber(MemoryAdapter())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would be one
        with pytest.raises(RuntimeError) as refused:
            sub.run()
    assert str(refused.value) == (
        "Subscriber.run() blocks and makes its own event loop, and this thread already runs "
        "one: inside async code, await sub.serve() (or start it as a task)")
    assert not sub.running
    await asyncio.sleep(0)


async def test_postgres_urls_are_taken_as_postgresql() -> None:
    """``postgres://`` (Heroku's and many platforms' form) was refused by the Outbox, the SQL
    store and the CLI ("supports postgresql, mariadb ... got 'postgres'")."""
    from reliable_sub.dedup import SqlDedupStore
    from reliable_sub.outbox import Outbox
    from reliable_sub.testing.services import postgres_url

    url = postgres_url().replace("postgresql://", "postgres://", 1)
    assert url.startswith("postgres://")
    tag = uuid.uuid4().hex[:8]
    outbox = Outbox(url, table=f"first_hour_outbox_{tag}")
    store = SqlDedupStore(url, table=f"first_hour_processed_{tag}")
    try:
        assert repr(outbox).startswith("Outbox(postgresql,")
        await outbox.create_schema()
        await store.create_schema()
    finally:
        await outbox.close()
        await store.close()
        engine = sqlalchemy.create_engine(postgres_url())
        with engine.begin() as connection:
            for table in (f"first_hour_outbox_{tag}", f"first_hour_processed_{tag}"):
                connection.execute(sqlalchemy.text(f"DROP TABLE IF EXISTS {table}"))
        engine.dispose()


def _one_handler(store: object) -> Subscriber:
    adapter = MemoryAdapter()
    adapter.ensure_subscription_sync("orders", "billing")
    sub = Subscriber(adapter, dedup=store)  # type: ignore[arg-type]

    @sub.handler("billing")
    async def charge(message: Message) -> None:
        pass

    return sub


async def test_a_dedup_store_that_cannot_be_reached_fails_the_start_as_a_broker_does() -> None:
    """One rule for both: a Subscriber starts only when its broker and its dedup store answer
    (it started silently with a store that refused, and failed every message after)."""
    from reliable_sub.dedup import RedisDedupStore, SqlDedupStore
    from reliable_sub.testing.services import free_port

    port = free_port()
    for store, named in ((RedisDedupStore(f"redis://127.0.0.1:{port}/0"), "RedisDedupStore("),
                         (SqlDedupStore(f"postgresql://postgres@127.0.0.1:{port}/test"),
                          "SqlDedupStore(postgresql")):
        sub = _one_handler(store)
        with pytest.raises(ConnectionError) as refused:
            await sub.serve()
        text = str(refused.value)
        assert text.startswith(f"the dedup store {named}") and "cannot be reached at start" in text
        assert text.endswith("; check its URL and that it runs") and str(port) in text
        assert not sub.running and "\n" not in text
        await store.close()


async def test_a_dedup_store_that_hangs_fails_the_start_after_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from reliable_sub._runtime import pipeline
    from reliable_sub.dedup import RedisDedupStore
    from reliable_sub.testing.services import redis_url
    from reliable_sub.testing.tcp_proxy import TcpProxy

    monkeypatch.setattr(pipeline, "STORE_START_TIMEOUT", 0.5)
    redis = urlsplit(redis_url())
    with TcpProxy(redis.hostname or "127.0.0.1", redis.port or 6379) as proxy:
        proxy.stall()
        store = RedisDedupStore(f"redis://127.0.0.1:{proxy.port}/0")
        with pytest.raises(ConnectionError, match=r"did not answer within 0\.5s at start; check "
                                                  r"its URL and that it runs"):
            await _one_handler(store).serve()
        proxy.resume()
        await store.close()
