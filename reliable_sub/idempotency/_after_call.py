"""The steps of an ``@idempotent`` call while and after its function runs: renewing its claim,
turning its result into the stored record, completing or releasing the claim, and handing that
over to a task or the background loop when the caller is interrupted meanwhile (see
:mod:`~reliable_sub.idempotency.decorator` for the behaviour). :class:`Settings` lives here, the
first module of the call's steps that reads them."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from .._results import encode_result
from ..clock import Clock, sleep_or_event
from ..errors import ResultNotSerializableError
from ..ports import Claimed, Completion, DedupStore, SyncDedupStore
from ._renewer import RENEWALS_PER_LEASE
from ._settling import Settling

# The decorator's name: logging configurations written for it keep matching.
logger = logging.getLogger("reliable_sub.idempotency.decorator")


@dataclass(frozen=True)
class Settings:
    """An ``@idempotent`` function's settings, as :func:`~.decorator.idempotent` checked them."""

    store: DedupStore
    key: str | Callable[..., str]
    ttl: float
    lease_ttl: float
    on_in_progress: str
    wait_timeout: float
    validate_payload: bool
    namespace: str | None
    clock: Clock


@dataclass
class Heartbeat:
    """A running call's renewals: set ``stop`` to end them; ``task`` ends with them."""

    stop: asyncio.Event
    task: asyncio.Future[None]


class AfterCall:
    """The steps after the claim, for :class:`~reliable_sub.idempotency._core.Core`."""

    name: str
    settings: Settings
    settling: Settling
    shield: bool

    async def start_heartbeat(self, claim: Claimed, key: str) -> Heartbeat:
        """Renew ``claim`` every ``lease_ttl / 3`` until stopped (in the running loop)."""
        stop = asyncio.Event()
        return Heartbeat(stop, asyncio.ensure_future(self._renew(claim, key, stop)))

    async def _renew(self, claim: Claimed, key: str, stop: asyncio.Event) -> None:
        settings = self.settings
        interval = settings.lease_ttl / RENEWALS_PER_LEASE
        while True:
            await sleep_or_event(settings.clock, stop, interval)
            if stop.is_set():
                return
            try:
                lost = await settings.store.renew([claim], settings.lease_ttl)
            except Exception:
                logger.warning(
                    "@idempotent %s: renewing the claim of idempotency key %r failed; retrying "
                    "in %.3gs", self.name, key, interval, exc_info=True,
                )
                continue
            if lost:
                self.claim_lost(key)
                return

    def claim_lost(self, key: str) -> None:
        """Log that the claim of ``key`` was lost while the call ran (renewals found it)."""
        logger.warning(
            "@idempotent %s: the claim of idempotency key %r lapsed or was taken over "
            "while the call runs; another call may run it too, and this call's result "
            "will not be stored if a peer holds the key", self.name, key,
        )

    def record(self, value: Any, fingerprint: str | None) -> str:
        """The JSON text to store: ``{"p": fingerprint, "r": value}``."""
        if inspect.isawaitable(value):  # a sync function that handed back its work unrun
            if inspect.iscoroutine(value):
                value.close()
            raise ResultNotSerializableError(
                f"@idempotent {self.name}: the function returned an awaitable, so its work did "
                "not run; declare it 'async def' (a plain decorator around an 'async def' "
                "should keep functools.wraps); nothing was stored and the key was released"
            )
        try:
            result_json = encode_result(value)
        except ResultNotSerializableError as error:
            raise ResultNotSerializableError(
                f"@idempotent {self.name}: {error}; nothing was stored and the key was "
                "released"
            ) from error
        stamp = "null" if fingerprint is None else f'"{fingerprint}"'  # hex: no escapes
        return f'{{"p":{stamp},"r":{result_json}}}'

    async def settle(
        self, beat: Heartbeat, claim: Claimed, key: str, record: str | None
    ) -> None:
        """:meth:`finish`; a caller cancelled meanwhile leaves it to be done in a task of its
        own, which later calls with ``key`` wait for (see :mod:`._settling`)."""
        if self.shield:
            finishing = asyncio.ensure_future(self.finish(beat, claim, key, record))
            try:
                await asyncio.shield(finishing)
            except asyncio.CancelledError:
                self.settling.track(key, finishing)
                raise
            return
        try:
            await self.finish(beat, claim, key, record)
        except asyncio.CancelledError:  # the store call with it, maybe in flight: again
            self.settling.redo(key, self.finish_again(beat, claim, key, record))
            raise

    def finish_on_background(
        self, beat: Heartbeat, claim: Claimed, key: str, record: str | None
    ) -> None:
        """:meth:`finish` on the background loop; a caller interrupted while it waits leaves
        it running there, and later calls with ``key`` wait for it."""
        self.settling.on_background(
            key, self.finish(beat, claim, key, record), self.settings.store
        ).result()

    async def finish(
        self, beat: Heartbeat, claim: Claimed, key: str, record: str | None
    ) -> None:
        """Stop renewing; store ``record`` (or, without one, release the claim)."""
        beat.stop.set()
        await beat.task
        await self.settle_claim(claim, key, record)

    async def finish_again(
        self, beat: Heartbeat, claim: Claimed, key: str, record: str | None
    ) -> None:
        """:meth:`finish` after a cancelled one: completing or releasing the same claim twice
        is harmless, and the heartbeat may have been cancelled with its caller."""
        beat.stop.set()
        await asyncio.wait([beat.task])
        await self.settle_claim(claim, key, record)

    async def settle_claim(self, claim: Claimed, key: str, record: str | None) -> None:
        """Store ``record`` for ``claim`` (or, without one, release it)."""
        store = self.settings.store
        if record is None:
            try:
                await store.release_many([claim], 0.0)
            except Exception:
                self.release_failed(key)
            return
        try:
            refused = await store.complete_many([Completion(claim, record)], self.settings.ttl)
        except Exception:
            self.completion_failed(key)
            return
        if refused:
            self.completion_refused(key)

    def finish_sync(
        self, store: SyncDedupStore, claim: Claimed, key: str, record: str | None
    ) -> None:
        """:meth:`finish` with the store's blocking twins (the caller stopped renewing); a
        caller interrupted in the store call hands it over to the background loop."""
        try:
            if record is None:
                try:
                    store.release_many_sync([claim], 0.0)
                except Exception:
                    self.release_failed(key)
                return
            try:
                refused = store.complete_many_sync([Completion(claim, record)],
                                                   self.settings.ttl)
            except Exception:
                self.completion_failed(key)
                return
        except BaseException:  # interrupted (a signal handler's exception, KeyboardInterrupt)
            self.hand_over(key, self.settle_claim(claim, key, record))
            raise
        if refused:
            self.completion_refused(key)

    def hand_over(self, key: str, settle: Coroutine[Any, Any, None]) -> None:
        """Run ``settle`` on the background loop, for a sync caller interrupted in it (the same
        store call again: completing and releasing a claim twice is harmless)."""
        try:
            self.settling.on_background(key, settle, self.settings.store)
        except Exception:  # e.g. at interpreter exit: no thread can start
            logger.warning(
                "@idempotent %s: the call with idempotency key %r was interrupted while it "
                "settled its claim, which could not be finished in the background; a retry "
                "can run once the claim lapses (lease_ttl)", self.name, key, exc_info=True,
            )

    def release_failed(self, key: str) -> None:
        logger.warning(
            "@idempotent %s: releasing idempotency key %r failed; a retry can run "
            "once its claim lapses (lease_ttl)", self.name, key, exc_info=True,
        )

    def completion_failed(self, key: str) -> None:
        logger.error(
            "@idempotent %s: storing the result of idempotency key %r failed; the result "
            "is returned, but a later call with this key may run the function again",
            self.name, key, exc_info=True,
        )

    def completion_refused(self, key: str) -> None:
        logger.warning(
            "@idempotent %s: the claim of idempotency key %r was lost to another call "
            "before this one finished; its result is returned but not stored (the other "
            "call's record stands)", self.name, key,
        )
