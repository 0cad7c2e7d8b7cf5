"""A consumer process run through rounds of messages at full speed, reporting its memory.

``python tests/chaos/load.py CONFIG_JSON`` with ``adapter`` (``memory`` or ``redis``),
``messages`` per round, ``rounds``, ``warm_up`` messages, and for Redis ``redis_url``. One
Subscriber runs throughout (on Redis with the Redis dedup store on the same server); each
round publishes its messages as fast as the adapter takes them while the Subscriber consumes,
waits until all are acked, collects garbage and prints one ``ROUND {json}`` line: resident
memory, Python's allocated blocks, what the Subscriber still tracks. A no-op handler, so the
figures are the library's own.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reliable_sub import FlowControl, Message, Outcome, Subscriber
from reliable_sub.ports import Adapter, BatchPublisher, DedupStore, Outgoing

TOPIC, SUBSCRIPTION = "load", "load-sub"
PUBLISH_BATCH = 1000
# Seconds a round may take before the child gives up (a stuck consumer fails the test).
ROUND_LIMIT = 120.0


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS: resident now; VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


async def make(config: dict[str, Any]) -> tuple[Adapter, DedupStore | None]:
    if config["adapter"] == "memory":
        from reliable_sub.adapters.memory import MemoryAdapter

        memory = MemoryAdapter()
        memory.ensure_subscription_sync(TOPIC, SUBSCRIPTION, ack_deadline=30.0)
        return memory, None
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.dedup import RedisDedupStore

    redis_adapter = RedisStreamsAdapter(config["redis_url"], consumer="load-1")
    await redis_adapter.ensure_subscription(TOPIC, SUBSCRIPTION, ack_deadline=30.0)
    return redis_adapter, RedisDedupStore(config["redis_url"])


async def publish(adapter: Adapter, count: int, start: int) -> None:
    for first in range(start, start + count, PUBLISH_BATCH):
        batch = [f"m-{n}".encode() for n in range(first, min(first + PUBLISH_BATCH,
                                                             start + count))]
        if isinstance(adapter, BatchPublisher):  # Redis: one pipelined call per batch
            await adapter.publish_many([Outgoing(TOPIC, data) for data in batch])
        else:
            await asyncio.gather(*(adapter.publish(TOPIC, data) for data in batch))


def release_free_memory() -> None:
    """Collect garbage and hand the allocator's free pages back (glibc's ``malloc_trim``), so
    resident memory shows what is held, not what the allocator happens to keep."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_in_use_kib() -> int | None:
    """KiB the C allocator has handed out and not had back (glibc's ``mallinfo2``: in-use
    chunks plus mmapped ones), which free fragments do not move as they move resident memory;
    None without glibc 2.33+."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name)
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int((info.uordblks + info.hblkhd) // 1024)


def internals(sub: Subscriber) -> dict[str, int]:
    """What the Subscriber still holds per message: nothing, after a drain."""
    runtime: Any = sub._runtime
    return {
        "in_flight": len(runtime.items),
        "leased": sum(len(lane.lease) for lane in runtime.lanes.values()),
    }


async def main(config: dict[str, Any]) -> None:
    adapter, dedup = await make(config)
    outcomes: Counter[Outcome] = Counter()

    def on_outcome(message: Message, outcome: Outcome) -> None:
        outcomes[outcome] += 1

    sub = Subscriber(adapter, dedup=dedup, on_outcome=on_outcome, dedup_ttl=600.0,
                     flow_control=FlowControl(max_messages=1000), loop_lag_warning=None)

    @sub.handler(SUBSCRIPTION)
    async def handle(message: Message) -> None:
        return None

    published = 0
    async with sub:
        sizes = [config["warm_up"]] + [config["messages"]] * config["rounds"]
        for number, size in enumerate(sizes):
            started = time.perf_counter()
            await publish(adapter, size, published)
            published += size
            give_up = time.monotonic() + ROUND_LIMIT
            while sum(outcomes.values()) < published:
                if time.monotonic() > give_up:
                    raise SystemExit(f"round {number}: {sum(outcomes.values())} of "
                                     f"{published} settled after {ROUND_LIMIT}s")
                await asyncio.sleep(0.02)
            seconds = time.perf_counter() - started
            release_free_memory()
            print("ROUND " + json.dumps({
                "round": number, "messages": size, "seconds": round(seconds, 2),
                "rate": round(size / seconds), "rss_kib": status_kib("VmRSS"),
                "peak_kib": status_kib("VmHWM"), "blocks": sys.getallocatedblocks(),
                "malloc_kib": malloc_in_use_kib(),
                "outcomes": {outcome.value: count for outcome, count in outcomes.items()},
                **internals(sub),
            }), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
