"""libpq's protocol trace of every connection an engine opens, for tests that count round
trips to PostgreSQL exactly: one ``ReadyForQuery`` from the server per round trip.

libpq writes the trace through a buffered stdio stream, flushed when tracing stops: every read
here first stops and restarts the trace of each connection, so it sees everything sent so far.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine


class Trace:
    """The trace of every connection of the engines it follows, in one file."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile(prefix="pq-trace-", delete=False)  # noqa: SIM115
        self._connections: list[Any] = []

    def follow(self, engine: AsyncEngine) -> None:
        """Trace every connection ``engine`` opens from now on."""
        sa.event.listen(engine.sync_engine, "connect", self._attach)

    def _attach(self, dbapi_connection: Any, _record: Any) -> None:
        pgconn = dbapi_connection.driver_connection.pgconn
        self._connections.append(pgconn)
        self._start(pgconn)

    def _start(self, pgconn: Any) -> None:
        import psycopg

        pgconn.trace(self.file.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)

    def _flush(self) -> None:
        for pgconn in self._connections:
            if pgconn.status == 0:  # CONNECTION_OK: (a closed one flushed as it closed)
                pgconn.untrace()  # flushes its stream
                self._start(pgconn)

    def lines(self) -> list[str]:
        self._flush()
        with open(self.file.name, encoding="utf-8", errors="replace") as lines:
            return [line.rstrip() for line in lines]

    def round_trips(self) -> int:
        return sum(1 for line in self.lines() if "\tReadyForQuery\t" in line)

    def sent(self, fragment: str) -> int:
        """Simple queries and statements sent whose text holds ``fragment``."""
        return sum(1 for line in self.lines()
                   if ("\tQuery\t" in line or "\tParse\t" in line) and fragment in line)

    def close(self) -> None:
        for pgconn in self._connections:
            if pgconn.status == 0:
                pgconn.untrace()
        self.file.close()
        os.unlink(self.file.name)
