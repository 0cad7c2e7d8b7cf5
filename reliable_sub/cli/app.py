"""The command group, its connection options, exit codes and output."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.table import Table

from ..dead_letters import UnknownDeadLetterError
from ..errors import (
    AccessDeniedError,
    ConfigurationError,
    SnapshotExistsError,
    UnknownSnapshotError,
    UnknownSubscriptionError,
    UnknownTopicError,
)
from ..ports import Adapter
from .connect import Connection

# Exit codes scripts can rely on.
OK = 0
FAILED = 1  # the operation ran and did not fully succeed (a replay with failures, a name taken)
USAGE = 2  # bad options or configuration (click uses 2 for its own usage errors too)
UNREACHABLE = 3  # the broker or database did not answer
UNKNOWN = 4  # a subscription, topic, snapshot or message that does not exist
ABORTED = 5  # nothing done: the confirmation was declined (or there was no terminal to ask)

# Errors of the broker and database clients that mean "cannot reach it", by class name: the
# command imports no client at module level. A database's OperationalError means it only with
# one of these words (else it is, say, a missing table: a usage error).
UNREACHABLE_ERRORS = {"ConnectionError", "TimeoutError", "ServiceUnavailable", "DeadlineExceeded",
                      "RetryError"}
UNREACHABLE_DATABASE = re.compile(
    r"connect|refused|timeout|timed out|unreachable|server closed|could not translate host",
    re.IGNORECASE)

T = TypeVar("T")
stderr = Console(stderr=True)


def fail(code: int, text: str) -> NoReturn:
    stderr.print(f"[bold red]error:[/] {text}", highlight=False)
    sys.exit(code)


def execute(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` and turn the library's and the clients' errors into exit codes."""

    async def run() -> T:
        return await awaitable

    try:
        return asyncio.run(run())
    except (UnknownSubscriptionError, UnknownTopicError, UnknownSnapshotError,
            UnknownDeadLetterError) as error:
        fail(UNKNOWN, str(error))
    except SnapshotExistsError as error:
        fail(FAILED, str(error))
    except AccessDeniedError as error:
        fail(FAILED, str(error))
    except ConfigurationError as error:
        fail(USAGE, str(error))
    except Exception as error:
        kinds = {kind.__name__ for kind in type(error).__mro__}
        if UNREACHABLE_ERRORS & kinds or (
                {"OperationalError", "InterfaceError"} & kinds
                and UNREACHABLE_DATABASE.search(str(error))):
            fail(UNREACHABLE, f"cannot reach the broker or database ({type(error).__name__}: "
                              f"{error})")
        if "OperationalError" in kinds or "ProgrammingError" in kinds:
            fail(USAGE, f"the database refused the command ({error}); check --database-url, "
                        "--outbox-table, --dedup-url and --dedup-table")
        raise


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
    """Run ``operation(adapter)`` on the named broker, closing the adapter after."""
    adapter = connection.adapter()

    async def run() -> T:
        try:
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


def json_option(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print JSON (for scripts) instead of a table.")(function)


def print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*("—" if cell is None else str(cell) for cell in row))
    Console().print(table)


@click.group(context_settings={"help_option_names": ["-h", "--help"],
                               "auto_envvar_prefix": "RELIABLE_SUB"})
@click.option("--redis-url", envvar="RELIABLE_SUB_REDIS_URL",
              help="The Redis Streams broker (redis://host:port/db).")
@click.option("--redis-prefix", envvar="RELIABLE_SUB_REDIS_PREFIX", default="reliable-sub",
              show_default=True, help="The Redis adapter's key prefix.")
@click.option("--pubsub-project", envvar="RELIABLE_SUB_PUBSUB_PROJECT",
              help="The Pub/Sub project (PUBSUB_EMULATOR_HOST selects the emulator).")
@click.option("--database-url", envvar="RELIABLE_SUB_DATABASE_URL",
              help="The outbox's database (postgresql://... or sqlite:///...).")
@click.option("--outbox-table", envvar="RELIABLE_SUB_OUTBOX_TABLE",
              default="reliable_sub_outbox", show_default=True)
@click.option("--dedup-url", envvar="RELIABLE_SUB_DEDUP_URL",
              help="The consumers' dedup store: a redis:// or database URL.")
@click.option("--dedup-prefix", envvar="RELIABLE_SUB_DEDUP_PREFIX",
              default="reliable-sub:dedup", show_default=True)
@click.option("--dedup-table", envvar="RELIABLE_SUB_DEDUP_TABLE",
              default="reliable_sub_processed", show_default=True)
@click.version_option(package_name="reliable-sub")
@click.pass_context
def cli(context: click.Context, /, **options: Any) -> None:
    """Operate reliable-sub consumers: dead letters, replays, the outbox, figures, runs.

    Exit codes: 0 done, 1 done only in part (see the output), 2 bad usage or configuration,
    3 the broker or database did not answer, 4 a name that does not exist, 5 nothing done
    (a confirmation declined).
    """
    context.obj = Connection(**options)


def _register() -> None:
    from . import dlq, outbox, replay, run, stats

    for module in (dlq, outbox, replay, run, stats):
        for command in module.COMMANDS:
            cli.add_command(command)


_register()
