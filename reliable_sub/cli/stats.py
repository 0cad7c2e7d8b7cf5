"""``reliable-sub stats SUBSCRIPTION``: what a subscription holds now (``--watch``: as it goes)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import click
from rich.console import Console
from rich.live import Live

from ..ports import Adapter, Inspectable, SubscriptionStats
from .app import USAGE, Seconds, fail, json_option, print_json, print_table, table_of, with_adapter

UNKNOWN = "unknown"


@click.command()
@click.argument("subscription")
@click.option("--dead-letter-subscription", metavar="SUBSCRIPTION",
              help="Also count what waits in this dead-letter queue.")
@click.option("--watch", type=Seconds(positive=True), metavar="SECONDS",
              help="Read the figures again every SECONDS until interrupted: the table is "
                   "redrawn in place (with --json, one JSON object per line).")
@click.option("--iterations", type=click.IntRange(min=1), metavar="N",
              help="With --watch: stop after N readings.")
@json_option
@with_adapter
async def stats(adapter: Adapter, subscription: str, dead_letter_subscription: str | None,
                watch: float | None, iterations: int | None, as_json: bool) -> None:
    """Backlog, in flight, oldest unacked age, ack deadline (and dead letters waiting).

    The lease deadline the consumers use now is theirs: see the reliable_sub.lease.deadline
    metric. Pub/Sub reports backlogs through Cloud Monitoring only: they show as unknown.
    """
    if not isinstance(adapter, Inspectable):
        fail(USAGE, f"{type(adapter).__name__} reports no figures")
    if iterations is not None and watch is None:
        fail(USAGE, "--iterations counts the readings of --watch: give --watch SECONDS too")
    dead_letters = dead_letter_subscription is not None
    if watch is None:
        show(subscription, await figures_of(adapter, subscription, dead_letter_subscription),
             as_json, dead_letters)
        return
    console = Console()
    live = (Live(console=console, auto_refresh=False)
            if console.is_terminal and not as_json else None)
    with live if live is not None else contextlib.nullcontext():
        readings = 0
        while True:
            values = await figures_of(adapter, subscription, dead_letter_subscription)
            if live is not None:
                live.update(table_of(subscription, *_shown(values, dead_letters)), refresh=True)
            else:
                show(subscription, values, as_json, dead_letters, one_line=True)
            readings += 1
            if iterations is not None and readings >= iterations:
                return
            await asyncio.sleep(watch)


async def figures_of(adapter: Inspectable, subscription: str,
                     dead_letter_subscription: str | None) -> dict[str, Any]:
    figures = await adapter.subscription_stats(subscription)
    dead: SubscriptionStats | None = None
    if dead_letter_subscription is not None:
        dead = await adapter.subscription_stats(dead_letter_subscription)
    values: dict[str, Any] = {
        "backlog": figures.backlog, "in_flight": figures.in_flight,
        "oldest_unacked_age_seconds": figures.oldest_unacked_age,
        "ack_deadline_seconds": figures.ack_deadline,
        "dead_lettered_waiting": None if dead is None else dead.backlog,
    }
    return values


def show(subscription: str, values: dict[str, Any], as_json: bool, dead_letters: bool,
         one_line: bool = False) -> None:
    if as_json:
        print_json({"subscription": subscription, **values}, one_line=one_line)
    else:
        print_table(subscription, *_shown(values, dead_letters))


def _shown(values: dict[str, Any], dead_letters: bool) -> tuple[list[str], list[list[Any]]]:
    """The table's columns and row (a dead-letter column when a queue was named)."""
    shown = {name: UNKNOWN if value is None else value for name, value in values.items()
             if name != "dead_lettered_waiting" or dead_letters}
    return list(shown), [list(shown.values())]


COMMANDS = [stats]
