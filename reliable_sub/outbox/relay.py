"""``OutboxRelay``: publishes what committed in the outbox, oldest first, at least once.

One round (:meth:`OutboxRelay.relay_once`)::

    BEGIN
      pick the oldest pending rows, at most batch_size   -- reliable_sub.outbox.picking: each
                                                          ordering key's rows in order, its key
                                                          locked (PostgreSQL), unkeyed rows
                                                          FOR UPDATE SKIP LOCKED
      publish them, each key's in order                  -- reliable_sub.outbox.publishing: one
                                                          batch call per wave
      UPDATE the published rows SET published_at         -- one statement
      UPDATE each failed row: attempts + 1, last_error, not_before = now + backoff,
                              failed_at once attempts reach max_attempts (parked)
    COMMIT                                               -- PostgreSQL: without waiting for the
                                                          log flush (synchronous_commit off,
                                                          this transaction only)

* **Never skips a row.** Pending rows are found by state, not by an offset, so a transaction
  that commits late with a lower id is published when it commits.
* **Per-key order.** A key's rows are published oldest first, a row only after the one before
  it was confirmed, by one relay at a time; a failed row holds back the rest of its key (a
  parked one until it is re-queued) and no other key. Order is the order in which rows *became
  visible*: of two transactions writing one key concurrently, the one that committed first
  (with the lower id, if both are visible) is published first.
* **At least once.** A relay that dies after publishing and before its commit leaves the rows
  pending (its locks go with its connection); they are published again, with the same
  ``idempotency-key`` attribute, which a consumer's dedup store turns into duplicates. The same
  holds for marks PostgreSQL had not flushed when it crashed: a round's commit does not wait
  for the log flush (the marks are the only writes, and losing them only publishes again), and
  recovery replays the log in order, so a later relay's marks are never kept without an
  earlier one's and each key's rows are published again in order.
* **SQLite** has no row locks: run one relay at a time there. Its rows are read in one short
  transaction and marked in another, so the publish holds no lock that would stall your writers.

:class:`OutboxRelay` runs like a Subscriber (``start``/``stop``, ``run`` with signals,
``serve``/``shutdown``, ``with``): it repeats rounds while they come back full, otherwise waits
for a ``NOTIFY`` from :meth:`Outbox.add` (PostgreSQL) or ``poll_interval`` seconds, and deletes
published rows older than ``retention`` every ``purge_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from typing import Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from .._checks import check_clock, check_with
from .._lifecycle import Service
from .._runtime.supervisor import Supervisor
from .._text import describe_error
from ..clock import Clock, SystemClock
from ..errors import ConfigurationError, MissingExtraError
from ..policy import check_count, check_seconds
from ..ports import Publisher
from ..telemetry.guard import report
from ..telemetry.outbox import OutboxTelemetry
from ..telemetry.producer import SendSpans
from ..telemetry.propagation import extract_json
from ..telemetry.publishing import instrument_publishes
from ..telemetry.semconv import OUTBOX_ROW
from . import maintenance
from .listener import CommitListener
from .maintenance import Backlog
from .outbox import Outbox
from .picking import IDEMPOTENCY_KEY_ATTRIBUTE, Row, RowPicker, release_named_locks
from .publishing import Outcome, publish_in_key_order

try:
    import sqlalchemy as sa
    from sqlalchemy.dialects import postgresql
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("OutboxRelay", "sql", "SQLAlchemy") from error

# A round's marks need not wait for PostgreSQL's log flush (see the module's docstring).
_NO_FLUSH_WAIT = sa.text("SET LOCAL synchronous_commit = off")

logger = logging.getLogger(__name__)

# The longest error text kept on a row.
ERROR_LIMIT = 1000
# Published rows are kept this long (seconds) for inspection before the relay deletes them.
DEFAULT_RETENTION = 7 * 24 * 3600.0
# Seconds between deletions of published rows past their retention.
DEFAULT_PURGE_INTERVAL = 300.0
# Seconds a round's publish may take before its rows count as failed: a hung broker call must
# not hold the rows' locks (and their keys) for ever.
DEFAULT_PUBLISH_TIMEOUT = 30.0
# Real seconds a graceful stop waits for the round under way (publish, mark, commit).
DEFAULT_STOP_TIMEOUT = 30.0
# Seconds between samples of the backlog for the outbox gauges (a dashboard's resolution).
DEFAULT_METRICS_INTERVAL = 15.0


class OutboxRelay(Service):
    """Publishes an :class:`Outbox`'s committed rows through ``adapter``.

    Args:
        outbox: the outbox to read.
        adapter: where to publish (any adapter; a :class:`~reliable_sub.ports.BatchPublisher`
            gets each round's rows in one call).
        batch_size: most rows per round.
        poll_interval: seconds between rounds when there is nothing to do and no ``NOTIFY``;
            also the first wait after a failed round (the database or broker away), doubling
            up to ``max_backoff``.
        max_attempts: failed publishes after which a row is parked (``failed_at`` set).
        min_backoff: seconds a row waits after its first failed publish, doubling after each
            further one up to ``max_backoff``, jittered.
        max_backoff: the longest wait between a row's publishes.
        publish_timeout: seconds a round's publish may take before its rows count as failed.
        retention: seconds published rows are kept before a running relay deletes them; None
            keeps them (delete them yourself with :meth:`purge_published`).
        purge_interval: seconds between those deletions.
        stop_timeout: real seconds a stop that names no timeout waits for the round under way.
        clock: the time source (``wall()`` for the rows, ``sleep`` for waits).
        rng: random source for backoff jitter.
        tracer_provider: where the send span of each row goes (the child of the context
            :meth:`Outbox.add` captured; default: OpenTelemetry's global provider; nothing is
            recorded without an SDK).
        meter_provider: where the outbox metrics go, as ``tracer_provider``.
        metrics_interval: seconds between samples of the backlog for the outbox gauges, while
            a meter records.

    The relay closes ``adapter`` and the outbox's engine of its loop when a run ends; both
    reconnect if used again.
    """

    _usual_name = "relay"
    _work_under_way = "the round under way"
    _forced_stop_gives_up = "the round under way is cancelled; its rows stay pending"

    def __init__(
        self,
        outbox: Outbox,
        adapter: Publisher,
        *,
        batch_size: int = 100,
        poll_interval: float = 1.0,
        max_attempts: int = 10,
        min_backoff: float = 1.0,
        max_backoff: float = 60.0,
        publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT,
        retention: float | None = DEFAULT_RETENTION,
        purge_interval: float = DEFAULT_PURGE_INTERVAL,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        metrics_interval: float = DEFAULT_METRICS_INTERVAL,
    ) -> None:
        super().__init__(stop_timeout=stop_timeout, logger=logger)
        check_count("OutboxRelay", "batch_size", batch_size)
        check_count("OutboxRelay", "max_attempts", max_attempts)
        for name, value in (("poll_interval", poll_interval), ("min_backoff", min_backoff),
                            ("max_backoff", max_backoff), ("publish_timeout", publish_timeout),
                            ("purge_interval", purge_interval),
                            ("metrics_interval", metrics_interval)):
            check_seconds("OutboxRelay", name, value)
        if retention is not None:
            check_seconds("OutboxRelay", "retention", retention)
        if max_backoff < min_backoff:
            raise ConfigurationError(
                f"OutboxRelay.max_backoff ({max_backoff}) must be >= min_backoff ({min_backoff})"
            )
        if not isinstance(outbox, Outbox):
            raise ConfigurationError(f"OutboxRelay needs an Outbox, got {outbox!r}")
        if not callable(getattr(adapter, "publish", None)):
            raise ConfigurationError(f"OutboxRelay needs an adapter with publish(), got "
                                     f"{adapter!r}")
        check_clock("OutboxRelay(clock=)", clock)
        check_with("OutboxRelay(rng=)", rng, "uniform", "a random.Random",
                   "pass random.Random(seed), or None")
        check_with("OutboxRelay(tracer_provider=)", tracer_provider, "get_tracer",
                   "an OpenTelemetry TracerProvider", "pass the SDK's TracerProvider(), or None")
        check_with("OutboxRelay(meter_provider=)", meter_provider, "get_meter",
                   "an OpenTelemetry MeterProvider", "pass the SDK's MeterProvider(), or None")
        self.outbox = outbox
        self.adapter = adapter
        self.batch_size = batch_size
        self.poll_interval = float(poll_interval)
        self.max_attempts = max_attempts
        self.min_backoff = float(min_backoff)
        self.max_backoff = float(max_backoff)
        self.publish_timeout = float(publish_timeout)
        self.retention = None if retention is None else float(retention)
        self.purge_interval = float(purge_interval)
        self._clock: Clock = clock or SystemClock()
        self._rng = rng or random.Random()
        self.metrics_interval = float(metrics_interval)
        self._picker = RowPicker(outbox.table, outbox.dialect)
        self._telemetry = OutboxTelemetry(outbox.table.name, tracer_provider, meter_provider)
        instrument_publishes(adapter, tracer_provider, meter_provider)
        # the broker's messaging.system for send spans (a Publisher need not say)
        capabilities = getattr(adapter, "capabilities", None)
        self._system = getattr(capabilities, "messaging_system", "unknown")
        self._mark_published = self._mark_statement()
        # counters, and what a run is doing (for health checks and tests)
        self.published = 0
        self.publish_errors = 0
        self.parked = 0
        self.rounds = 0
        self.round_failures = 0  # rounds that raised (the database or broker away)
        self.purged = 0
        self.waiting = False  # the run waits for a NOTIFY or its poll
        self._failing = False  # the last round raised
        self._wake = asyncio.Event()
        self._listener: CommitListener | None = None
        self._supervisor: Supervisor | None = None
        self._leave = asyncio.Event()  # the relay loop ends after its round

    def __repr__(self) -> str:
        return f"OutboxRelay({self.outbox!r} -> {type(self.adapter).__name__})"

    # -- one round -----------------------------------------------------------------------------

    def _mark_statement(self) -> Any:
        """UPDATE … SET published_at WHERE id in the batch: on PostgreSQL ``= ANY(array)``, one
        parameter, so the statement's text is the same whatever the batch's size."""
        t = self.outbox.table
        if self.outbox.dialect == "postgresql":
            ids = sa.bindparam("ids", type_=postgresql.ARRAY(sa.BigInteger))
            batch = t.c.id == sa.any_(ids)
        else:
            batch = t.c.id.in_(sa.bindparam("ids", expanding=True))
        return sa.update(t).where(batch).values(published_at=sa.bindparam("now"),
                                                not_before=None)

    async def relay_once(self) -> int:
        """Publish one batch of pending rows; returns how many rows the round took (published,
        failed, or not sent because an earlier row of their key failed)."""
        now = self._clock.wall()
        if self._picker.named_locks:
            return await self._locked_round(now)
        if self.outbox.dialect == "postgresql":
            async with self.outbox.engine.begin() as connection:  # holds the locks
                rows = await self._picker.pick(connection, now, self.batch_size)
                if rows:
                    outcomes = await self._publish(rows)
                    await connection.execute(_NO_FLUSH_WAIT)
                    await self._mark(connection, rows, outcomes)
            return len(rows)
        async with self.outbox.engine.begin() as connection:
            rows = await self._picker.pick(connection, now, self.batch_size)
        if rows:
            outcomes = await self._publish(rows)
            async with self.outbox.engine.begin() as connection:
                await self._mark(connection, rows, outcomes)
        return len(rows)

    async def _locked_round(self, now: float) -> int:
        """A round on MariaDB: as on PostgreSQL, in one transaction, then the keys' named
        locks released on the same connection (they outlive its transaction)."""
        async with self.outbox.engine.connect() as connection:
            try:
                async with connection.begin():
                    rows, held = await self._picker.pick_and_lock(connection, now,
                                                                  self.batch_size)
                    if rows:
                        outcomes = await self._publish(rows)
                        await self._mark(connection, rows, outcomes)
            except BaseException:
                await release_named_locks(connection)  # whatever the round got to
                raise
            if held:
                await release_named_locks(connection)
        return len(rows)

    async def _publish(self, rows: Sequence[Row]) -> list[Outcome]:
        """Publish ``rows``, each ordering key's in order; per row None (published), the error
        that refused it, or NOT_SENT (an earlier row of its key failed). With a tracer, each
        row's publish is a send span, the child of the context its writer captured."""
        messages = [row.outgoing() for row in rows]
        tracer = self._telemetry.tracer()
        if tracer is None:
            return await publish_in_key_order(self.adapter, messages, self.publish_timeout)
        try:
            spans = SendSpans(tracer, self._system, messages,
                              [extract_json(row.trace_context) for row in rows],
                              [{OUTBOX_ROW: row.id} for row in rows])
        except Exception:
            report("OutboxRelay's send spans")
            return await publish_in_key_order(self.adapter, messages, self.publish_timeout)
        outcomes = await publish_in_key_order(self.adapter, spans.messages, self.publish_timeout,
                                              spans.contexts)
        spans.end(outcomes)
        return outcomes

    async def _mark(
        self, connection: Any, rows: Sequence[Row], outcomes: Sequence[Outcome]
    ) -> None:
        t = self.outbox.table
        now = self._clock.wall()
        done = [row.id for row, error in zip(rows, outcomes, strict=True) if error is None]
        if done:
            await connection.execute(self._mark_published, {"ids": done, "now": now})
            self.published += len(done)
            self._telemetry.published(len(done))
        for row, error in zip(rows, outcomes, strict=True):
            if not isinstance(error, BaseException):
                continue
            self.publish_errors += 1
            attempts = row.attempts + 1
            parked = attempts >= self.max_attempts
            text = describe_error(error, ERROR_LIMIT)[:ERROR_LIMIT]
            await connection.execute(
                sa.update(t).where(t.c.id == row.id).values(
                    attempts=attempts, last_error=text,
                    not_before=now + self._backoff(attempts),
                    failed_at=now if parked else None,
                )
            )
            if parked:
                self.parked += 1
                logger.error("outbox row %d (key %r, topic %r) failed %d times and is parked: "
                             "%s; its ordering key %r waits until it is re-queued",
                             row.id, row.key, row.topic, attempts, text, row.ordering_key)
            else:
                logger.warning("publishing outbox row %d (key %r, topic %r) failed (attempt "
                               "%d of %d): %s", row.id, row.key, row.topic, attempts,
                               self.max_attempts, text)

    def _backoff(self, attempts: int) -> float:
        exponent = min(attempts - 1, 64)  # 2**64 x any backoff is past any max_backoff
        ceiling = min(self.max_backoff, self.min_backoff * 2.0**exponent)
        return self._rng.uniform(self.min_backoff, max(self.min_backoff, ceiling))

    # -- operations -----------------------------------------------------------------------------

    async def requeue_parked(self, keys: Sequence[str] | None = None) -> int:
        """Make parked rows (all, or those with ``keys``) pending again, with fresh attempts;
        returns how many."""
        return await maintenance.requeue_parked(self.outbox, keys)

    async def purge_published(self, older_than: float, batch_size: int = 1000) -> int:
        """Delete rows published more than ``older_than`` seconds ago, ``batch_size`` at a
        time; returns how many. (Parked and pending rows are never deleted.)"""
        if not isinstance(older_than, int | float) or not older_than >= 0:
            raise ConfigurationError(
                f"OutboxRelay.purge_published: older_than must be >= 0, got {older_than!r}")
        return await maintenance.purge_published(
            self.outbox, self._clock.wall() - older_than, batch_size)

    async def backlog(self) -> Backlog:
        """Pending rows, the age in seconds of the oldest (None when there is none), and parked
        rows."""
        return await maintenance.backlog(self.outbox, self._clock.wall())

    # -- running (see reliable_sub._lifecycle for start/stop, run, serve/shutdown) --------------

    def healthy(self) -> bool:
        """True while running with its loops alive and its last round through (for a
        readiness probe): False while the database or the broker fails its rounds."""
        supervisor = self._supervisor
        return (self.running and supervisor is not None and not supervisor.problems()
                and not self._failing)

    @property
    def listening(self) -> bool:
        """True while ``LISTEN`` is in place (PostgreSQL): commits wake the relay at once."""
        return self._listener is not None and self._listener.listening

    async def _open(self) -> None:
        await self._check_table()
        self._leave = asyncio.Event()
        self._wake = asyncio.Event()
        self._listener = CommitListener(self.outbox, self._wake, self._clock,
                                        self.poll_interval)
        supervisor = self._supervisor = Supervisor(self._clock.sleep, self._clock.now,
                                                   owner="OutboxRelay", logger=logger)
        supervisor.spawn("outbox relay", self._relay_loop, lambda: not self._leave.is_set())
        if self.outbox.dialect == "postgresql":
            supervisor.spawn("outbox listener", self._listener.run)
        if self.retention is not None:
            supervisor.spawn("outbox purge", self._purge_loop)
        if self._telemetry.instruments() is not None:
            supervisor.spawn("outbox metrics", self._metrics_loop)
        logger.info("outbox relay started: %r, batch_size %d, poll_interval %gs, %s",
                    self, self.batch_size, self.poll_interval,
                    "LISTEN/NOTIFY" if self.outbox.dialect == "postgresql" else "polling")

    async def _check_table(self) -> None:
        t = self.outbox.table
        try:
            async with self.outbox.engine.connect() as connection:
                await connection.execute(sa.select(t.c.id).limit(0))
        except Exception as error:
            await self.outbox.close()
            cause = getattr(error, "orig", None) or error  # the driver's words, without the SQL
            raise ConfigurationError(
                f"OutboxRelay cannot read the outbox table {t.name!r} on {self.outbox.dialect} "
                f"({type(cause).__name__}: {cause}); is the database reachable, and was the "
                "table created (outbox.create_schema() or your migrations)?"
            ) from error

    async def _close(self, timeout: float, force: asyncio.Event) -> None:
        supervisor = self._supervisor
        try:
            if supervisor is not None:
                self._leave.set()
                self._wake.set()  # out of its wait, if it waits
                forced = asyncio.ensure_future(force.wait())
                try:
                    await asyncio.wait(
                        [forced, asyncio.ensure_future(
                            supervisor.wait(["outbox relay"], timeout))],
                        return_when=asyncio.FIRST_COMPLETED)
                finally:
                    forced.cancel()
                await supervisor.stop()
        finally:
            self._supervisor = None
            await asyncio.gather(self.outbox.close(), self.adapter.close(),
                                 return_exceptions=True)

    def _log_stopped(self) -> None:
        logger.info("outbox relay stopped: %d published, %d publish errors, %d parked",
                    self.published, self.publish_errors, self.parked)

    async def _relay_loop(self) -> None:
        """Rounds back to back while they come back full, else a wait for ``NOTIFY`` or the
        poll; a round that raises is retried with a growing, jittered wait (tenacity)."""
        retrying = AsyncRetrying(
            wait=wait_random_exponential(multiplier=self.poll_interval, max=self.max_backoff),
            retry=retry_if_exception_type(Exception),
            stop=lambda _state: self._leave.is_set(),
            retry_error_callback=lambda _state: 0,  # stopping while rounds fail
            before_sleep=self._round_failed,
            sleep=self._wait,
        )
        while not self._leave.is_set():
            self.rounds += 1
            taken: int = await retrying(self.relay_once)
            self._failing = False
            if taken < self.batch_size and not self._leave.is_set():
                await self._wait(self.poll_interval)

    def _round_failed(self, state: RetryCallState) -> None:
        self.round_failures += 1
        self._failing = True
        error = state.outcome.exception() if state.outcome is not None else None
        logger.warning("outbox relay round failed (%s); retrying in %.2fs",
                       describe_error(error, 500) if error is not None else None,
                       state.next_action.sleep if state.next_action else 0.0,
                       exc_info=error if state.attempt_number == 1 else None)

    async def _wait(self, seconds: float) -> None:
        """Wait ``seconds`` on the clock, or less: a ``NOTIFY`` or a stop ends the wait."""
        if self._leave.is_set():
            return
        self._wake.clear()
        waiters = [asyncio.ensure_future(self._wake.wait()),
                   asyncio.ensure_future(self._clock.sleep(seconds))]
        self.waiting = True
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting = False
            for waiter in waiters:
                waiter.cancel()

    async def _metrics_loop(self) -> None:
        """Sample the backlog for the outbox gauges every ``metrics_interval`` seconds."""
        while True:
            try:
                found = await self.backlog()
                self._telemetry.backlog(found.pending, found.oldest_age, found.parked)
            except Exception:
                logger.warning("sampling the outbox backlog failed; trying again in %gs",
                               self.metrics_interval, exc_info=True)
            await self._clock.sleep(self.metrics_interval)

    async def _purge_loop(self) -> None:
        assert self.retention is not None
        while True:
            await self._clock.sleep(self.purge_interval)
            try:
                deleted = await self.purge_published(self.retention)
            except Exception:
                logger.warning("deleting published outbox rows failed; trying again in %gs",
                               self.purge_interval, exc_info=True)
                continue
            self.purged += deleted
            if deleted:
                logger.debug("deleted %d published outbox rows", deleted)


__all__ = ["IDEMPOTENCY_KEY_ATTRIBUTE", "Backlog", "OutboxRelay"]
