"""``reliable-sub run module:attribute``: run a Subscriber (or an OutboxRelay) of your code."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

import click

LEVELS = ["critical", "error", "warning", "info", "debug"]


def load(target: str) -> Any:
    """The object ``module:attribute`` names; a callable one is called for it (a factory)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise click.BadParameter(f"{target!r}: expected module:attribute, e.g. app.workers:sub")
    sys.path.insert(0, os.getcwd())  # as uvicorn and faststream do: the project's modules
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise click.BadParameter(f"cannot import {module_name!r}: {error}") from None
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise click.BadParameter(f"{module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not hasattr(found, "run") and callable(found):
        found = found()
    if not callable(getattr(found, "run", None)):
        raise click.BadParameter(f"{target!r} is {found!r}: expected a Subscriber or an "
                                 "OutboxRelay (something with run()), or a function that "
                                 "returns one")
    return found


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
