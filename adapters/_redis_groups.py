"""Creating a subscription's consumer group on a Redis stream (``ensure_subscription``), and
counting what a group created at ``start="$"`` skips.

A group created at ``"$"`` delivers only entries added after it, as a new Pub/Sub subscription
gets only messages published after it (and as redis-py's ``xgroup_create`` and FastStream's
``StreamSub`` default to). What the stream held already is never delivered to it, which a first
trial ("publish five, then start the consumer") reads as messages lost; the adapter says so,
with the count, when it creates such a group.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError

from reliable_sub._redis_clients import AsyncClient, SyncClient


async def create_group(
    client: AsyncClient, stream: str, group: str, start: str, *, cluster: bool
) -> int | None:
    """Create ``group`` on ``stream`` at ``start`` (MKSTREAM); an existing group is left as it
    is. Returns, for a group created now at ``"$"``, how many entries the stream held then (the
    ones it will never deliver); None otherwise."""
    if start != "$":
        try:
            await client.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as error:
            raise_unless_group_exists(error)
        return None
    if cluster:  # one after the other: an entry added between them is counted too
        try:
            await client.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as error:
            raise_unless_group_exists(error)
            return None
        return int(await client.xlen(stream))
    async with client.pipeline(transaction=True) as pipe:
        pipe.xgroup_create(stream, group, id=start, mkstream=True)
        pipe.xlen(stream)
        created, length = await pipe.execute(raise_on_error=False)
    return _skipped(created, length)


def create_group_sync(
    client: SyncClient, stream: str, group: str, start: str, *, cluster: bool
) -> int | None:
    """Blocking twin of :func:`create_group`."""
    if start != "$":
        try:
            client.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as error:
            raise_unless_group_exists(error)
        return None
    if cluster:
        try:
            client.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as error:
            raise_unless_group_exists(error)
            return None
        return int(client.xlen(stream))
    with client.pipeline(transaction=True) as pipe:
        pipe.xgroup_create(stream, group, id=start, mkstream=True)
        pipe.xlen(stream)
        created, length = pipe.execute(raise_on_error=False)
    return _skipped(created, length)


def _skipped(created: Any, length: Any) -> int | None:
    if isinstance(created, ResponseError):
        raise_unless_group_exists(created)
        return None
    if isinstance(length, Exception):
        raise length
    return int(length)


def raise_unless_group_exists(error: ResponseError) -> None:
    """XGROUP CREATE of an existing group is fine (BUSYGROUP); anything else is not."""
    if "BUSYGROUP" not in str(error):
        raise error


def skipped_warning(stream: str, group: str, skipped: int) -> str:
    """What to tell a user whose new group at ``"$"`` skips ``skipped`` entries."""
    return (
        f'consumer group {group!r} was created at start="$": the {skipped} entries stream '
        f"{stream!r} holds already will not be delivered to it, only the ones added from now "
        "on (as a new Pub/Sub subscription gets only later messages). To deliver them too, "
        f'create the group with ensure_subscription({stream!r}, {group!r}, start="0"); as it '
        f"exists now, seek it back instead: await reliable_sub.replay.seek(broker, {group!r}, "
        "to=datetime(1970, 1, 1, tzinfo=timezone.utc))"
    )
