"""A hung test names its awaits: shortly before pytest-timeout fails it, the stack of every task
of every running event loop goes to stderr (pytest-timeout prints threads only, and a loop
waiting on a future with no timer shows nothing but ``select``). Each task's stack is its whole
chain of awaits, down to the future it waits on (``Task.print_stack`` shows only the outermost
coroutine of a suspended task)."""

from __future__ import annotations

import asyncio
import gc
import linecache
import sys
import threading
from collections.abc import Iterator
from typing import Any

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
            print("\n".join(await_chain(task)), file=sys.stderr)
    sys.stderr.flush()


def await_chain(task: asyncio.Task[Any], limit: int = 30) -> list[str]:
    """Where ``task`` waits: each coroutine it awaits through, outermost first (file, line,
    function and source line), then the future the innermost one waits on."""
    lines: list[str] = []
    awaited: Any = task.get_coro()
    while awaited is not None and len(lines) < limit:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:  # a future's iterator, or a finished coroutine: the chain's end
            break
        code = frame.f_code
        source = linecache.getline(code.co_filename, frame.f_lineno).strip()
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'
                     f"\n    {source}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    lines.append(f"  awaiting {getattr(task, '_fut_waiter', None)!r}")
    return lines


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
