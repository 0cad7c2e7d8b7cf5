"""``reliable-sub dlq list|peek|show|replay|purge``: a dead-letter queue (a subscription on the
dead-letter topic)."""

from __future__ import annotations

import base64
import sys
from typing import Any

import click
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn

from ..dead_letters import DeadLetter, DeadLetterQueue
from ..ports import Adapter
from ._common import (
    FAILED,
    Seconds,
    confirm,
    json_option,
    print_json,
    print_table,
    run_on_adapter,
    with_adapter,
)
from .connect import Connection
from .failures import stderr

wait_option = click.option(
    "--wait", default=2.0, show_default=True, type=Seconds(), metavar="SECONDS",
    help="Seconds an empty receive waits before the queue counts as drained.")


@click.group()
def dlq() -> None:
    """Inspect, replay and purge a dead-letter queue."""


def as_dict(letter: DeadLetter) -> dict[str, Any]:
    try:
        data: dict[str, str] = {"data": letter.data.decode("utf-8")}
    except UnicodeDecodeError:
        data = {"data_base64": base64.b64encode(letter.data).decode()}
    return {"id": letter.id, **data, "attributes": letter.attributes,
            "original_message_id": letter.original_message_id,
            "original_subscription": letter.original_subscription,
            "idempotency_key": letter.idempotency_key,
            "delivery_attempts": letter.delivery_attempts,
            "handler_failures": letter.handler_failures, "error_type": letter.error_type,
            "error_message": letter.error_message, "published": letter.published}


@dlq.command("list")
@click.argument("subscription")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(min=1))
@wait_option
@json_option
@with_adapter
async def list_(adapter: Adapter, subscription: str, limit: int, wait: float,
                as_json: bool) -> None:
    """Dead letters in SUBSCRIPTION, oldest first (they stay in the queue)."""
    letters = await DeadLetterQueue(adapter, subscription, wait=wait).peek(limit)
    if as_json:
        print_json([as_dict(letter) for letter in letters])
        return
    print_table(f"{len(letters)} dead letters in {subscription}",
                ["id", "published", "from", "failures", "error"],
                [(letter.id, letter.published, letter.original_subscription,
                  letter.handler_failures, _first_line(letter.error_type, letter.error_message))
                 for letter in letters])


def _first_line(error_type: str | None, message: str | None) -> str:
    """The error as one table cell: its first line (``dlq show`` has all of it)."""
    lines = (message or "").strip().splitlines()
    more = " (more: dlq show)" if len(lines) > 1 else ""
    return f"{error_type}: {lines[0] if lines else ''}{more}"


@dlq.command()
@click.argument("subscription")
@click.option("--limit", default=1, show_default=True, type=click.IntRange(min=1),
              help="How many dead letters, oldest first.")
@wait_option
@json_option
@with_adapter
async def peek(adapter: Adapter, subscription: str, limit: int, wait: float,
               as_json: bool) -> None:
    """The oldest dead letters in SUBSCRIPTION in full (data, attributes, error), left in the
    queue: ``list`` shows one line each, ``show`` one by id."""
    letters = [as_dict(letter)
               for letter in await DeadLetterQueue(adapter, subscription, wait=wait).peek(limit)]
    if as_json:
        print_json(letters)
        return
    if not letters:
        click.echo(f"no dead letters in {subscription}")
    for letter in letters:
        _print_letter(letter)


def _print_letter(letter: dict[str, Any]) -> None:
    attributes = letter.pop("attributes")
    print_table(f"dead letter {letter['id']}", ["field", "value"],
                [*letter.items(), *((f"attribute {k}", v) for k, v in attributes.items())])


@dlq.command()
@click.argument("subscription")
@click.argument("message_id")
@wait_option
@json_option
@with_adapter
async def show(adapter: Adapter, subscription: str, message_id: str, wait: float,
               as_json: bool) -> None:
    """One dead letter: its data, attributes and recorded error."""
    letter = as_dict(await DeadLetterQueue(adapter, subscription, wait=wait).show(message_id))
    if as_json:
        print_json(letter)
        return
    _print_letter(letter)


def _progress(verb: str) -> Progress:
    return Progress(SpinnerColumn(), TextColumn(f"{verb} {{task.completed}} messages"),
                    console=stderr, transient=True, disable=not sys.stderr.isatty())


@dlq.command()
@click.argument("subscription")
@click.argument("message_ids", nargs=-1)
@click.option("--to-topic", help="Publish here instead of the original subscription's topic.")
@wait_option
@json_option
@with_adapter
async def replay(adapter: Adapter, subscription: str, message_ids: tuple[str, ...],
                 to_topic: str | None, wait: float, as_json: bool) -> None:
    """Publish dead letters (all, or MESSAGE_IDS) back to their topic, then ack them.

    The original idempotency key is kept; the handler gets every attempt again. Run it after
    the fix is deployed.
    """
    queue = DeadLetterQueue(adapter, subscription, wait=wait)
    with _progress("replayed") as progress:
        task = progress.add_task("replay", total=None)
        report = await queue.replay(message_ids or None, to_topic=to_topic,
                                    on_progress=lambda n: progress.advance(task, n))
    if as_json:
        print_json({"replayed": report.replayed, "failed": report.failed,
                    "missing": report.missing})
    else:
        click.echo(f"replayed {len(report.replayed)} messages from {subscription}")
        for message_id, error in report.failed.items():
            stderr.print(escape(f"not replayed {message_id}: {error}"), highlight=False)
        for message_id in report.missing:
            stderr.print(escape(f"not in the queue: {message_id}"), highlight=False)
    if report.failed or report.missing:
        sys.exit(FAILED)


@dlq.command()
@click.argument("subscription")
@click.argument("message_ids", nargs=-1)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@wait_option
@json_option
@click.pass_obj
def purge(connection: Connection, subscription: str, message_ids: tuple[str, ...], yes: bool,
          wait: float, as_json: bool) -> None:
    """Delete dead letters (all, or MESSAGE_IDS) for good: they are acked."""
    what = f"{len(message_ids)} dead letters" if message_ids else "every dead letter"
    if not yes:
        confirm(f"Purge {what} in {subscription}?")

    async def run(adapter: Adapter) -> None:
        queue = DeadLetterQueue(adapter, subscription, wait=wait)
        with _progress("purged") as progress:
            task = progress.add_task("purge", total=None)
            report = await queue.purge(message_ids or None,
                                       on_progress=lambda n: progress.advance(task, n))
        if as_json:
            print_json({"purged": report.purged, "missing": report.missing})
        else:
            click.echo(f"purged {report.purged} messages from {subscription}")
            for message_id in report.missing:
                stderr.print(escape(f"not in the queue: {message_id}"), highlight=False)
        if report.missing:
            sys.exit(FAILED)

    run_on_adapter(connection, run)


COMMANDS = [dlq]


__all__ = ["COMMANDS", "as_dict", "dlq"]
