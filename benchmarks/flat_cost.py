"""Flat cost: a message costs the same however many are in flight and however many came before.

    python -m benchmarks.flat_cost            # print the tables
    python -m benchmarks.flat_cost --write    # ... and rewrite the README section

A Subscriber on the MemoryAdapter in the benchmark's own loop (``benchmarks.memory_pipeline``),
sizes interleaved: messages held in flight up to each ``--in-flight`` limit (CPU per message
should stay flat), and backlogs of each ``--drained`` size through a no-op handler.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from dataclasses import dataclass, field

from benchmarks import memory_pipeline as memory
from benchmarks._common import positive_int, verdict
from benchmarks._harness import command_line, measured_on, publish, render
from reliable_sub import FlowControl, Message, Subscriber

DEFAULT_IN_FLIGHT = (100, 1_000, 10_000)
DEFAULT_IN_FLIGHT_MESSAGES = 30_000
DEFAULT_DRAINED = (10_000, 100_000, 1_000_000)
DEFAULT_REPETITIONS = 3
FLAT_WITHIN = 1.2  # the goal: the largest size costs at most this times the smallest
SECTION_NAME = "flat_cost"


@dataclass
class Series:
    """One size's repetitions: wall and CPU microseconds per message."""

    label: str
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    gc: list[float] = field(default_factory=list)  # of the wall time, the cyclic collector's

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)

    @property
    def gc_median(self) -> float:
        return statistics.median(self.gc)

    def add(self, wall: float, cpu: float, gc_time: float) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)
        self.gc.append(gc_time)


class HeldInWaves:
    """A handler that holds each message until ``wave`` are held (or all ``total`` came), then
    lets them all go at once: ``wave`` messages in flight, for the cost of one future."""

    def __init__(self, wave: int, total: int) -> None:
        self.wave = wave
        self.total = total
        self.entered = 0
        self.held = 0
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handle(self, message: Message) -> None:
        self.entered += 1
        self.held += 1
        gate = self.gate
        if self.held >= self.wave or self.entered == self.total:
            self.held = 0
            self.gate = asyncio.get_running_loop().create_future()
            gate.set_result(None)
        await gate


async def run_once(messages: int, max_messages: int | None) -> tuple[float, float, float]:
    """Wall, CPU and cyclic-GC µs per message to drain ``messages``: held in waves of
    ``max_messages`` (the flow-control limit), or through a no-op handler when it is None."""
    adapter = memory.fresh_adapter(messages)
    flow = FlowControl(max_messages=max_messages) if max_messages is not None else None
    subscriber = (Subscriber(adapter, flow_control=flow) if flow is not None
                  else Subscriber(adapter))
    handler = (HeldInWaves(max_messages, messages).handle if max_messages is not None
               else memory.noop_handler)
    subscriber.handler(memory.SUBSCRIPTION)(handler)
    run = await memory.drain(adapter, subscriber, cpu=True)
    return (run.seconds / messages * 1e6, run.cpu_seconds / messages * 1e6,
            run.gc_seconds / messages * 1e6)


async def measure(args: argparse.Namespace) -> tuple[list[Series], list[Series]]:
    in_flight = [Series(f"{limit:,} in flight") for limit in args.in_flight]
    drained = [Series(f"{size:,} drained") for size in args.drained]
    await run_once(memory.WARMUP_MESSAGES, None)
    for repetition in range(1, args.repetitions + 1):
        for limit, series in zip(args.in_flight, in_flight, strict=True):
            wall, cpu, gc_time = await run_once(args.in_flight_messages, limit)
            series.add(wall, cpu, gc_time)
            print(f"  run {repetition}/{args.repetitions}  {series.label:<18} "
                  f"cpu {cpu:6.2f} µs/msg", file=sys.stderr)
        for size, series in zip(args.drained, drained, strict=True):
            wall, cpu, gc_time = await run_once(size, None)
            series.add(wall, cpu, gc_time)
            print(f"  run {repetition}/{args.repetitions}  {series.label:<18} "
                  f"wall {wall:6.2f} µs/msg", file=sys.stderr)
    return in_flight, drained


def _rows(series: list[Series]) -> list[str]:
    first = series[0]
    return [f"| {s.label} | {s.wall_median:.2f} | {s.cpu_median:.2f} | {s.gc_median:.2f} | "
            f"{s.cpu_median / first.cpu_median:.2f}× | "
            f"{(s.cpu_median - s.gc_median) / (first.cpu_median - first.gc_median):.2f}× | "
            f"{s.wall_median / first.wall_median:.2f}× |"
            for s in series]


def report(args: argparse.Namespace, in_flight: list[Series], drained: list[Series],
           command: str, load: float) -> str:
    header = ["| Size | wall µs/msg | CPU µs/msg | of which cyclic GC µs/msg | CPU vs the first | "
              "CPU less GC vs the first | wall vs the first |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    first, last = in_flight[0], in_flight[-1]
    return render(
        "flat_cost", measured_on=measured_on(command), load=load, args=args, header=header,
        in_flight=_rows(in_flight), drained=_rows(drained),
        in_flight_goal=verdict(f"CPU per message, {last.label} vs {first.label}",
                               last.cpu_median / first.cpu_median, FLAT_WITHIN, at_most=True),
        drained_goal=verdict(f"time per message, {drained[-1].label} vs {drained[0].label}",
                             drained[-1].wall_median / drained[0].wall_median, FLAT_WITHIN,
                             at_most=True))


def _sizes(text: str) -> list[int]:
    sizes = [positive_int(part) for part in text.split(",")]
    if len(sizes) < 2:
        raise argparse.ArgumentTypeError("give at least two sizes, smallest first")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--in-flight", type=_sizes, default=list(DEFAULT_IN_FLIGHT),
                        help="flow-control limits, comma-separated")
    parser.add_argument("--in-flight-messages", type=positive_int,
                        default=DEFAULT_IN_FLIGHT_MESSAGES)
    parser.add_argument("--drained", type=_sizes, default=list(DEFAULT_DRAINED),
                        help="backlog sizes, comma-separated")
    parser.add_argument("--repetitions", type=positive_int, default=DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help="rewrite the README section")
    args = parser.parse_args(argv)
    command = command_line("flat_cost", argv)
    load = os.getloadavg()[0]
    in_flight, drained = asyncio.run(measure(args))
    publish(SECTION_NAME, report(args, in_flight, drained, command, load), write=args.write,
            append=True)


if __name__ == "__main__":
    main()
