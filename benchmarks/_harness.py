"""The benchmarks' harness: one timed run, its repetitions, their tables, and the command line.

:class:`Clock` times one run (``gc.collect()`` first, then wall, CPU and cyclic-GC seconds; GC off
while profiling); :func:`table` and its variants format the markdown tables; :func:`render` fills
a section's prose from ``benchmarks/templates/<name>.md``; :func:`measured_on`,
:func:`command_line`, :func:`add_runs`, :func:`check_main` and :func:`publish` are the pieces of
every ``main``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import os
import platform
import pstats
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks._common import (
    MICROS,
    README,
    GcTimer,
    Rule,
    StageProfile,
    Throughput,
    has_section,
    positive_int,
    section_markers,
    stage_seconds,
    unknown_rule_names,
    write_section,
)

# -- one run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One timed run: wall seconds until drained, this process's CPU and GC seconds within."""

    seconds: float
    cpu_seconds: float
    gc_seconds: float


class Clock:
    """Times one run: ``with Clock(profiler) as clock: ...; clock.stop(drained)``.

    On entry: ``gc.collect()`` (outside the clock), the GC timer installed, the profiler (if
    any) enabled with GC off unless ``gc_off=False``, then the wall and (unless ``cpu=False``)
    the CPU clocks read. :meth:`stop` reads them again (the wall clock at ``at``, a moment the
    caller took, if given); on exit the profiler is disabled and the GC seconds so far kept.
    """

    def __init__(self, profiler: cProfile.Profile | None = None, *, gc_off: bool = True,
                 cpu: bool = True) -> None:
        self.profiler, self.gc_off, self.cpu = profiler, gc_off, cpu
        self._gc = GcTimer()
        self.started = self.cpu_started = 0.0
        self.seconds = self.cpu_seconds = self.gc_seconds = 0.0

    def __enter__(self) -> Clock:
        gc.collect()
        self._gc.__enter__()
        if self.profiler is not None:
            if self.gc_off:
                gc.disable()
            self.profiler.enable()
        self.started = time.perf_counter()
        if self.cpu:
            self.cpu_started = time.process_time()
        return self

    def stop(self, at: float | None = None) -> None:
        self.seconds = (time.perf_counter() if at is None else at) - self.started
        if self.cpu:
            self.cpu_seconds = time.process_time() - self.cpu_started

    def __exit__(self, *exc_info: object) -> None:
        if self.profiler is not None:
            self.profiler.disable()
            if self.gc_off:
                gc.enable()
        self.gc_seconds = self._gc.seconds
        self._gc.__exit__()

    def run(self) -> Run:
        return Run(self.seconds, self.cpu_seconds, self.gc_seconds)


class CpuThroughput(Throughput[Any]):
    """The timed repetitions of one variant, with the process's CPU time."""

    @property
    def cpu_micros_per_message(self) -> float:
        return self.median_micros(run.cpu_seconds for run in self.runs)

    @property
    def idle_micros_per_message(self) -> float:
        """Wall minus CPU: the time this process waited (for the broker, or for a CPU)."""
        return max(0.0, self.micros_per_message - self.cpu_micros_per_message)


def profile_stages(profiler: cProfile.Profile, variant: str, messages: int,
                   rules: Sequence[Rule], stages: Sequence[str], root: str) -> StageProfile:
    """A profiled run's own time per stage, in µs per message."""
    seconds = stage_seconds(pstats.Stats(profiler), rules, stages, root)
    return StageProfile(variant, {stage: spent * MICROS / messages
                                  for stage, spent in seconds.items()})


# -- tables --------------------------------------------------------------------------------------

Column = tuple[str, Callable[[Any], str]]

RATE_COLUMNS: tuple[Column, ...] = (
    ("median msgs/s", lambda r: f"{r.median:,.0f}"),
    ("min – max msgs/s", lambda r: f"{min(r.rates):,.0f} – {max(r.rates):,.0f}"),
)


def table(rows: Iterable[Any], columns: Sequence[Column], first: str = "Variant",
          label: Callable[[Any], str] = lambda r: r.variant) -> list[str]:
    """A markdown table: one row per item of ``rows``, a right-aligned cell per column."""
    lines = ["| " + " | ".join([first, *(name for name, _ in columns)]) + " |",
             "|---" + "|---:" * len(columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join([label(row), *(cell(row) for _, cell in columns)]) + " |")
    return lines


def broker_table(results: Mapping[str, CpuThroughput], base: str,
                 extra: Sequence[Column] = ()) -> list[str]:
    """The brokers' throughput table: rates, µs/msg, client CPU and GC, ``extra``, ratio."""
    floor = results[base].median
    return table(results.values(), [
        *RATE_COLUMNS,
        ("µs/msg", lambda r: f"{r.micros_per_message:.1f}"),
        ("client CPU µs/msg", lambda r: f"{r.cpu_micros_per_message:.1f}"),
        ("of which GC µs/msg", lambda r: f"{r.gc_micros_per_message:.1f}"),
        *extra,
        ("ratio to (a)", lambda r: f"{r.median / floor:.2f}×"),
    ])


def rates_table(rows: Iterable[Any], unit: str,
                ratios: Sequence[tuple[str, Callable[[Any], Any]]]) -> list[str]:
    """A table of :class:`~benchmarks._common.Rates`: median and range of ``unit``/s, µs each,
    and the ratio to each ``(name, row → its baseline row)``."""
    return table(rows, [
        (f"median {unit}/s", lambda r: f"{r.median:,.0f}"),
        ("min – max", lambda r: f"{min(r.rates):,.0f} – {max(r.rates):,.0f}"),
        ("µs each", lambda r: f"{MICROS / r.median:,.0f}"),
        *((f"ratio to {name}", lambda r, base=base: f"{r.median / base(r).median:.2f}×")
          for name, base in ratios),
    ])


def stage_table(profiles: Mapping[str, StageProfile], stages: Sequence[str], *, reference: str,
                scaled: str, scale: float, total: float, unscaled: Iterable[str] = (),
                rows: Sequence[tuple[str, float]] = ()) -> list[str]:
    """µs/msg per stage of every profile, and ``reference``'s scaled by ``scale`` with its
    share of ``total``; the ``unscaled`` stages get no scaled cell, ``rows`` (GC, idle) no
    profiled ones."""
    dashes = " | ".join("–" for _ in profiles)
    lines = [f"| Stage | {' | '.join(profiles)} | {scaled} | share |",
             "|---" + "|---:" * (len(profiles) + 2) + "|"]
    skipped = set(unscaled)
    for stage in stages:
        cells = " | ".join(f"{p.micros[stage]:.2f}" for p in profiles.values())
        if stage in skipped:
            lines.append(f"| {stage} | {cells} | – | – |")
            continue
        value = profiles[reference].micros[stage] * scale
        lines.append(f"| {stage} | {cells} | {value:.2f} | {value / total:.0%} |")
    for row, value in rows:
        lines.append(f"| {row} | {dashes} | {value:.2f} | {value / total:.0%} |")
    totals = " | ".join(f"**{p.total:.2f}**" for p in profiles.values())
    lines.append(f"| **total** | {totals} | **{total:.2f}** | 100% |")
    return lines


def paired(ours: Sequence[float], theirs: Sequence[float],
           met: Callable[[float], bool]) -> tuple[list[float], str]:
    """The run-by-run ratios and ``repetition by repetition a–b×, met in k of n``."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return ratios, (f"repetition by repetition {min(ratios):.2f}–{max(ratios):.2f}×, met in "
                    f"{sum(met(r) for r in ratios)} of {len(ratios)}")


# -- the README section and the command line -----------------------------------------------------


def measured_on(command: str) -> str:
    """``Command …: `command`; measured DATE with CPython X on OS machine, N CPUs``."""
    return (f"Command (from the repository root): `{command}`; measured "
            f"{datetime.date.today().isoformat()} with CPython {platform.python_version()} on "
            f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs")


TEMPLATES = Path(__file__).with_name("templates")


def render(template: str, /, **values: Any) -> str:
    """``benchmarks/templates/<template>.md`` filled in with ``str.format_map``: the prose of a
    README section lives there, the code computes its figures and tables (a list of lines is
    joined with newlines)."""
    text = (TEMPLATES / f"{template}.md").read_text().removesuffix("\n")
    return text.format_map({name: "\n".join(value) if isinstance(value, list) else value
                            for name, value in values.items()})


def versions(*names: str) -> str:
    """``name version, …`` of installed distributions."""
    return ", ".join(f"{name} {metadata.version(name)}" for name in names)


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command as the README shows it; never the interpreter's path: nothing of this
    machine goes into the README."""
    return shlex.join(["python", "-m", f"benchmarks.{module}",
                       *(sys.argv[1:] if argv is None else argv)])


def add_runs(parser: argparse.ArgumentParser, messages: int, repetitions: int, *,
             quick: tuple[int, int, int] | None = None, messages_help: str | None = None) -> None:
    """``--messages`` and ``--repetitions``; with ``quick`` (messages, repetitions, warm-up
    messages), ``--quick`` too: see :func:`apply_quick`."""
    parser.add_argument("--messages", type=positive_int, default=messages, help=messages_help)
    parser.add_argument("--repetitions", type=positive_int, default=repetitions)
    if quick is not None:
        parser.add_argument("--quick", action="store_true",
                            help=f"smoke test: {quick[0]:,} messages, {quick[1]} repetitions")


def apply_quick(args: argparse.Namespace, warmup: int, quick: tuple[int, int, int]) -> None:
    """``args.warmup``, and with ``--quick`` its small messages, repetitions and warm-up."""
    args.warmup = warmup
    if args.quick:
        args.messages, args.repetitions, args.warmup = quick


def check_main(parser: argparse.ArgumentParser, args: argparse.Namespace, section: str,
               rules: Sequence[Rule] = (), *, markers: bool = True) -> None:
    """Stop with a usage error on stage rules naming functions that no longer exist, or (if
    ``markers``) on ``--write`` without the section's markers in the README."""
    stale = unknown_rule_names(rules)
    if stale:
        parser.error(f"stage rules name functions that no longer exist: {stale}")
    if markers and args.write and not has_section(section):
        start, end = section_markers(section)
        parser.error(f"{README}: markers {start} / {end} not found")


def publish(section: str, text: str, *, write: bool, append: bool = False,
            started: float | None = None) -> None:
    """Print the section (and the seconds since ``started``); with ``write``, into the README."""
    print(text)
    if started is not None:
        print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if write:
        write_section(section, text, append=append)
        print(f"wrote {README}", file=sys.stderr)
