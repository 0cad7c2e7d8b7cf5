"""Batches acks and nacks: one broker call for everything that settled since the last call.

There is no flush timer. The settler waits for the first settlement, lets the event loop run once
so that handlers finishing together join in, and sends the batch; while that call is in flight the
next batch gathers. Under load batches grow by themselves; when idle an ack goes out at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from .adapters.base import Adapter
from .dedup import DedupStore
from .message import Delivery

logger = logging.getLogger(__name__)

# A failed ack or nack call is retried this many times (waits of 0.1, 0.2, 0.4, 0.8 and 1.6 s:
# about 3 s in all) before the messages are left to their ack deadline: they come back, and the
# dedup store makes the redelivery harmless.
SETTLE_ATTEMPTS = 6
SETTLE_WAIT_MIN = 0.1
SETTLE_WAIT_MAX = 2.0


def quantize_delay(delay: float) -> float:
    """Round a nack delay up to two significant digits so jittered delays can share a call."""
    if delay <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(delay)) - 1)
    return math.ceil(delay / step - 1e-9) * step


class Settler:
    """Queues acks and nacks and sends them to the adapter in batches.

    An ack may carry a dedup completion ``(key, result_json)``: completions of a batch are written
    with one ``complete_many`` call just before its acks, so a message is recorded as done before
    the broker forgets it.
    """

    def __init__(
        self,
        adapter: Adapter,
        *,
        dedup: DedupStore | None = None,
        dedup_ttl: float = 0.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_refused: Callable[[list[Delivery]], None] | None = None,
        on_error: Callable[[str, int], None] | None = None,
    ) -> None:
        self._adapter = adapter
        self._dedup = dedup
        self._dedup_ttl = dedup_ttl
        self._sleep = sleep
        self._on_refused = on_refused
        self._on_error = on_error
        self._acks: list[Delivery] = []
        self._completions: list[tuple[str, str]] = []
        self._nacks: dict[float, list[Delivery]] = {}
        self._pending = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        # The fast path: an adapter that can write completions in its ack call (Redis Streams
        # with a RedisDedupStore on the same server) saves one round trip per batch.
        shares_store = getattr(adapter, "shares_store", None)
        self._combined = bool(
            dedup is not None and callable(shares_store) and shares_store(dedup)
            and hasattr(adapter, "ack_with_completions")
        )

    def ack(self, delivery: Delivery, completion: tuple[str, str] | None = None) -> None:
        """Queue an ack, after recording ``completion`` (key, result JSON) in the dedup store."""
        self._acks.append(delivery)
        if completion is not None:
            self._completions.append(completion)
        if self._idle.is_set():
            self._wake()

    def nack(self, delivery: Delivery, delay: float) -> None:
        self._nacks.setdefault(quantize_delay(delay), []).append(delivery)
        if self._idle.is_set():
            self._wake()

    def _wake(self) -> None:
        self._idle.clear()
        self._pending.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="settler")

    async def flush(self) -> None:
        """Wait until everything queued so far has been sent (or given up on)."""
        if self._task is None or self._task.done():
            await self._send_all()
            return
        await self._idle.wait()

    async def stop(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._pending.wait()
            await asyncio.sleep(0)  # let handlers finishing in this loop turn join the batch
            await self._send_all()

    async def _send_all(self) -> None:
        while self._acks or self._nacks or self._completions:
            self._pending.clear()
            acks, self._acks = self._acks, []
            completions, self._completions = self._completions, []
            nacks, self._nacks = self._nacks, {}
            if completions and acks and self._combined:
                refused = await self._call(
                    "recording completions and ack", len(acks),
                    self._adapter.ack_with_completions,  # type: ignore[attr-defined]
                    acks, self._dedup, completions, self._dedup_ttl,
                )
            else:
                if completions and self._dedup is not None:
                    await self._call(
                        "recording completions", len(completions), self._dedup.complete_many,
                        completions, self._dedup_ttl,
                    )
                refused = []
                if acks:
                    refused = await self._call("ack", len(acks), self._adapter.ack, acks)
            if refused and self._on_refused is not None:
                self._on_refused(refused)
            for delay, deliveries in nacks.items():
                await self._call("nack", len(deliveries), self._adapter.nack, deliveries, delay)
        self._pending.clear()
        self._idle.set()

    async def _call(self, what: str, count: int, method, *args):  # type: ignore[no-untyped-def]
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(SETTLE_ATTEMPTS),
                wait=wait_exponential(multiplier=SETTLE_WAIT_MIN, max=SETTLE_WAIT_MAX),
                retry=retry_if_exception_type(Exception),
                reraise=True,
                sleep=self._sleep,
            ):
                with attempt:
                    return await method(*args)
        except Exception:
            if self._on_error is not None:
                self._on_error(what, count)
            logger.error(
                "%s for %d deliveries failed %d times; acks that fail are redelivered after "
                "their ack deadline, completions that fail leave their claims to expire",
                what, count, SETTLE_ATTEMPTS, exc_info=True,
            )
        return None
