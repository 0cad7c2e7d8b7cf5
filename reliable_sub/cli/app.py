"""The command group, its connection options, exit codes and output."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import click

from ..errors import UnknownSubscriptionError
from ._common import (
    Seconds,
    confirm,
    execute,
    group_json_option,
    json_option,
    print_json,
    print_table,
    run_on_adapter,
    with_adapter,
)
from .brokers import BROKERS
from .connect import DEFAULT_CONNECT_TIMEOUT, Connection
from .failures import (
    ABORTED,
    FAILED,
    OK,
    UNKNOWN,
    UNREACHABLE,
    USAGE,
    classify,
    fail,
    report,
    stderr,
)

__all__ = ["ABORTED", "FAILED", "OK", "UNKNOWN", "UNREACHABLE", "USAGE", "cli", "confirm",
           "execute", "fail", "json_option", "print_json", "print_table", "run_on_adapter",
           "stderr", "with_adapter"]

JSON = "reliable_sub.json"  # context meta key: errors as JSON (--json was given)


def wants_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among ``args`` (before a ``--``): known before click parses them,
    so that even a usage error comes out as JSON."""
    given = list(args)
    return "--json" in given[:given.index("--") if "--" in given else len(given)]


class CommandGroup(click.Group):
    """The root group: whatever stops a command is reported by :func:`failures.report` (one
    line, or JSON), click's own usage errors included; only an error no input explains (a bug)
    goes on as a traceback."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        as_json = wants_json(args)
        try:
            context = super().make_context(info_name, args, parent, **extra)
        except click.ClickException as error:  # the group's own options
            stop(error, as_json)
        context.meta[JSON] = as_json
        return context

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort):
            raise  # --help, --version, ^C: click's to handle
        except Exception as error:
            if isinstance(error, UnknownSubscriptionError) and isinstance(ctx.obj, Connection):
                error = UnknownSubscriptionError(f"{error}{ctx.obj.prefix_hint()}")
            stop(error, ctx.meta.get(JSON, False))


# click 8.2+: a group called without a command shows its help through this usage error
NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def stop(error: Exception, as_json: bool) -> NoReturn:
    """Report ``error`` and exit (see :func:`failures.report`), or raise it again when no input
    explains it."""
    if isinstance(error, NO_ARGS_IS_HELP):
        error.show()  # the help, as click prints it
        sys.exit(error.exit_code)
    found = classify(error)
    if found is None:
        raise error
    report(*found, as_json)


def broker_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """An option per broker of BROKERS (and its --<name>-prefix, if it has one)."""
    for broker in reversed(BROKERS):
        for (option, help_text, _), name in reversed(list(zip(broker.settings,
                                                              broker.setting_params,
                                                              strict=True))):
            function = click.option(option, name, envvar=f"RELIABLE_SUB_{name.upper()}",
                                    help=help_text)(function)
        if broker.prefix is not None:
            function = click.option(
                broker.prefix_option, broker.prefix_param, envvar=f"RELIABLE_SUB_"
                f"{broker.prefix_param.upper()}", default=broker.prefix, show_default=True,
                help=f"The {broker.option} adapter's key prefix.")(function)
        function = click.option(broker.option, broker.param, envvar=broker.envvar,
                                help=broker.help)(function)
    return function


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"],
                                                 "auto_envvar_prefix": "RELIABLE_SUB"})
@broker_options
@click.option("--database-url", envvar="RELIABLE_SUB_DATABASE_URL",
              help="The outbox's database (postgresql://..., mariadb://... or sqlite:///...).")
@click.option("--outbox-table", envvar="RELIABLE_SUB_OUTBOX_TABLE",
              default="reliable_sub_outbox", show_default=True)
@click.option("--dedup-url", envvar="RELIABLE_SUB_DEDUP_URL",
              help="The consumers' dedup store: a redis:// or database URL.")
@click.option("--dedup-prefix", envvar="RELIABLE_SUB_DEDUP_PREFIX",
              default="reliable-sub:dedup", show_default=True)
@click.option("--dedup-table", envvar="RELIABLE_SUB_DEDUP_TABLE",
              default="reliable_sub_processed", show_default=True)
@click.option("--connect-timeout", envvar="RELIABLE_SUB_CONNECT_TIMEOUT",
              default=DEFAULT_CONNECT_TIMEOUT, show_default=True, metavar="SECONDS",
              type=Seconds(positive=True),
              help="How long the broker, store or database has to answer first.")
@group_json_option
@click.version_option(package_name="reliable-sub")
@click.pass_context
def cli(context: click.Context, /, **options: Any) -> None:
    """Operate reliable-sub consumers: dead letters, replays, the outbox, figures, runs.

    Exit codes: 0 done, 1 done only in part (see the output), 2 bad usage or configuration,
    3 the broker or database did not answer, 4 a name that does not exist, 5 nothing done
    (a confirmation declined). Errors are one line on stderr (a JSON object with --json).
    """
    context.obj = Connection.from_options(options)
    quiet_library_logs()


def quiet_library_logs() -> None:
    """Keep the library's warnings (an adapter retrying a connection) off stderr, where the
    command's outcome is one line: logging's last-resort handler prints them only when no
    handler is set (``run`` sets one at the level asked)."""
    logger = logging.getLogger("reliable_sub")
    if not any(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
        logger.addHandler(logging.NullHandler())


def _register() -> None:
    from . import dlq, outbox, replay, run, stats

    for module in (dlq, outbox, replay, run, stats):
        for command in module.COMMANDS:
            cli.add_command(command)


_register()
