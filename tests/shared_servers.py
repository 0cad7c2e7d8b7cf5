"""Servers one test run shares among its xdist workers, started by the first worker that asks.

An idle Kafka node costs a tenth of a core (measured here: 9-11 % of one, its KRaft quorum's
loop and heartbeats), and every worker once started its own for the session: four of them
took 0.4 of the machine's two cores for the whole run, besides the tests' own work. A test that
needs a server no other test may disturb (one it kills or restarts) starts a private one.

The run's first process (xdist's controller, or pytest alone) calls :func:`configure`: it makes
the directory the servers live in and names it in the environment, which the workers inherit.
:func:`shared` starts a server once under a file lock and records it there; every later caller
reads the record. :func:`unconfigure`, in that same first process after the workers are gone,
kills each recorded process by its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

ENVIRONMENT = "RELIABLE_SUB_SHARED_SERVERS"
# A SIGKILLed JVM is gone in well under a second; a loaded machine may take longer to reap it.
_EXIT_TIMEOUT = 30.0
_POLL = 0.05


def configure() -> None:
    """Make this run's directory of shared servers (in the run's first process only)."""
    if ENVIRONMENT not in os.environ:
        os.environ[ENVIRONMENT] = tempfile.mkdtemp(prefix="reliable-sub-servers-")


def unconfigure() -> None:
    """Kill every server this run shared, and remove their directory."""
    root = os.environ.pop(ENVIRONMENT, None)
    if root is not None:
        kill_all(Path(root))


def kill_all(root: Path) -> None:
    """Kill every server recorded in ``root``, and remove it."""
    for record in root.glob("*.json"):
        _kill(int(json.loads(record.read_text())["pid"]))
    shutil.rmtree(root, ignore_errors=True)


def shared(name: str, start: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """The record of the run's server ``name``: ``start(directory)`` starts it, the first time
    only, and returns what its users need to reach it (JSON, with its ``pid``)."""
    root = Path(os.environ[ENVIRONMENT])
    record = root / f"{name}.json"
    with FileLock(root / f"{name}.lock"):
        if not record.exists():
            directory = root / name
            directory.mkdir(exist_ok=True)
            details = start(directory)
            record.write_text(json.dumps(details))
        return dict(json.loads(record.read_text()))


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):  # pytest without xdist started it: reap it
        os.waitpid(pid, 0)
        return
    give_up = time.monotonic() + _EXIT_TIMEOUT
    while time.monotonic() < give_up:  # a worker's child, now init's: wait until it is gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(_POLL)
    raise AssertionError(f"the shared server with pid {pid} did not exit after SIGKILL")
