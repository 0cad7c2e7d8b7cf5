"""What typed bodies cost: decoding alone, and the Subscriber with typed handlers.

    python -m benchmarks.typed_bodies            # print the tables
    python -m benchmarks.typed_bodies --write    # ... and rewrite the README section

**Decoding** one order body with ``timeit``: ``json.loads``, pydantic (a model, and a
``TypeAdapter`` over a dataclass), the dataclass fallback without pydantic, and msgspec.
**Pipeline**: ``benchmarks.memory_pipeline``'s harness with a no-op handler (the floor), an
untyped ``json.loads`` one and typed ones, interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Any

import msgspec
import pydantic

from benchmarks._common import MICROS, README
from benchmarks._harness import add_runs, check_main, command_line, publish, render
from benchmarks.memory_pipeline import SUBSCRIPTION, TOPIC, drain
from reliable_sub import Message, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter

SECTION_NAME = "typed_bodies"
DEFAULT_MESSAGES = 20_000
DEFAULT_REPETITIONS = 5
WARMUP_MESSAGES = 2_000
DECODES = 20_000


# One order, described once and declared for each library compared.
FIELDS: list[tuple[str, Any]] = [
    ("order_id", int), ("customer", str), ("sku", str), ("quantity", int), ("cents", int),
    ("currency", str), ("express", bool), ("street", str), ("city", str), ("country", str),
]
OrderModel = pydantic.create_model(  # type: ignore[call-overload]
    "OrderModel", **{name: (kind, ...) for name, kind in FIELDS}, note=(str | None, None))
OrderData = dataclasses.make_dataclass(
    "OrderData", [*FIELDS, ("note", str | None, dataclasses.field(default=None))])
OrderStruct = msgspec.defstruct("OrderStruct", [*FIELDS, ("note", str | None, None)])


BODY = json.dumps({
    "order_id": 184467, "customer": "c-9f2a41", "sku": "lamp-oak-60", "quantity": 2,
    "cents": 15980, "currency": "EUR", "express": False, "street": "Kastanienallee 12",
    "city": "Berlin", "country": "DE", "note": "leave at the door, please ring twice",
}).encode()


def decoders() -> dict[str, Callable[[bytes], Any]]:
    """The decoders compared, by row name."""
    rows: dict[str, Callable[[bytes], Any]] = {
        "json.loads → dict (an untyped handler's own)": json.loads,
        "pydantic model_validate_json": OrderModel.model_validate_json,
        "pydantic TypeAdapter(dataclass).validate_json": pydantic.TypeAdapter(
            OrderData).validate_json,
        "json.loads + dataclass(**fields) (no pydantic)": lambda data: OrderData(
            **json.loads(data)),
    }
    rows["msgspec.json.decode(type=Struct)"] = msgspec.json.Decoder(OrderStruct).decode
    return rows


def measure_decoders(repetitions: int) -> dict[str, float]:
    """Median µs per decode of :data:`BODY`, over ``repetitions`` interleaved rounds."""
    rows = decoders()
    timings: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repetitions):
        for name, decode in rows.items():
            seconds = timeit.timeit(lambda decode=decode: decode(BODY), number=DECODES)
            timings[name].append(seconds / DECODES * MICROS)
    return {name: statistics.median(values) for name, values in timings.items()}


# -- the pipeline ------------------------------------------------------------------------------


async def untyped_noop(message: Message) -> None:
    pass


async def untyped_json(message: Message) -> None:
    json.loads(message.data)


async def typed_model(order: OrderModel) -> None:
    pass


async def typed_dataclass(order: OrderData) -> None:
    pass


async def typed_struct(order: OrderStruct) -> None:
    pass


HANDLERS: dict[str, Callable[..., Any]] = {
    "untyped, no-op (floor)": untyped_noop,
    "untyped, json.loads(message.data)": untyped_json,
    "typed: pydantic model": typed_model,
    "typed: dataclass (pydantic)": typed_dataclass,
    "typed: msgspec Struct": typed_struct,
}


async def run_once(handler: Callable[..., Any], messages: int) -> float:
    adapter = MemoryAdapter()
    adapter.ensure_subscription_sync(TOPIC, SUBSCRIPTION)
    for _ in range(messages):
        adapter.publish_sync(TOPIC, BODY)
    subscriber = Subscriber(adapter)
    subscriber.handler(SUBSCRIPTION)(handler)
    drained = await drain(adapter, subscriber)
    acked = subscriber.stats["acked"]
    if acked != messages:
        raise RuntimeError(f"{handler.__name__}: {acked} of {messages} acked")
    return drained.seconds / messages * MICROS


async def measure_pipeline(messages: int, repetitions: int) -> dict[str, float]:
    """Median µs per message of each handler, interleaved over ``repetitions``."""
    for handler in HANDLERS.values():
        await run_once(handler, WARMUP_MESSAGES)
    timings: dict[str, list[float]] = {name: [] for name in HANDLERS}
    for repetition in range(1, repetitions + 1):
        for name, handler in HANDLERS.items():
            micros = await run_once(handler, messages)
            timings[name].append(micros)
            print(f"  run {repetition}/{repetitions}  {name:<36} {micros:6.2f} µs/msg",
                  file=sys.stderr)
    return {name: statistics.median(values) for name, values in timings.items()}


def report(decoding: dict[str, float], pipeline: dict[str, float], command: str,
           messages: int, repetitions: int) -> str:
    today = datetime.date.today().isoformat()
    base_decode = decoding["json.loads → dict (an untyped handler's own)"]
    base_pipeline = pipeline["untyped, json.loads(message.data)"]
    floor = pipeline["untyped, no-op (floor)"]
    return render(
        "typed_bodies", command=command, today=today, python=platform.python_version(),
        system=platform.system(), machine=platform.machine(), cpus=os.cpu_count(),
        pydantic=pydantic.VERSION, repetitions=repetitions, DECODES=DECODES, body=len(BODY),
        messages=messages,
        decoding=[f"| {name} | {micros:.2f} | {micros / base_decode:.2f}× |"
                  for name, micros in decoding.items()],
        pipeline=[f"| {name} | {micros:.2f} | {micros / base_pipeline:.2f}× | "
                  f"{micros - floor:+.2f} µs |" for name, micros in pipeline.items()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help=f"rewrite the section in {README}")
    args = parser.parse_args(argv)
    check_main(parser, args, SECTION_NAME)
    command = command_line("typed_bodies", argv)
    decoding = measure_decoders(args.repetitions)
    pipeline = asyncio.run(measure_pipeline(args.messages, args.repetitions))
    publish(SECTION_NAME, report(decoding, pipeline, command, args.messages, args.repetitions),
            write=args.write)


if __name__ == "__main__":
    main()
