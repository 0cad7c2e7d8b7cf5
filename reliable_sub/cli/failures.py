"""Exit codes, and what the command prints when it stops on an error: one ``error:`` line on
stderr (with ``--json``, one JSON object there instead), never a traceback for anything the
user gave it. Only an error this module cannot place (a bug) goes on as a traceback."""

from __future__ import annotations

import json
import re
import sys
from typing import NoReturn

import click
from rich.console import Console
from rich.markup import escape

from ..dead_letters import UnknownDeadLetterError
from ..errors import (
    AccessDeniedError,
    ConfigurationError,
    CredentialsRefusedError,
    MissingExtraError,
    SnapshotExistsError,
    UnknownSnapshotError,
    UnknownSubscriptionError,
    UnknownTopicError,
)

# Exit codes scripts can rely on.
OK = 0
FAILED = 1  # the operation ran and did not fully succeed (a replay with failures, a name taken)
USAGE = 2  # bad options or configuration (click uses 2 for its own usage errors too)
UNREACHABLE = 3  # the broker or database did not answer
UNKNOWN = 4  # a subscription, topic, snapshot or message that does not exist
ABORTED = 5  # nothing done: the confirmation was declined (or there was no terminal to ask)

# Errors of the broker and database clients, by class name: the command imports no client at
# module level. Checked in this order (a Redis AuthenticationError is a Redis ConnectionError).
REFUSED_CREDENTIALS = {"AuthenticationError", "AuthenticationWrongNumberOfArgsError"}
NOT_REDIS = {"InvalidResponse"}  # a reply that is not RESP: another server on that port
# ... or a server that closed the connection at the first command instead of answering (one
# that is not Redis, say PostgreSQL: Redis itself answers an error first, even when it refuses)
REDIS_CONNECTION = {"RedisError"}
CLOSED_AT_ONCE = "Connection closed by server"
REDIS_REFUSED = {"ResponseError"}
NO_GOOGLE_CREDENTIALS = {"DefaultCredentialsError"}
# the broker found the request invalid: Google's 400s (a name Pub/Sub does not take...), NATS's
INVALID_REQUEST = {"BadRequest", "BadRequestError"}
UNREACHABLE_ERRORS = {"ConnectionError", "TimeoutError", "ServiceUnavailable", "DeadlineExceeded",
                      "RetryError", "gaierror"}
DATABASE_ERRORS = {"OperationalError", "InterfaceError"}
# A database error with one of these means the server answered and refused (a role, password
# or database that does not exist; something that is not PostgreSQL on that port) ...
DATABASE_REFUSED = re.compile(
    r"FATAL|authentication|password|does not exist|invalid response|SSL negotiation",
    re.IGNORECASE)
# ... and with one of these (and none of the above) that it did not answer.
UNREACHABLE_DATABASE = re.compile(
    r"connect|refused|timeout|timed out|unreachable|server closed|could not translate host",
    re.IGNORECASE)

stderr = Console(stderr=True)


class CommandError(Exception):
    """Stop the command with exit code ``code``, printing ``text`` as its error."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


def fail(code: int, text: str) -> NoReturn:
    """End the command with ``code`` and the error ``text`` (see :func:`report`)."""
    raise CommandError(code, text)


def report(code: int, text: str, as_json: bool) -> NoReturn:
    """Print ``text`` as one line on stderr (a JSON object with --json) and exit with ``code``."""
    line = " ".join(text.split())  # client messages span lines; the error is one
    if as_json:
        click.echo(json.dumps({"error": line, "exit_code": code}), err=True)
    else:
        # soft_wrap: no line breaks at the terminal's width; escape: "[redis]" is no markup
        stderr.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def classify(error: BaseException) -> tuple[int, str] | None:
    """The exit code and message for ``error``, or None for one no user input explains."""
    if isinstance(error, CommandError):
        return error.code, str(error)
    if isinstance(error, click.ClickException):
        text = error.format_message()
        context = getattr(error, "ctx", None)
        if isinstance(error, click.UsageError) and context is not None:
            text += f" (see '{context.command_path} --help')"
        return error.exit_code, text
    if isinstance(error, (UnknownSubscriptionError, UnknownTopicError, UnknownSnapshotError,
                          UnknownDeadLetterError)):
        return UNKNOWN, str(error)
    if isinstance(error, CredentialsRefusedError):
        return USAGE, str(error)
    if isinstance(error, (SnapshotExistsError, AccessDeniedError)):
        return FAILED, str(error)
    if isinstance(error, (ConfigurationError, MissingExtraError)):
        return USAGE, str(error)
    if isinstance(error, ImportError):  # a driver an extra installs (psycopg, aiosqlite...)
        return USAGE, (f"a package is missing ({error}); install the extras of what you named, "
                       'e.g. pip install "reliable-sub[cli,redis,sql]"')
    return _client_error(error)


def _client_error(error: BaseException) -> tuple[int, str] | None:
    kinds = {kind.__name__ for kind in type(error).__mro__}
    named = f"{type(error).__name__}: {error}"
    if REFUSED_CREDENTIALS & kinds:
        return USAGE, (f"Redis refused the credentials ({named}); check the user and password "
                       "in the URL")
    if NOT_REDIS & kinds or (REDIS_CONNECTION & kinds and CLOSED_AT_ONCE in str(error)):
        return USAGE, (f"the server did not answer as Redis does ({named}); check the URL's "
                       "host and port")
    if REDIS_REFUSED & kinds:
        return USAGE, (f"Redis refused the command ({named}); check the URL's database number "
                       "and the key prefix")
    if NO_GOOGLE_CREDENTIALS & kinds:
        return USAGE, (f"no Google Cloud credentials ({error}); set "
                       "GOOGLE_APPLICATION_CREDENTIALS, or PUBSUB_EMULATOR_HOST for the emulator")
    if INVALID_REQUEST & kinds:
        return USAGE, (f"the broker refused the request as invalid ({named}); check the names "
                       "given")
    if DATABASE_ERRORS & kinds:
        cause = getattr(error, "orig", None) or error  # the driver's words, not SQLAlchemy's
        said = f"{type(cause).__name__}: {cause}"
        if DATABASE_REFUSED.search(str(cause)):
            return USAGE, (f"the database refused the connection ({said}); check the user, "
                           "password, database name, host and port in the URL")
        if UNREACHABLE_DATABASE.search(str(cause)):
            return UNREACHABLE, f"cannot reach the database ({said})"
    if UNREACHABLE_ERRORS & kinds:
        return UNREACHABLE, f"cannot reach the broker or database ({named})"
    if DATABASE_ERRORS & kinds or "ProgrammingError" in kinds:
        cause = getattr(error, "orig", None) or error
        return USAGE, (f"the database refused the command ({type(cause).__name__}: {cause}); "
                       "check --database-url, --outbox-table, --dedup-url and --dedup-table")
    return None


__all__ = [
    "ABORTED",
    "FAILED",
    "OK",
    "UNKNOWN",
    "UNREACHABLE",
    "USAGE",
    "CommandError",
    "classify",
    "fail",
    "report",
    "stderr",
]
