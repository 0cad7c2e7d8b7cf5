"""Seek, snapshots and the two replay modes (adapters whose capabilities say ``seek``)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

from reliable_sub import Message, Outcome
from reliable_sub.errors import SnapshotExistsError, UnknownSnapshotError
from reliable_sub.message import Delivery
from reliable_sub.ports import Adapter, Seekable
from reliable_sub.replay import ReplayMode, seek
from reliable_sub.testing.harness import Harness


async def seekable(harness: Harness) -> tuple[Seekable, Adapter, str, str]:
    """The adapter twice (as Seekable and as Adapter), a topic and a subscription that retains
    acked messages."""
    adapter = await harness.adapter()
    if not adapter.capabilities.seek:
        pytest.skip(f"{harness.name} cannot seek")
    assert isinstance(adapter, Seekable), "Capabilities.seek is true: implement Seekable"
    topic, sub = await harness.topic_and_subscription(retain_acked_messages=True)
    return adapter, adapter, topic, sub


async def receive_all(harness: Harness, adapter: Adapter, sub: str, count: int) -> list[Delivery]:
    """``count`` deliveries, acked; then nothing more within a tick."""
    deliveries: list[Delivery] = []
    while len(deliveries) < count:
        batch = await harness.receive(adapter, sub, timeout=2 * harness.ack_deadline)
        assert batch, f"only {len(deliveries)} of {count} delivered"
        deliveries += batch
    assert await adapter.ack(deliveries) == []
    assert await harness.receive(adapter, sub, timeout=harness.tick) == []
    return deliveries


def published(delivery: Delivery) -> datetime:
    assert delivery.message.publish_time is not None, "an adapter that seeks has publish times"
    return delivery.message.publish_time


def payloads(deliveries: list[Delivery]) -> list[bytes]:
    return sorted(delivery.message.data for delivery in deliveries)


async def test_seek_to_a_time_redelivers_what_was_published_from_then_on(
    harness: Harness,
) -> None:
    seeker, adapter, topic, sub = await seekable(harness)
    for data in (b"a1", b"a2"):
        await adapter.publish(topic, data)
    early = await receive_all(harness, adapter, sub, 2)
    await harness.pass_time(harness.tick)  # publish times at least a tick apart
    for data in (b"b1", b"b2"):
        await adapter.publish(topic, data)
    late = await receive_all(harness, adapter, sub, 2)
    cut = min(published(delivery) for delivery in late)
    assert all(published(delivery) < cut for delivery in early)

    await seeker.seek(sub, to=cut)

    again = await receive_all(harness, adapter, sub, 2)
    assert payloads(again) == [b"b1", b"b2"], "acked messages from the time on come back"
    assert {d.message.id for d in again} == {d.message.id for d in late}


async def test_seek_to_a_future_time_acknowledges_the_backlog(harness: Harness) -> None:
    seeker, adapter, topic, sub = await seekable(harness)
    for data in (b"old-1", b"old-2"):
        await adapter.publish(topic, data)
    [*taken] = await harness.receive(adapter, sub, timeout=harness.tick, max_messages=1)

    await seeker.seek(sub, to=datetime.now(timezone.utc) + timedelta(days=1))

    assert await harness.receive(adapter, sub, timeout=harness.tick) == []
    if harness.features.refuses_stale_acks:
        assert await adapter.ack(taken) == taken, "a delivery in flight at the seek is stale"
    await adapter.publish(topic, b"new")
    [fresh] = await receive_all(harness, adapter, sub, 1)
    assert fresh.message.data == b"new", "what is published after the seek is delivered"


async def test_seek_to_a_snapshot_brings_back_its_unacked_messages_and_later_ones(
    harness: Harness,
) -> None:
    seeker, adapter, topic, sub = await seekable(harness)
    await adapter.publish(topic, b"before")
    await receive_all(harness, adapter, sub, 1)
    await adapter.publish(topic, b"unacked")
    name = harness.name_for("snap")

    snapshot = await seeker.create_snapshot(sub, name)
    assert (snapshot.name, snapshot.subscription) == (name, sub)
    assert name in [found.name for found in await seeker.list_snapshots(sub)]
    await receive_all(harness, adapter, sub, 1)
    await adapter.publish(topic, b"after")
    await receive_all(harness, adapter, sub, 1)

    await seeker.seek(sub, snapshot=name)

    again = await receive_all(harness, adapter, sub, 2)
    assert payloads(again) == [b"after", b"unacked"]
    with pytest.raises(SnapshotExistsError):
        await seeker.create_snapshot(sub, name)
    await seeker.delete_snapshot(name)
    assert name not in [found.name for found in await seeker.list_snapshots()]
    with pytest.raises(UnknownSnapshotError):
        await seeker.seek(sub, snapshot=name)


@pytest.mark.parametrize("mode", [ReplayMode.SKIP_PROCESSED, ReplayMode.REPROCESS])
async def test_a_replay_skips_or_reprocesses_what_the_store_recorded(
    harness: Harness, mode: ReplayMode
) -> None:
    """With a Subscriber running: skip-processed only fills gaps (the replayed messages end as
    duplicates, no effect runs twice); reprocess runs every replayed message once more."""
    _, adapter, topic, sub = await seekable(harness)
    store = harness.dedup_store()
    effects: Counter[bytes] = Counter()
    published_at: list[datetime] = []
    outcomes: Counter[Outcome] = Counter()
    subscriber = harness.subscriber(
        adapter, dedup=store, on_outcome=lambda message, outcome: outcomes.update([outcome]))

    @subscriber.handler(sub)
    async def charge(message: Message) -> None:
        effects[message.data] += 1
        assert message.publish_time is not None
        published_at.append(message.publish_time)

    published = [b"order-1", b"order-2", b"order-3"]
    async with harness.serving(subscriber):
        for data in published:
            await adapter.publish(topic, data)
        await harness.wait_until(lambda: outcomes[Outcome.ACKED] == 3,
                                 3 * harness.ack_deadline, "first run")

        result = await seek(adapter, sub, to=min(published_at), mode=mode, dedup=store)

        if mode is ReplayMode.SKIP_PROCESSED:
            assert result.epoch is None
            await harness.wait_until(lambda: outcomes[Outcome.DUPLICATE] == 3,
                                     3 * harness.ack_deadline, "replay")
            assert effects == Counter(published), "each effect once"
        else:
            assert result.epoch == 1
            await harness.wait_until(lambda: outcomes[Outcome.ACKED] == 6,
                                     3 * harness.ack_deadline, "replay")
            assert effects == Counter(published * 2), "each effect once more"


async def test_a_snapshot_keeps_what_was_published_after_it_without_retention(
    harness: Harness,
) -> None:
    """A snapshot keeps its unacked messages and those published after it even on a
    subscription that does not retain acked messages (as Pub/Sub's do)."""
    adapter = await harness.adapter()
    if not isinstance(adapter, Seekable) or not adapter.capabilities.seek:
        pytest.skip(f"{harness.name} cannot seek")
    topic, sub = await harness.topic_and_subscription()
    await adapter.publish(topic, b"unacked")
    name = harness.name_for("snap")
    await adapter.create_snapshot(sub, name)
    await adapter.publish(topic, b"after")
    await receive_all(harness, adapter, sub, 2)

    await adapter.seek(sub, snapshot=name)

    assert payloads(await receive_all(harness, adapter, sub, 2)) == [b"after", b"unacked"]
    await adapter.delete_snapshot(name)


__all__ = [
    "test_a_replay_skips_or_reprocesses_what_the_store_recorded",
    "test_a_snapshot_keeps_what_was_published_after_it_without_retention",
    "test_seek_to_a_future_time_acknowledges_the_backlog",
    "test_seek_to_a_snapshot_brings_back_its_unacked_messages_and_later_ones",
    "test_seek_to_a_time_redelivers_what_was_published_from_then_on",
]
