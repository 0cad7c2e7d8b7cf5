"""MemoryAdapter behaviour beyond the conformance suite: threads, errors, retention."""

from __future__ import annotations

import asyncio
import threading

import pytest

from reliable_sub import ConfigurationError, UnknownSubscriptionError, UnknownTopicError
from reliable_sub.adapters.base import Adapter
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.clock import ManualClock


def test_it_satisfies_the_adapter_protocol() -> None:
    assert isinstance(MemoryAdapter(), Adapter)


async def test_publish_sync_from_other_threads_wakes_a_waiting_receiver() -> None:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("t", "s")
    receiving = asyncio.ensure_future(broker.receive("s", 100, timeout=30))
    await asyncio.sleep(0)
    threads = [
        threading.Thread(target=lambda i=i: [broker.publish_sync("t", f"{i}-{j}".encode())
                                             for j in range(50)])
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    first = await asyncio.wait_for(receiving, timeout=10)
    for thread in threads:
        thread.join()
    got = first + await broker.receive("s", 1000, timeout=0)
    assert len(got) == 200
    assert len({d.message.id for d in got}) == 200


async def test_unknown_names_and_bad_input_get_clear_errors() -> None:
    broker = MemoryAdapter()
    with pytest.raises(UnknownSubscriptionError, match="'nope' does not exist"):
        await broker.receive("nope", 1, 0)
    with pytest.raises(UnknownTopicError, match="topic 'missing' does not exist"):
        await broker.publish("missing", b"x")
    broker.ensure_subscription_sync("t", "s")
    with pytest.raises(TypeError, match="data must be bytes"):
        broker.publish_sync("t", "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="attributes must map str to str"):
        broker.publish_sync("t", b"x", {"n": 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="ack_deadline"):
        broker.ensure_subscription_sync("t", "s2", ack_deadline=0)
    with pytest.raises(ConfigurationError, match="unknown options"):
        broker.ensure_subscription_sync("t", "s3", dead_letter="x")
    with pytest.raises(ConfigurationError, match="already exists on topic 't'"):
        broker.ensure_subscription_sync("other", "s")


async def test_acked_messages_are_retained_when_asked() -> None:
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync("t", "kept", retain_acked_messages=True, message_retention=60)
    broker.ensure_subscription_sync("t", "dropped")
    await broker.publish("t", b"x")
    for sub in ("kept", "dropped"):
        await broker.ack(await broker.receive(sub, 10, 0))
    assert [m.data for m in broker.retained("kept")] == [b"x"]
    assert broker.retained("dropped") == []
    clock.advance(61)
    assert broker.retained("kept") == []


async def test_without_ordering_keys_do_not_serialize_delivery() -> None:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("t", "s")
    for i in range(3):
        await broker.publish("t", f"{i}".encode(), ordering_key="k")
    assert len(await broker.receive("s", 10, 0)) == 3


async def test_close_wakes_waiting_receivers() -> None:
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("t", "s")
    receiving = asyncio.ensure_future(broker.receive("s", 1, timeout=60))
    await asyncio.sleep(0)
    await broker.close()
    assert await asyncio.wait_for(receiving, timeout=5) == []


async def test_a_model_a_dataclass_or_a_json_value_is_published_as_json() -> None:
    import dataclasses

    import pydantic

    class Placed(pydantic.BaseModel):
        order: int

    @dataclasses.dataclass
    class Cancelled:
        order: int

    broker = MemoryAdapter()
    broker.ensure_subscription_sync("t", "s")
    await broker.publish("t", Placed(order=1))
    broker.publish_sync("t", Cancelled(order=2), {"content-type": "application/vnd.x+json"})
    await broker.publish("t", [1, "two"])
    got = await broker.receive("s", 10, 0)
    assert [d.message.data for d in got] == [b'{"order":1}', b'{"order":2}', b'[1,"two"]']
    assert [d.message.attributes["content-type"] for d in got] == [
        "application/json", "application/vnd.x+json", "application/json"]


def test_a_changed_ack_deadline_is_warned_about_not_taken(caplog) -> None:
    """``ensure_subscription`` keeps an existing subscription's deadline; it used to ignore
    another one asked for without a word (#44)."""
    import logging

    from reliable_sub.adapters.memory import MemoryAdapter

    broker = MemoryAdapter()
    broker.ensure_subscription_sync("orders", "billing", ack_deadline=5)
    with caplog.at_level(logging.WARNING):
        broker.ensure_subscription_sync("orders", "billing")  # says nothing of the deadline
        assert not caplog.records
        broker.ensure_subscription_sync("orders", "billing", ack_deadline=30)
    [record] = caplog.records
    assert "keeps its ack deadline of 5s, not the 30s asked for" in record.getMessage()
