"""What the subcommands share: running on the named broker, confirming, durations, output.

Kept apart from :mod:`.app` (the command group, which registers the subcommands), so that no
subcommand imports the module that imports it.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..ports import Adapter
from .connect import Connection
from .failures import ABORTED, FAILED, USAGE, fail

T = TypeVar("T")


def execute(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` to its end (its errors are reported by the command group)."""

    async def run() -> T:
        return await awaitable

    return asyncio.run(run())


def confirm(question: str) -> None:
    """Ask ``question``; anything but yes (or no terminal to answer) ends the command with
    ABORTED, having done nothing."""
    try:
        confirmed = click.confirm(question, err=True)
    except click.Abort:
        confirmed = False
    if not confirmed:
        fail(ABORTED, "nothing done (pass --yes to skip the question)")


def run_on_adapter(connection: Connection, operation: Callable[[Adapter], Awaitable[T]]) -> T:
    """Run ``operation(adapter)`` on the named broker once it answered, closing the adapter
    after."""
    adapter = connection.adapter()

    async def run() -> T:
        try:
            await connection.reach_adapter(adapter)
            return await operation(adapter)
        finally:
            await adapter.close()

    return execute(run())


def with_adapter(operation: Callable[..., Awaitable[T]]) -> Callable[..., T]:
    """A command whose body is ``operation(adapter, **options)`` (see :func:`run_on_adapter`)."""

    def command(connection: Connection, /, **options: Any) -> T:
        return run_on_adapter(connection, lambda adapter: operation(adapter, **options))

    # click names the command and writes its help from these
    command.__name__, command.__doc__ = operation.__name__, operation.__doc__
    return click.pass_obj(command)


class Seconds(click.types.FloatParamType):
    """A duration in seconds: a finite number, 0 or more (more than 0 with ``positive``).

    Not click's FloatRange: it lets ``nan`` through (no comparison holds), and ``inf`` would
    wait for ever.
    """

    name = "number of seconds"

    def __init__(self, *, positive: bool = False) -> None:
        self.positive = positive

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        least = seconds > 0 if self.positive else seconds >= 0
        if not (math.isfinite(seconds) and least):
            wanted = "more than 0" if self.positive else "0 or more"
            self.fail(f"{value!r} is not a duration: give a finite number of seconds, {wanted}",
                      param, ctx)
        return seconds


# context meta key of the root: --json was given before the subcommand (reliable-sub --json ...)
JSON_GIVEN = "reliable_sub.json_given"


def _or_given_before(context: click.Context, _param: click.Parameter, value: bool) -> bool:
    return value or bool(context.find_root().meta.get(JSON_GIVEN, False))


def json_option(function: Callable[..., Any]) -> Callable[..., Any]:
    """A command's ``--json``; also on when it was given before the subcommand."""
    return click.option("--json", "as_json", is_flag=True, callback=_or_given_before,
                        help="Print JSON (for scripts) instead of a table.")(function)


def _remember_json(context: click.Context, _param: click.Parameter, value: bool) -> bool:
    context.meta[JSON_GIVEN] = value
    return value


def group_json_option(function: Callable[..., Any]) -> Callable[..., Any]:
    """The group's ``--json``: the same as the command's, given before it."""
    return click.option("--json", is_flag=True, expose_value=False, callback=_remember_json,
                        is_eager=True,
                        help="Print JSON (for scripts) instead of a table; the same as after "
                             "the command.")(function)


def print_json(value: Any, *, one_line: bool = False) -> None:
    click.echo(json.dumps(value, indent=None if one_line else 2, default=str))


def table_of(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    # Text, not str: names and errors from the broker are shown as they are, not as markup
    table = Table(title=Text(title))
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(Text("—" if cell is None else str(cell)) for cell in row))
    return table


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    Console().print(table_of(title, columns, rows))


__all__ = ["FAILED", "USAGE", "Seconds", "confirm", "execute", "fail", "group_json_option",
           "json_option", "print_json", "print_table", "run_on_adapter", "table_of", "with_adapter"]
