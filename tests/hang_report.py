"""A hung test names its awaits: shortly before pytest-timeout fails it, the stack of every task
of every running event loop goes to stderr (pytest-timeout prints threads only, and a loop
waiting on a future with no timer shows nothing but ``select``)."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Iterator

import pytest

# How long before the test's timeout the tasks are printed.
LEAD = 10.0


def _print_running_tasks(nodeid: str) -> None:
    loops = [obj for obj in gc.get_objects()
             if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running()]
    print(f"\n=== {nodeid} is about to time out: tasks of {len(loops)} running event loops",
          file=sys.stderr, flush=True)
    for loop in loops:
        for task in asyncio.all_tasks(loop):
            print(f"--- {task!r}", file=sys.stderr)
            task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


@pytest.fixture(autouse=True)
def _tasks_printed_if_hung(request: pytest.FixtureRequest) -> Iterator[None]:
    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(
        request.config.getini("timeout") or 0)
    if timeout <= LEAD:
        yield
        return
    timer = threading.Timer(timeout - LEAD, _print_running_tasks, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
