"""Telemetry's cost: a Subscriber with tracing and metrics on, off, and the API alone.

    python -m benchmarks.telemetry            # print the table
    python -m benchmarks.telemetry --write    # ... and rewrite the README section

Off (no-op providers), the API alone (no SDK) and the SDK (batched spans and periodic metrics
into no-op exporters) on the in-memory broker and Redis Streams, then with a handler that
works; beside them the SDK's own floor (``benchmarks._telemetry_floor``) and FastStream with
its telemetry middleware. What the README says of them: ``templates/telemetry.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from typing import Any

import redis.asyncio as aioredis

from benchmarks import memory_pipeline as memory
from benchmarks import redis_streams as redis_bench
from benchmarks._brokers import Consumer, wait_drained
from benchmarks._common import Rates, positive_int, verdict
from benchmarks._harness import measured_on, publish, render
from benchmarks._telemetry_floor import (
    API,
    DASHBOARD,
    METRICS_ONLY,
    OFF,
    SDK,
    VARIANTS,
    WORK,
    WORK_VARIANTS,
    floor_seconds,
    providers,
)
from reliable_sub import FlowControl, Message, Outcome, Subscriber

DEFAULT_MESSAGES = 30_000
DEFAULT_REDIS_MESSAGES = 10_000
DEFAULT_REPETITIONS = 5
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
WARMUP_MESSAGES = 2_000
DEFAULT_WORK_MESSAGES = 4_000
WORK_SECONDS = 0.0005  # CPU time the working handler spends per message
SECTION_NAME = "telemetry"
COMMAND = "python -m benchmarks.telemetry --write"
FLOOR = "SDK floor"
FLOOR_OPEN = "SDK floor, spans open as in flight"
# A Subscriber keeps a span open per message in flight: up to FlowControl's max_messages.
OPEN_SPANS = FlowControl().max_messages
PEER = "redis, FastStream (one message per call)"
FS_OFF = "FastStream, no telemetry"
FS_OTEL = "FastStream + RedisTelemetryMiddleware (SDK)"
DEFAULT_PEER_MESSAGES = 2_000

async def working_handler(message: Message) -> None:
    """A handler that computes for WORK_SECONDS (CPU, holding the event loop) per message."""
    until = time.perf_counter() + WORK_SECONDS
    while time.perf_counter() < until:
        pass


async def run_memory(variant: str, messages: int, work: bool = False) -> float:
    """Seconds for a Subscriber with ``variant`` to drain ``messages`` in-memory messages (with
    the working handler if ``work``, else a no-op one)."""
    adapter = memory.fresh_adapter(messages)
    options, owned = providers(variant)
    subscriber = Subscriber(adapter, **options)
    subscriber.handler(memory.SUBSCRIPTION)(working_handler if work else memory.noop_handler)
    try:
        run = await memory.drain(adapter, subscriber)
    finally:
        for provider in owned:
            provider.shutdown()
    _check(variant, subscriber, messages)
    return run.seconds


async def run_redis(control: aioredis.Redis, url: str, template: str, variant: str,
                    messages: int) -> float:
    """Seconds for a Subscriber with ``variant`` to drain a copy of the template stream."""
    keys = redis_bench.next_keys(redis_bench.SUB)
    options, owned = providers(variant)
    consumer = redis_bench.RedisSubscriber(redis_bench.RedisRun(control, url, keys),
                                           redis_bench.Tally(), messages, dedup=False, **options)
    return await _timed(control, template, keys, consumer, owned)


async def _timed(control: aioredis.Redis, template: str, keys: Any, consumer: Consumer,
                 owned: list[Any]) -> float:
    """Seconds for ``consumer`` to drain a copy of ``template`` into the stream of ``keys``."""
    if not await control.copy(template, keys.stream):
        raise RuntimeError(f"COPY to {keys.stream} failed")
    try:
        await consumer.prepare()
        gc.collect()
        started = time.perf_counter()
        await consumer.start()
        drained = await wait_drained(consumer, redis_bench.no_pending(control, keys),
                                     started + redis_bench.RUN_DEADLINE)
        await consumer.stop()
        await redis_bench.verify_group(control, keys, consumer.total)
        consumer.check()
    finally:
        await consumer.close()
        await redis_bench.delete_keys(control, f"{keys.base}:*")
        for provider in owned:
            provider.shutdown()
    return drained - started


async def run_faststream(control: aioredis.Redis, url: str, template: str, telemetry: bool,
                         messages: int) -> float:
    """Seconds for FastStream (one message per call) to drain a copy of the template stream,
    with its RedisTelemetryMiddleware on the SDK variant's providers when ``telemetry``."""
    from faststream.redis.opentelemetry import RedisTelemetryMiddleware

    keys = redis_bench.next_keys(redis_bench.FS_ONE)
    options, owned = providers(SDK)
    middlewares = [RedisTelemetryMiddleware(
        tracer_provider=options["tracer_provider"],
        meter_provider=options["meter_provider"])] if telemetry else []
    consumer = redis_bench.RedisFastStream(redis_bench.RedisRun(control, url, keys),
                                           redis_bench.Tally(), messages, batch=False,
                                           middlewares=middlewares)
    return await _timed(control, template, keys, consumer, owned)


def _check(variant: str, subscriber: Subscriber, messages: int) -> None:
    outcomes = dict(subscriber.stats.outcomes)
    if outcomes != {Outcome.ACKED: messages}:
        raise RuntimeError(f"{variant}: outcomes {outcomes}, expected {messages} acked")


async def measure(args: argparse.Namespace) -> dict[str, dict[str, Rates]]:
    results: dict[str, dict[str, Rates]] = {
        "memory": {v: Rates(v) for v in VARIANTS}, "redis": {v: Rates(v) for v in VARIANTS},
        WORK: {v: Rates(v) for v in WORK_VARIANTS},
        FLOOR: {v: Rates(v) for v in VARIANTS if v not in (OFF, API)},
        FLOOR_OPEN: {v: Rates(v) for v in VARIANTS if v not in (OFF, API)},
        PEER: {v: Rates(v) for v in (FS_OFF, FS_OTEL)}}
    control = aioredis.Redis.from_url(args.redis)
    template = f"{redis_bench.KEY_PREFIX}:telemetry-template"
    await redis_bench.publish_template(control, template, args.redis_messages)
    peer_template = f"{redis_bench.KEY_PREFIX}:telemetry-peer-template"
    await redis_bench.publish_template(control, peer_template, args.peer_messages)
    try:
        for variant in VARIANTS:  # warm-up
            await run_memory(variant, WARMUP_MESSAGES)
        for repetition in range(1, args.repetitions + 1):
            for variant in VARIANTS:
                seconds = await run_memory(variant, args.messages)
                results["memory"][variant].rates.append(args.messages / seconds)
                seconds = await run_redis(control, args.redis, template, variant,
                                          args.redis_messages)
                results["redis"][variant].rates.append(args.redis_messages / seconds)
                if variant in results[FLOOR]:
                    seconds = floor_seconds(variant, args.messages)
                    results[FLOOR][variant].rates.append(args.messages / seconds)
                    seconds = floor_seconds(variant, args.messages, open_spans=OPEN_SPANS)
                    results[FLOOR_OPEN][variant].rates.append(args.messages / seconds)
                print(f"  run {repetition}/{args.repetitions}  {variant:<27} memory "
                      f"{results['memory'][variant].rates[-1]:>9,.0f}  redis "
                      f"{results['redis'][variant].rates[-1]:>8,.0f} msg/s", file=sys.stderr)
            for variant in (FS_OFF, FS_OTEL):
                seconds = await run_faststream(control, args.redis, peer_template,
                                               variant == FS_OTEL, args.peer_messages)
                results[PEER][variant].rates.append(args.peer_messages / seconds)
                print(f"  run {repetition}/{args.repetitions}  {variant:<27} "
                      f"{results[PEER][variant].rates[-1]:>8,.0f} msg/s", file=sys.stderr)
            for variant in WORK_VARIANTS:
                seconds = await run_memory(variant, args.work_messages, work=True)
                results[WORK][variant].rates.append(args.work_messages / seconds)
                print(f"  run {repetition}/{args.repetitions}  {variant:<27} working handler "
                      f"{results[WORK][variant].rates[-1]:>7,.0f} msg/s", file=sys.stderr)
    finally:
        await control.delete(template, peer_template)
        await control.aclose()
    return results


def floor_table(brokers: dict[str, dict[str, Rates]], floor: dict[str, Rates],
                open_floor: dict[str, Rates]) -> list[str]:
    """Each SDK variant beside the SDK's floor, with one span open at a time and with as many
    open as a Subscriber has messages in flight: what the SDK's own calls cost per message, and
    what the Subscriber adds beyond them (the goal: the full SDK variant within 15%)."""
    lines = [
        "Beside the SDK's floor (`benchmarks/_telemetry_floor.py`: the same spans and metric "
        "records, with the same SDK, processor and exporter, in a loop of nothing else; measured "
        "in the same repetitions), once with each span ended before the next starts and once "
        f"with {OPEN_SPANS:,} open at a time, the oldest ended first, as a Subscriber holds one "
        "per message in flight (`FlowControl.max_messages`):",
        "",
        "| Broker | Variant | SDK floor µs/msg, 1 open | SDK floor µs/msg, "
        f"{OPEN_SPANS:,} open | ours µs/msg added (vs off) | ours beyond the floor µs/msg, "
        f"1 / {OPEN_SPANS:,} open | time vs off + floor, 1 / {OPEN_SPANS:,} open |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    goals = []
    for broker in ("memory", "redis"):
        off = 1e6 / brokers[broker][OFF].median
        for variant, rates in floor.items():
            alone, held = 1e6 / rates.median, 1e6 / open_floor[variant].median
            ours = 1e6 / brokers[broker][variant].median
            ratio, ratio_held = ours / (off + alone), ours / (off + held)
            lines.append(f"| {broker} | {variant} | {alone:.1f} | {held:.1f} | {ours - off:+.1f} "
                         f"| {ours - off - alone:+.1f} / {ours - off - held:+.1f} | "
                         f"{ratio:.2f}× / {ratio_held:.2f}× |")
            if variant == SDK:
                goals.append(verdict(f"{broker}: our own cost beyond the SDK's floor",
                                     (ratio - 1.0) * 100, 15, unit=" %", at_most=True))
                goals.append(verdict(
                    f"{broker}: our own cost beyond the SDK's floor with {OPEN_SPANS:,} spans "
                    "open", (ratio_held - 1.0) * 100, 15, unit=" %", at_most=True))
    return [*lines, "", *goals]


def peer_table(ours: dict[str, Rates], peer: dict[str, Rates], messages: int) -> list[str]:
    """FastStream on the same Redis, one message per call, with and without its OpenTelemetry
    middleware on the SDK variant's providers, beside the Subscriber."""
    lines = [
        f"The peer: FastStream's `StreamSub` ({messages:,} entries per run, one message per call, "
        "its default ack per message) with and without its `RedisTelemetryMiddleware` on the "
        "same SDK providers, processor and exporter:",
        "",
        "| Variant | median msgs/s | µs/msg | telemetry's cost |",
        "|---|---:|---:|---:|",
    ]
    for variant, rates in peer.items():
        cost = peer[FS_OFF].median / rates.median - 1.0
        lines.append(f"| {variant} | {rates.median:,.0f} | {1e6 / rates.median:.1f} | "
                     f"{cost:+.1%} |")
    return [*lines, "", verdict("redis: Subscriber with the SDK vs FastStream with its "
                                "OpenTelemetry middleware", ours[SDK].median
                                / peer[FS_OTEL].median, 1.5)]


def report(args: argparse.Namespace, results: dict[str, dict[str, Rates]]) -> str:
    lines: list[str] = []
    costs: dict[str, dict[str, float]] = {}
    brokers = {broker: rows for broker, rows in results.items()
               if broker not in (FLOOR, FLOOR_OPEN, PEER)}
    for broker, rows in brokers.items():
        off = rows[OFF].median
        for variant, row in rows.items():
            cost = off / row.median - 1.0
            costs.setdefault(broker, {})[variant] = cost
            added = 1e6 / row.median - 1e6 / off
            lines.append(f"| {broker} | {variant} | {row.median:,.0f} | "
                         f"{min(row.rates):,.0f} – {max(row.rates):,.0f} | "
                         f"{1e6 / row.median:.1f} | {added:+.1f} | {cost:+.1%} |")
    goals = []
    for broker in brokers:
        goals.append(verdict(f"{broker}: SDK cost (time per message, vs off)",
                             costs[broker][SDK] * 100, 25, unit=" %", at_most=True))
        if METRICS_ONLY in costs[broker]:
            goals.append(verdict(f"{broker}: metrics alone", costs[broker][METRICS_ONLY] * 100,
                                 25, unit=" %", at_most=True))
        goals.append(verdict(f"{broker}: dashboard mode (every span of what did not succeed "
                             "at once, 1% of first attempts)", costs[broker][DASHBOARD] * 100,
                             30, unit=" %", at_most=True))
        if API in costs[broker]:
            goals.append(verdict(f"{broker}: API-alone cost", costs[broker][API] * 100, 3,
                                 unit=" %", at_most=True))
    return render(
        "telemetry", measured_on=measured_on(COMMAND), args=args,
        work_ms=WORK_SECONDS * 1e3, rows=lines, goals=goals,
        floor=floor_table(brokers, results[FLOOR], results[FLOOR_OPEN]),
        peer=peer_table(results["redis"], results[PEER], args.peer_messages))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--messages", type=positive_int, default=DEFAULT_MESSAGES)
    parser.add_argument("--redis-messages", type=positive_int, default=DEFAULT_REDIS_MESSAGES)
    parser.add_argument("--work-messages", type=positive_int, default=DEFAULT_WORK_MESSAGES)
    parser.add_argument("--peer-messages", type=positive_int, default=DEFAULT_PEER_MESSAGES)
    parser.add_argument("--repetitions", type=positive_int, default=DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help="rewrite the README section")
    args = parser.parse_args(argv)
    publish(SECTION_NAME, report(args, asyncio.run(measure(args))), write=args.write,
            append=True)


if __name__ == "__main__":
    main()
