"""``reliable-sub seek`` and ``reliable-sub snapshot create|list|delete``."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

import click

from ..ports import Adapter, Seekable
from ..replay import ReplayMode
from ..replay import seek as seek_subscription
from ._common import confirm, json_option, print_json, print_table, run_on_adapter, with_adapter
from .connect import Connection
from .failures import USAGE, fail

RELATIVE = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """``now``, ``-30m`` / ``-2h`` / ``-1d`` / ``-90s`` (ago), or ISO 8601 (UTC if it names
    no offset)."""
    now = now or datetime.now(timezone.utc)
    if text == "now":
        return now
    relative = RELATIVE.match(text)
    if relative is not None:
        try:
            return now - timedelta(**{UNITS[relative.group(2)]: float(relative.group(1))})
        except OverflowError:  # before year 1, or more days than a timedelta holds
            raise click.BadParameter(f"{text!r} reaches back before the year 1") from None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a time: use ISO 8601 (2026-11-24T09:30:00Z), now, or an age "
            f"such as -30m, -2h, -1d") from None
    return when if when.utcoffset() is not None else when.replace(tzinfo=timezone.utc)


def seekable(adapter: Adapter) -> Seekable:
    if not isinstance(adapter, Seekable):
        fail(USAGE, f"{type(adapter).__name__} cannot seek or keep snapshots")
    return adapter


@click.command()
@click.argument("subscription")
@click.option("--to", "to_text", metavar="TIME",
              help="ISO 8601 (UTC unless it says), now, or an age such as -2h.")
@click.option("--snapshot", help="A snapshot taken with 'snapshot create'.")
@click.option("--mode", type=click.Choice([mode.value for mode in ReplayMode]),
              default=ReplayMode.SKIP_PROCESSED.value, show_default=True,
              help="reprocess: run messages the dedup store recorded as processed again "
                   "(needs --dedup-url).")
@click.option("--namespace", help="The dedup namespace, if the handler set one.")
@click.option("--yes", is_flag=True, help="Do not ask before a seek that purges.")
@json_option
@click.pass_obj
def seek(connection: Connection, subscription: str, to_text: str | None, snapshot: str | None,
         mode: str, namespace: str | None, yes: bool, as_json: bool) -> None:
    """Seek SUBSCRIPTION to a time or a snapshot: later messages are delivered again.

    A time still to come acknowledges the whole backlog (a purge).
    """
    if (to_text is None) == (snapshot is None):
        raise click.UsageError("give exactly one of --to TIME and --snapshot NAME")
    now = datetime.now(timezone.utc)
    to = parse_time(to_text, now) if to_text is not None else None
    if to is not None and to >= now and not yes:
        confirm(f"{to.isoformat()} is not in the past: every message of {subscription} "
                "published so far will count as acknowledged. Go on?")
    store = connection.dedup_store() if mode == ReplayMode.REPROCESS.value else None

    async def run(adapter: Adapter) -> None:
        try:
            if store is not None:  # before the seek: a store that fails after it, fails late
                await connection.reach_store(store)
            result = await seek_subscription(adapter, subscription, to=to, snapshot=snapshot,
                                             mode=mode, dedup=store, namespace=namespace)
        finally:
            if store is not None:
                await store.close()
        target = to.isoformat() if to is not None else f"snapshot {snapshot}"
        if as_json:
            print_json({"subscription": subscription, "to": target,
                        "mode": result.mode.value, "epoch": result.epoch})
        else:
            epoch = f", dedup epoch {result.epoch}" if result.epoch is not None else ""
            click.echo(f"sought {subscription} to {target} ({result.mode.value}{epoch})")

    run_on_adapter(connection, run)


@click.group()
def snapshot() -> None:
    """Take, list and delete snapshots of subscriptions."""


@snapshot.command()
@click.argument("subscription")
@click.argument("name")
@json_option
@with_adapter
async def create(adapter: Adapter, subscription: str, name: str, as_json: bool) -> None:
    """Take a snapshot NAME of SUBSCRIPTION (to seek back to with --snapshot NAME)."""
    taken = await seekable(adapter).create_snapshot(subscription, name)
    if as_json:
        print_json(snapshot_dict(taken))
    else:
        click.echo(f"took snapshot {taken.name} of {subscription}")


@snapshot.command("list")
@click.argument("subscription", required=False)
@json_option
@with_adapter
async def list_(adapter: Adapter, subscription: str | None, as_json: bool) -> None:
    """The snapshots (of SUBSCRIPTION, if given)."""
    found = await seekable(adapter).list_snapshots(subscription)
    if as_json:
        print_json([snapshot_dict(snap) for snap in found])
        return
    print_table(f"{len(found)} snapshots", ["name", "subscription", "topic", "created",
                                            "expires"],
                [(s.name, s.subscription, s.topic, s.created, s.expires) for s in found])


@snapshot.command()
@click.argument("name")
@with_adapter
async def delete(adapter: Adapter, name: str) -> None:
    """Delete the snapshot NAME."""
    await seekable(adapter).delete_snapshot(name)
    click.echo(f"deleted snapshot {name}")


def snapshot_dict(snap: Any) -> dict[str, Any]:
    return {"name": snap.name, "subscription": snap.subscription, "topic": snap.topic,
            "created": snap.created, "expires": snap.expires}


COMMANDS = [seek, snapshot]


__all__ = ["COMMANDS", "parse_time", "seek", "snapshot"]
