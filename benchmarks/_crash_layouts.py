"""The store layouts the crash-window figures are taken for, and the private Redis they need.

* ``redis, store on the broker``: RedisDedupStore on the broker's Redis; completions are written
  inside the ack script (one call records and acks).
* ``redis, store apart``: RedisDedupStore on a second redis-server; completions are one store
  call, then the ack.
* ``redis broker, SQL store``: SqlDedupStore on PostgreSQL with a plain (not transactional)
  handler; completions are one ``UPDATE`` per batch. (Window only: the kill storms' consumer
  has no plain SQL handler.)
* ``redis broker, transactional SQL handler``: the effect and the completion commit in one
  transaction, so there is no window (a crash leaves both or neither); kill storms only.
* ``redis, no store``: the baseline the kill storms are read against (every message in flight
  after its effect runs again); kill storms only.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.redis_processes import RedisServer


@dataclass(frozen=True)
class Layout:
    name: str  # as printed in the tables
    key: str  # as given on the command line
    dedup: str  # "redis", "sql" or "none": the store (the chaos consumer's dedup mode)
    store_apart: bool  # Redis store on a redis-server other than the broker's
    window: bool  # measured by ``window``
    kills: bool  # measured by ``kills``


LAYOUTS = {
    layout.key: layout for layout in (
        Layout("redis, store on the broker", "redis-on-broker", "redis", False, True, True),
        Layout("redis, store apart", "redis-apart", "redis", True, True, True),
        Layout("redis broker, SQL store, plain handler", "sql-plain", "sql", False, True,
               False),
        Layout("redis broker, transactional SQL handler", "sql-transactional", "sql", False,
               False, True),
        Layout("redis, no store (baseline)", "none", "none", False, False, True),
    )
}
WINDOW_LAYOUTS = [key for key, layout in LAYOUTS.items() if layout.window]
KILL_LAYOUTS = [key for key, layout in LAYOUTS.items() if layout.kills]


@contextmanager
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of our own (no persistence) on a free port, killed at the end."""
    with tempfile.TemporaryDirectory(prefix="crash-window-") as directory:
        server = RedisServer(Path(directory), appendonly=False)
        server.start()
        try:
            yield server
        finally:
            server.kill()
