"""Pieces the benchmarks share: stage attribution of a cProfile run, GC timing, README sections.

Throughput bookkeeping (:class:`Throughput`, :class:`Rates`, :func:`interleaved`, the goal lines
:func:`verdict` and :func:`paired_goal`); stage attribution (:class:`Rule`, :func:`pipeline_rules`,
:func:`stage_seconds`, :class:`StageProfile`, :func:`unknown_rule_names` for rules whose functions
were renamed); :class:`GcTimer`; and the README's sections between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` (:func:`write_section`).
"""

from __future__ import annotations

import argparse
import ast
import gc
import os
import pstats
import re
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

README = Path(__file__).with_name("README.md")
MICROS = 1e6

# -- throughput ----------------------------------------------------------------------------------


class TimedRun(Protocol):
    """What every benchmark's Run records: wall seconds and cyclic-GC seconds."""

    @property
    def seconds(self) -> float: ...

    @property
    def gc_seconds(self) -> float: ...


RunT = TypeVar("RunT", bound=TimedRun)


@dataclass
class Throughput(Generic[RunT]):
    """The timed repetitions of one variant."""

    variant: str
    messages: int
    runs: list[RunT] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [self.messages / run.seconds for run in self.runs]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def micros_per_message(self) -> float:
        return MICROS / self.median

    def median_micros(self, seconds: Iterable[float]) -> float:
        """The median of per-run ``seconds``, as µs per message."""
        return statistics.median(seconds) * MICROS / self.messages

    @property
    def gc_micros_per_message(self) -> float:
        return self.median_micros(run.gc_seconds for run in self.runs)


@dataclass
class Rates:
    """One variant's repetitions, as operations (messages, calls, rows) per second."""

    variant: str
    rates: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


ThroughputT = TypeVar("ThroughputT", bound=Throughput[Any])


async def interleaved(run_once: Callable[[str, int], Awaitable[Any]], variants: Sequence[str],
                      make: Callable[[str], ThroughputT], messages: int, repetitions: int,
                      warmup: int) -> dict[str, ThroughputT]:
    """Warm every variant up, then time them round-robin so drift hits all of them alike;
    each run's rate to stderr."""
    for variant in variants:
        await run_once(variant, warmup)
    results = {variant: make(variant) for variant in variants}
    for repetition in range(1, repetitions + 1):
        for variant in variants:
            run = await run_once(variant, messages)
            _ran(results[variant], run, repetition, repetitions)
    return results


def interleaved_sync(run_once: Callable[[str, int], Any], variants: Sequence[str],
                     make: Callable[[str], ThroughputT], messages: int, repetitions: int,
                     warmup: int) -> dict[str, ThroughputT]:
    """:func:`interleaved`, for a ``run_once`` that is no coroutine function."""
    for variant in variants:
        run_once(variant, warmup)
    results = {variant: make(variant) for variant in variants}
    for repetition in range(1, repetitions + 1):
        for variant in variants:
            _ran(results[variant], run_once(variant, messages), repetition, repetitions)
    return results


def _ran(result: Throughput[Any], run: Any, repetition: int, repetitions: int) -> None:
    import sys

    result.runs.append(run)
    print(f"  run {repetition}/{repetitions}  {result.variant:<62} "
          f"{result.messages / run.seconds:>9,.0f} msg/s", file=sys.stderr)


def paired_goal(name: str, ours: Throughput[Any], theirs: Throughput[Any],
                target: float) -> str:
    """``verdict`` on the medians, and how the interleaved repetitions did one by one."""
    paired = [a / b for a, b in zip(ours.rates, theirs.rates, strict=True)]
    met = sum(ratio >= target for ratio in paired)
    return (f"{verdict(name, ours.median / theirs.median, target)} (repetition by repetition "
            f"{min(paired):.2f}–{max(paired):.2f}×, met in {met} of {len(paired)})")


def verdict(name: str, value: float, goal: float, *, unit: str = "×",
            at_most: bool = False) -> str:
    """``* name: value (goal ≥ goal) — met/not met``, for a report's list of goals."""
    met = value <= goal if at_most else value >= goal
    sign = "≤" if at_most else "≥"
    return (f"* {name}: {value:.2f}{unit} (goal {sign} {goal:g}{unit}) — "
            f"**{'met' if met else 'not met'}**")


# -- stage attribution -------------------------------------------------------------------------

FunctionKey = tuple[str, int, str]  # (filename, first line, name), as pstats keys functions
Share = dict[str, float]  # stage -> fraction of a function's time


@dataclass(frozen=True)
class Rule:
    """Functions defined in a file ending with ``path`` (and named one of ``names``, if given;
    starting on one of ``lines``, if given)."""

    stage: str
    path: str
    names: frozenset[str] | None = None
    lines: range | None = None

    def matches(self, filename: str, line: int, name: str) -> bool:
        return (
            filename.replace(os.sep, "/").endswith(self.path)
            and (self.names is None or name in self.names)
            and (self.lines is None or line in self.lines)
        )


def rule(stage: str, path: str, *names: str, lines: range | None = None) -> Rule:
    """A :class:`Rule`; no ``names`` means every function in the file."""
    return Rule(stage, path, frozenset(names) if names else None, lines)


RUNTIME = "reliable_sub/_runtime"
EPOLL_WAIT = "<method 'poll' of 'select.epoll' objects>"


def pipeline_rules(*, receive: str, lease: str, task: str, settle: str, flow: str, loop: str,
                   io_wait: str | None = None) -> list[Rule]:
    """The rules every profiled Subscriber shares: its own receive loop, leases, dispatch,
    settling and flow control, the event loop (and the time it sits in ``epoll``). They match
    disjoint functions, so a benchmark adds its own (adapter, dedup, its loops) in any order."""
    return [
        rule(receive, f"{RUNTIME}/receiver.py", "_receive", "loop"),
        *(rule(lease, f"{RUNTIME}/{name}.py")
          for name in ("lease", "lease_basics", "claim_renewal", "histogram")),
        rule(task, f"{RUNTIME}/receiver.py", "_admit"),
        rule(task, f"{RUNTIME}/dispatcher.py", "dispatch", "_start", "_run", "_attempt",
             "_call_handler", "_call"),
        rule(task, f"{RUNTIME}/lanes.py", "new_task"),
        rule(task, f"{RUNTIME}/inflight.py"),
        rule(task, "reliable_sub/middleware/__init__.py"),
        rule(settle, f"{RUNTIME}/decisions.py", "settle", "succeeded", "apply"),
        rule(settle, f"{RUNTIME}/dispatcher.py", "key_decided"),
        rule(settle, f"{RUNTIME}/pipeline.py", "_on_settled"),
        rule(settle, f"{RUNTIME}/settler.py"),
        rule(flow, f"{RUNTIME}/flow.py"),
        rule(flow, "reliable_sub/message.py", "size"),
        *([rule(io_wait, "~", EPOLL_WAIT)] if io_wait is not None else []),
        rule(loop, "asyncio/base_events.py", "_run_once", "run_forever", "run_until_complete"),
        rule(loop, "asyncio/events.py", "_run"),
    ]


# Names cProfile gives code that is no function of the source.
_PSEUDO_NAMES = frozenset({"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "<lambda>"})


def unknown_rule_names(rules: Sequence[Rule]) -> list[str]:
    """``path: name`` for every name a rule gives that its file (one of this repository's)
    does not define, and ``path: no such file`` for a file of ours that is gone; rules for
    files outside the repository (asyncio, redis-py) are not checked."""
    root = Path(__file__).resolve().parent.parent
    ours = {entry.name for entry in root.iterdir() if entry.is_dir()}
    problems = []
    for candidate in rules:
        source = root / candidate.path
        if not source.is_file():
            if candidate.path.split("/", 1)[0] in ours:
                problems.append(f"{candidate.path}: no such file")
            continue
        if candidate.names is None:
            continue
        defined = {
            node.name for node in ast.walk(ast.parse(source.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for name in sorted(candidate.names - defined - _PSEUDO_NAMES):
            problems.append(f"{candidate.path}: {name}")
    return problems


@dataclass(frozen=True)
class StageProfile:
    """One profiled run: own time per stage in µs per message, and its hottest functions."""

    variant: str
    micros: dict[str, float]
    hottest: list[tuple[str, float]] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.micros.values())

    def total_of(self, stages: Iterable[str]) -> float:
        """The µs per message of ``stages`` only (the CPU ones, say)."""
        return sum(self.micros[stage] for stage in stages)


def stage_of(key: FunctionKey, rules: Sequence[Rule]) -> str | None:
    """The stage of the first rule that matches ``key``, or ``None``."""
    filename, line, name = key
    for candidate in rules:
        if candidate.matches(filename, line, name):
            return candidate.stage
    return None


def stage_seconds(
    stats: pstats.Stats, rules: Sequence[Rule], stages: Iterable[str], root: str
) -> dict[str, float]:
    """Seconds of own time (``tottime``) per stage, over the whole profile.

    A function that a rule matches puts its own time in that rule's stage. A function that no
    rule matches has the stages of its callers, weighted by the cumulative time spent under each,
    and its own time is split by the caller it was spent under; a root (no callers) or a call
    cycle goes to ``root``. So the stages add up to the whole profile.
    """
    raw: dict[FunctionKey, Any] = stats.stats  # type: ignore[attr-defined]
    shares: dict[FunctionKey, Share] = {}
    visiting: set[FunctionKey] = set()

    def share(key: FunctionKey) -> Share:
        """The fraction of ``key``'s time that belongs to each stage."""
        if key in shares:
            return shares[key]
        stage = stage_of(key, rules)
        callers = raw[key][4] if key in raw else {}
        if stage is not None:
            result = {stage: 1.0}
        elif not callers or key in visiting:  # a root (the loop itself) or a call cycle
            result = {root: 1.0}
        else:  # as its callers, weighted by the cumulative time spent under each
            visiting.add(key)
            total = sum(timing[3] for timing in callers.values()) or 1.0
            result = {}
            for caller, timing in callers.items():
                for caller_stage, fraction in share(caller).items():
                    result[caller_stage] = (
                        result.get(caller_stage, 0.0) + fraction * timing[3] / total
                    )
            visiting.discard(key)
        shares[key] = result
        return result

    seconds = dict.fromkeys(stages, 0.0)
    for key, (_, _, own, _, callers) in raw.items():
        portions: Iterable[tuple[Share, float]]
        if stage_of(key, rules) is not None or not callers:
            portions = [(share(key), own)]
        else:  # split the function's own time by the caller it was spent under
            portions = [(share(caller), timing[2]) for caller, timing in callers.items()]
        for stage_share, spent in portions:
            for stage, fraction in stage_share.items():
                seconds[stage] += fraction * spent
    return seconds


# -- timing ------------------------------------------------------------------------------------


class GcTimer:
    """Adds up the seconds the cyclic garbage collector runs while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


# -- README sections and command line ----------------------------------------------------------


def section_markers(name: str) -> tuple[str, str]:
    """The start and end markers of section ``name`` in the README."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def _section_pattern(name: str) -> re.Pattern[str]:
    start, end = section_markers(name)
    return re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)


def has_section(name: str, readme: Path = README) -> bool:
    """Whether ``readme`` has both markers of section ``name``, in order."""
    return _section_pattern(name).search(readme.read_text()) is not None


def write_section(name: str, section: str, *, append: bool = False, readme: Path = README) -> None:
    """Replace what is between the markers of section ``name`` in ``readme`` with ``section``.

    Without the markers the file is left as it is, unless ``append``: then the section, with its
    markers, goes after the existing text.
    """
    text = readme.read_text()
    start, end = section_markers(name)
    replacement = f"{start}\n{section}\n{end}"
    pattern = _section_pattern(name)
    if pattern.search(text):
        text = pattern.sub(lambda _: replacement, text, count=1)
    elif append:
        text = text.rstrip("\n") + f"\n\n{replacement}\n"
    readme.write_text(text)


def positive_int(text: str) -> int:
    """``argparse`` type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
