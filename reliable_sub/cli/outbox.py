"""``reliable-sub outbox status|retry-failed|purge``: the transactional outbox's rows."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from ..outbox import maintenance
from ._common import Seconds, confirm, execute, json_option, print_json, print_table
from .connect import Connection

T = TypeVar("T")


def on_outbox(connection: Connection, operation: Callable[[Any], Awaitable[T]]) -> T:
    outbox = connection.outbox()

    async def run() -> T:
        try:
            await connection.reach_outbox(outbox)
            return await operation(outbox)
        finally:
            await outbox.close()

    return execute(run())


@click.group()
def outbox() -> None:
    """Check the outbox and act on its rows (needs --database-url)."""


@outbox.command()
@json_option
@click.pass_obj
def status(connection: Connection, as_json: bool) -> None:
    """Pending rows, the oldest one's age, and parked rows (publishing gave up)."""
    backlog = on_outbox(connection, lambda box: maintenance.backlog(box, time.time()))
    figures = {"pending": backlog.pending, "oldest_pending_age_seconds": backlog.oldest_age,
               "parked": backlog.parked}
    if as_json:
        print_json(figures)
    else:
        age = None if backlog.oldest_age is None else f"{backlog.oldest_age:.1f} s"
        print_table("outbox", ["pending", "oldest pending", "parked"],
                    [(backlog.pending, age, backlog.parked)])


@outbox.command("retry-failed")
@click.argument("keys", nargs=-1)
@click.pass_obj
def retry_failed(connection: Connection, keys: tuple[str, ...]) -> None:
    """Make parked rows (all, or those of ordering KEYS) pending again, with fresh attempts."""
    count = on_outbox(connection, lambda box: maintenance.requeue_parked(box, keys or None))
    click.echo(f"{count} parked rows are pending again")


@outbox.command()
@click.option("--older-than", required=True, type=Seconds(), metavar="SECONDS",
              help="Delete rows published at least this long ago.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_obj
def purge(connection: Connection, older_than: float, yes: bool) -> None:
    """Delete published rows (pending and parked rows are never deleted)."""
    if not yes:
        confirm(f"Delete rows published more than {older_than:g} s ago?")
    cutoff = time.time() - older_than
    count = on_outbox(connection, lambda box: maintenance.purge_published(box, cutoff))
    click.echo(f"deleted {count} published rows")


COMMANDS = [outbox]


__all__ = ["COMMANDS", "outbox"]
