"""``reliable-sub stats SUBSCRIPTION...``: what subscriptions hold now, one row each
(``--watch``: as it goes); ``reliable-sub top SUBSCRIPTION...``: the same, redrawn in place."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import click
from rich.console import Console
from rich.live import Live

from ..ports import Adapter, Inspectable
from ._common import (
    FAILED,
    USAGE,
    Seconds,
    fail,
    json_option,
    print_json,
    print_table,
    table_of,
    with_adapter,
)

UNKNOWN = "unknown"
DEFAULT_TOP_INTERVAL = 2.0
# The table's column per figure (JSON keeps the field names): short, so a row fits 80 columns.
HEADINGS = {"backlog": "backlog", "in_flight": "in flight",
            "oldest_unacked_age_seconds": "oldest unacked", "ack_deadline_seconds": "deadline",
            "dead_lettered_waiting": "dead letters"}

subscriptions_argument = click.argument("subscriptions", nargs=-1, required=True,
                                        metavar="SUBSCRIPTION...")
dead_letters_option = click.option(
    "--dead-letter-subscription", metavar="SUBSCRIPTION",
    help="Also count what waits in this dead-letter queue.")
iterations_option = click.option("--iterations", type=click.IntRange(min=1), metavar="N",
                                  help="Stop after N readings.")


@click.command()
@subscriptions_argument
@dead_letters_option
@click.option("--watch", type=Seconds(positive=True), metavar="SECONDS",
              help="Read the figures again every SECONDS until interrupted: the table is "
                   "redrawn in place (with --json, one JSON object per line).")
@iterations_option
@json_option
@with_adapter
async def stats(adapter: Adapter, subscriptions: tuple[str, ...],
                dead_letter_subscription: str | None, watch: float | None,
                iterations: int | None, as_json: bool) -> None:
    """Backlog, in flight, oldest unacked age and ack deadline of each SUBSCRIPTION (and dead
    letters waiting).

    With --json: an object for one subscription, a list of them for several. The lease
    deadline consumers use now is theirs: see the reliable_sub.lease.deadline metric. Pub/Sub
    reports backlogs through Cloud Monitoring only: they show as unknown. SQS's counts are
    estimates: shown as ~N ("approximate": true in JSON).
    """
    if iterations is not None and watch is None:
        fail(USAGE, "--iterations counts the readings of --watch: give --watch SECONDS too")
    await _show(adapter, subscriptions, dead_letter_subscription, watch, iterations, as_json)


@click.command()
@subscriptions_argument
@dead_letters_option
@click.option("--interval", type=Seconds(positive=True), default=DEFAULT_TOP_INTERVAL,
              show_default=True, metavar="SECONDS", help="Seconds between readings.")
@iterations_option
@json_option
@with_adapter
async def top(adapter: Adapter, subscriptions: tuple[str, ...],
              dead_letter_subscription: str | None, interval: float, iterations: int | None,
              as_json: bool) -> None:
    """The figures of each SUBSCRIPTION, read again every --interval and redrawn in place
    until interrupted (``stats --watch``)."""
    await _show(adapter, subscriptions, dead_letter_subscription, interval, iterations, as_json)


async def _show(adapter: Adapter, subscriptions: Sequence[str], dead_letters: str | None,
                watch: float | None, iterations: int | None, as_json: bool) -> None:
    if not isinstance(adapter, Inspectable):
        fail(USAGE, f"{type(adapter).__name__} reports no figures")
    title = ", ".join(subscriptions)

    async def read() -> list[dict[str, Any]]:
        waiting = None  # the dead-letter queue's backlog, read once per reading
        if dead_letters is not None:
            waiting = (await adapter.subscription_stats(dead_letters)).backlog
        return [await figures_of(adapter, s, waiting) for s in subscriptions]

    if watch is None:
        rows = await read()
        show(title, rows, as_json, dead_letters is not None)
        failed = [f"{row['subscription']!r}: {row['unknown_because']}" for row in rows
                  if "unknown_because" in row]
        if failed:
            fail(FAILED, f"figures unknown for {'; '.join(failed)}")
        return
    console = Console()
    live = (Live(console=console, auto_refresh=False)
            if console.is_terminal and not as_json else None)
    with live if live is not None else contextlib.nullcontext():
        readings = 0
        try:
            while True:
                rows = await read()
                if live is not None:
                    live.update(table_of(title, *_shown(rows, dead_letters is not None)),
                                refresh=True)
                else:
                    show(title, rows, as_json, dead_letters is not None, one_line=True)
                readings += 1
                if iterations is not None and readings >= iterations:
                    return
                await asyncio.sleep(watch)
        except asyncio.CancelledError:
            return  # ^C (asyncio.run cancels the command on SIGINT): the way a watch ends


async def figures_of(adapter: Inspectable, subscription: str,
                     dead_lettered_waiting: int | None) -> dict[str, Any]:
    figures = await adapter.subscription_stats(subscription)
    row = {
        "subscription": subscription,
        "backlog": figures.backlog, "in_flight": figures.in_flight,
        "oldest_unacked_age_seconds": figures.oldest_unacked_age,
        "ack_deadline_seconds": figures.ack_deadline,
        "dead_lettered_waiting": dead_lettered_waiting,
    }
    if figures.approximate:  # only where the broker says so (SQS): others' rows are as ever
        row["approximate"] = True
    if figures.unknown_because is not None:  # a source that failed: the command did only part
        row["unknown_because"] = figures.unknown_because
    return row


def show(title: str, rows: list[dict[str, Any]], as_json: bool, dead_letters: bool,
         one_line: bool = False) -> None:
    if as_json:
        print_json(rows[0] if len(rows) == 1 else rows, one_line=one_line)
    else:
        print_table(title, *_shown(rows, dead_letters))


def _seconds(value: float) -> str:
    return f"{value:.1f} s"


_FORMATS: dict[str, Callable[[Any], str]] = {
    "oldest_unacked_age_seconds": _seconds, "ack_deadline_seconds": _seconds}


def _shown(rows: list[dict[str, Any]], dead_letters: bool
           ) -> tuple[list[str], list[list[Any]]]:
    """The table's columns and rows (a dead-letter column when a queue was named)."""
    names = [name for name in HEADINGS if name != "dead_lettered_waiting" or dead_letters]
    return (["subscription", *(HEADINGS[name] for name in names)],
            [[row["subscription"], *(_cell(row, name) for name in names)] for row in rows])


# The figures a broker may only estimate (SQS): shown as "~12" when it says they are estimates.
_ESTIMATED = frozenset({"backlog", "in_flight"})


def _cell(row: dict[str, Any], name: str) -> str:
    value = row[name]
    if value is None:
        return UNKNOWN
    shown = _FORMATS.get(name, str)(value)
    return f"~{shown}" if row.get("approximate") and name in _ESTIMATED else shown


COMMANDS = [stats, top]


__all__ = ["COMMANDS", "stats", "top"]
