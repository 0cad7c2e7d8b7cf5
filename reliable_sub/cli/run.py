"""``reliable-sub run module:attribute``: run a Subscriber (or an OutboxRelay) of your code."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from .._lifecycle import Service
from .failures import USAGE, classify, fail

LEVELS = ["critical", "error", "warning", "info", "debug"]
EXPECTED = ("expected a Subscriber or an OutboxRelay, or a function without arguments that "
            "returns one")
T = TypeVar("T")


def load(target: str) -> Service:
    """The Subscriber or OutboxRelay ``module:attribute`` names; a function (or class) that
    takes no arguments is called for it (a factory)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        fail(USAGE, f"{target!r}: expected MODULE:ATTRIBUTE, e.g. app.workers:sub")
    sys.path.insert(0, os.getcwd())  # as uvicorn and faststream do: the project's modules
    try:
        module = _explained(f"importing {module_name!r}", importlib.import_module, module_name)
    except ImportError as error:
        hint = (" (name a module, app.workers, not a file)"
                if module_name.endswith(".py") or "/" in module_name else "")
        fail(USAGE, f"cannot import {module_name!r}: {error}{hint}")
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            fail(USAGE, f"{module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if isinstance(found, Service):
        return found
    if inspect.iscoroutinefunction(found):
        fail(USAGE, f"{target!r} is an async function: {EXPECTED} (a plain def)")
    factory = inspect.isfunction(found) or (
        inspect.isclass(found) and issubclass(found, Service))
    if not factory:  # never call what is not a factory of ours (os:abort, builtins:print)
        fail(USAGE, f"{target!r} is {_kind(found)}: {EXPECTED}")
    needs = _needed_arguments(found)
    if needs is not None:
        fail(USAGE, f"{target!r} is a callable that needs arguments ({needs}): {EXPECTED}")
    made = _explained(f"calling {target!r}", found)
    if not isinstance(made, Service):
        fail(USAGE, f"{target!r} returned {_kind(made)}: {EXPECTED}")
    return made


def _kind(value: object) -> str:
    """What ``value`` is, for a message (never its repr: that is the user's code)."""
    if inspect.isclass(value):
        return f"the class {value.__qualname__}"
    return f"a value of type {type(value).__qualname__}"


def _needed_arguments(function: Callable[..., Any]) -> str | None:
    """The parameters ``function`` cannot be called without, or None when it needs none."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read (some builtins): do not guess
        return "unknown"
    try:
        signature.bind()
    except TypeError:
        return ", ".join(name for name, parameter in signature.parameters.items()
                         if parameter.default is parameter.empty
                         and parameter.kind not in (parameter.VAR_POSITIONAL,
                                                    parameter.VAR_KEYWORD))
    return None


def _explained(doing: str, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``; an error of the user's configuration (a Subscriber given a bad
    argument, a missing extra) stops the command with one line saying what was being done.
    Any other error of their code goes on, with its traceback, as a bug to fix."""
    try:
        return call(*args)
    except ImportError:
        raise
    except Exception as error:
        found = classify(error)
        if found is None:
            raise
        fail(found[0], f"{doing}: {found[1]}")


@click.command()
@click.argument("target", metavar="MODULE:ATTRIBUTE")
@click.option("--log-level", type=click.Choice(LEVELS), default="info", show_default=True)
def run(target: str, log_level: str) -> None:
    """Run the Subscriber (or OutboxRelay) MODULE:ATTRIBUTE until SIGINT or SIGTERM.

    The first signal stops it gracefully (running handlers finish, the rest goes back to the
    broker); a second one forces the stop.
    """
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    service = load(target)
    logging.getLogger("reliable_sub.cli").info("running %s", target)
    service.run()


COMMANDS = [run]


__all__ = ["COMMANDS", "load", "run"]
