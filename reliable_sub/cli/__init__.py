"""The ``reliable-sub`` command (extra ``cli``): dead-letter queues, seek and snapshots, the
outbox, a subscription's figures, and running a Subscriber defined in your code.

``reliable-sub --help`` lists the commands; docs/operations/cli.md shows them at work.
"""

from __future__ import annotations

import sys


def main() -> None:
    """The console script's entry point."""
    try:
        from .app import cli
    except ImportError as error:  # click or rich missing: the cli extra is not installed
        print(f"error: reliable-sub needs the cli extra ({error}); run: "
              'pip install "reliable-sub[cli]"', file=sys.stderr)
        sys.exit(2)
    cli(prog_name="reliable-sub")


__all__ = ["main"]
