"""The cost check: exact counts per message for fixed workloads, against a committed baseline.

Run from the repository root::

    python -m benchmarks.cost                        # measure, compare with the baseline
    python -m benchmarks.cost --runs 5               # ... 5 fresh runs each: do they differ?
    python -m benchmarks.cost --workload memory --top 25   # ... and the functions called most
    python -m benchmarks.cost --write --why "..."    # rewrite the baseline and README section

Each workload is measured in a fresh process (:mod:`benchmarks._cost_run`, which describes the
workloads and what keeps the counts exact) with ``PYTHONHASHSEED=0``. What is counted is nothing
but events, so the same code on the same Python gives the same counts on any machine, loaded or
not: no timing. (Where a count still varies by a few events, see ``--runs``, the variation is
a hundredth of the tolerance or less.)

``tests/test_cost.py`` measures every workload once and fails when a count per message is more
than ``TOLERANCE`` above the baseline in ``cost_baseline.json`` -- and also when it is more than
that below: a gain is then locked in by updating the baseline, or a later regression could
spend it unseen. Updating the baseline is a reviewed change whose commit says why the counts
moved; ``--why`` records the reason in the file as well.

The Kafka workload runs on the node at ``$RELIABLE_SUB_COST_KAFKA_BOOTSTRAP`` (``host:port``;
the test gives it the test run's shared node); without one, this command starts a node of its
own for the run (``tests/kafka_processes.py``: a JDK and Kafka's jars).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import has_section, positive_int, section_markers, write_section
from benchmarks._cost_run import LEAK_FACTOR
from benchmarks._cost_workloads import KAFKA_BOOTSTRAP_ENV
from benchmarks._cost_workloads import WORKLOADS as _WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
BASELINE = Path(__file__).with_name("cost_baseline.json")
SECTION_NAME = "cost"
# A count per message may move this far from the baseline, up or down, before the test fails.
TOLERANCE = 0.10
# ... but blocks left behind may move this far in any case: the memory broker's lease heap is
# compacted now and then, and where the drain falls in that cycle moves the count by up to
# ~0.2 per message. A leak is a block or more per message.
RETAINED_SLACK = 0.5
WORKLOADS = tuple(_WORKLOADS)
# Workloads whose broker is Redis (the test needs a Redis for them).
REDIS_WORKLOADS = tuple(name for name, w in _WORKLOADS.items() if w.broker == "redis")
# ... and Kafka (the test gives them the test run's Kafka node).
KAFKA_WORKLOADS = tuple(name for name, w in _WORKLOADS.items() if w.broker == "kafka")
# What blocks left behind are counted per: the messages the longer pass handled beyond the
# shorter one's.
LEAK_PER = "message beyond the first N"
# What counts that must not grow with the messages at all are counted per: the whole pass.
PER_PASS = "pass"
# Real seconds one workload's process may take before it counts as hung.
PROCESS_TIMEOUT = 300.0


@dataclass(frozen=True)
class Metric:
    name: str
    label: str
    meaning: str
    per: str = "message"
    slack: float = 0.0


METRICS = (
    Metric("calls", "Python calls", "Python functions entered, asyncio's and the clock's "
           "included (the profiling hook's `call` events: a coroutine resumed counts again), "
           "the harness's own excepted"),
    Metric("c_calls", "C calls", "C functions called from Python code (`c_call` events)"),
    Metric("tasks", "tasks created", "asyncio tasks made, however (each registers with "
           "asyncio's set of all tasks; redis-py's own left out: it makes some per command, "
           "as its socket allows)"),
    Metric("round_trips", "broker + store calls", "calls of the adapter's receive, ack, nack, "
           "extend, ack_with_completions and the dedup store's claim, complete, release and "
           "renew methods"),
    Metric("redis_round_trips", "Redis round trips", "commands and pipelines sent by the "
           "adapter's Redis client (which the dedup store shares)"),
    Metric("kafka_pauses", "Kafka pauses + resumes per pass", "`pause` and `resume` calls "
           "of the Kafka consumer's librdkafka client, from the consumer's creation (before "
           "the count) to its close: none while every partition's backlog is under the "
           "adapter's `buffer` (a pause drops librdkafka's prefetch of the partition, fetched "
           "again on resume)", per=PER_PASS),
    Metric("kafka_commits", "Kafka commits per pass", "`commit` calls of the Kafka consumer's "
           "client from its creation to its close, its `commit_interval` longer than the "
           "pass: one before the pass (of a record acked there, so that the interval runs "
           "from then), one as it closes; more would be commits that grow with the messages",
           per=PER_PASS),
    Metric("held_blocks", "blocks held per message in flight", "memory blocks (tracemalloc) "
           "allocated since the start and alive with the first 1,000 messages held in the "
           "handler (the sync workload: one in the thread, the others waiting for it), per "
           "message then in flight: the in-process broker's deliveries, the Subscriber's "
           "records, tasks, and the held handler's own coroutine and wait",
           per="message in flight"),
    Metric("garbage", "objects in reference cycles", "objects the cyclic collector freed "
           "(collected by hand at the two measuring points; the collector is off)"),
    Metric("retained_blocks", "blocks left behind", "blocks alive once every message is "
           "acked, after a pass of 3N messages less after one of N: structures of bounded "
           "size, full after N, fall out, a leak stays (the test allows ±0.5 here: where the "
           "drain falls in the in-process broker's lease-heap compaction moves it by up to "
           "~0.2)", per=LEAK_PER, slack=RETAINED_SLACK),
)
METRIC_BY_NAME = {metric.name: metric for metric in METRICS}


def python_version() -> str:
    return ".".join(platform.python_version_tuple()[:2])


# -- measuring ----------------------------------------------------------------------------------


def measure(workload: str, top: int = 0, kafka_bootstrap: str | None = None) -> dict[str, Any]:
    """One workload's counts, measured in a fresh process (a Kafka workload's on the node at
    ``kafka_bootstrap``, or else at ``$RELIABLE_SUB_COST_KAFKA_BOOTSTRAP``)."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if kafka_bootstrap is not None:
        env[KAFKA_BOOTSTRAP_ENV] = kafka_bootstrap
    command = [sys.executable, "-m", "benchmarks._cost_run", workload, "--top", str(top)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {workload!r} failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def per_message(result: dict[str, Any]) -> dict[str, float]:
    """Each total of a measurement divided by what it is counted per."""
    divisors = {
        "message": result["messages"],
        "message in flight": result.get("in_flight", 0),
        LEAK_PER: (LEAK_FACTOR - 1) * result["messages"],
        PER_PASS: 1,
    }
    return {name: total / divisors[METRIC_BY_NAME[name].per]
            for name, total in result["totals"].items()}


# -- comparing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One count of one workload: the baseline's, the measured one, and what that means."""

    workload: str
    metric: Metric
    baseline: float | None
    measured: float | None

    @property
    def allowed(self) -> float:
        # (a hair more, so that exactly TOLERANCE is not lost to rounding)
        return max(TOLERANCE * abs(self.baseline or 0.0), self.metric.slack) * (1 + 1e-9)

    @property
    def verdict(self) -> str:
        if self.baseline is None:
            return "not in the baseline"
        if self.measured is None:
            return "no longer measured"
        if self.measured > self.baseline + self.allowed:
            return "GREW"
        if self.measured < self.baseline - self.allowed:
            return "SHRANK"
        return "ok"

    @property
    def change(self) -> str:
        if self.baseline is None or self.measured is None:
            return "–"
        if self.baseline == 0:
            return "±0" if self.measured == 0 else "new"
        return f"{(self.measured - self.baseline) / abs(self.baseline):+.1%}"


def load_baseline(path: Path = BASELINE) -> dict[str, Any]:
    baseline: dict[str, Any] = json.loads(path.read_text())
    return baseline


def compare(workload: str, baseline: dict[str, Any], result: dict[str, Any]) -> list[Row]:
    """The rows of ``workload``: every count in the baseline or in the measurement."""
    recorded = baseline["workloads"].get(workload)
    before = per_message(recorded) if recorded is not None else {}
    after = per_message(result)
    return [
        Row(workload, metric, before.get(metric.name), after.get(metric.name))
        for metric in METRICS
        if metric.name in before or metric.name in after
    ]


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:,.3f}"


def comparison_table(rows: Iterable[Row]) -> str:
    lines = ["| workload | count per message | baseline | measured | change | verdict |",
             "|---|---|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row.workload} | {row.metric.label} | {_number(row.baseline)} | "
                     f"{_number(row.measured)} | {row.change} | {row.verdict} |")
    return "\n".join(lines)


def advice(rows: Iterable[Row]) -> str:
    """What to do about the rows that are not ok."""
    verdicts = {row.verdict for row in rows}
    lines = []
    if "GREW" in verdicts:
        lines.append(
            f"A count grew more than {TOLERANCE:.0%} over the baseline. Find what does more "
            "per message: `python -m benchmarks.cost --workload NAME --top 30` lists the "
            "functions called most, the tasks made and the broker calls; compare with the "
            "same command on the parent commit. If the extra work is worth it, update the "
            "baseline (below) and say why in the commit."
        )
    if "SHRANK" in verdicts:
        lines.append(
            f"A count fell more than {TOLERANCE:.0%} below the baseline: good, now lock it in "
            "(below), or a later change could spend the gain unseen."
        )
    if verdicts & {"not in the baseline", "no longer measured"}:
        lines.append("The workloads or counts changed: the baseline must follow (below).")
    if lines:
        lines.append('Update: `python -m benchmarks.cost --write --why "what changed and why"`'
                     " (a reviewed change; the commit message gives the reason too).")
    return "\n".join(lines)


def spread(runs: list[dict[str, Any]]) -> tuple[str, bool]:
    """How far the counts of repeated runs of one workload differ, and whether that is little
    enough: under a hundredth of what the test allows, it cannot make the test flaky."""
    if all(run["totals"] == runs[0]["totals"] for run in runs):
        return f"identical: {runs[0]['totals']}", True
    counts = [per_message(run) for run in runs]
    parts, steady = [], True
    for name, total in runs[0]["totals"].items():
        values = [run["totals"][name] for run in runs]
        if min(values) == max(values):
            parts.append(f"{name} {total} (identical)")
            continue
        metric = METRIC_BY_NAME[name]
        width = max(c[name] for c in counts) - min(c[name] for c in counts)
        allowed = max(TOLERANCE * abs(counts[0][name]), metric.slack)
        steady = steady and width <= allowed / 100
        parts.append(f"{name} {min(values)}..{max(values)} ({width:.2g} per {metric.per}, "
                     f"{width / allowed:.2%} of the test's tolerance)")
    return "; ".join(parts), steady


# -- writing ------------------------------------------------------------------------------------


def baseline_document(results: dict[str, dict[str, Any]], why: str) -> dict[str, Any]:
    return {
        "why": why,
        "python": python_version(),
        "workloads": {
            name: {key: result[key] for key in ("messages", "in_flight", "totals")
                   if key in result}
            for name, result in results.items()
        },
    }


def readme_section(results: dict[str, dict[str, Any]], command: str, why: str) -> str:
    counts = {name: per_message(result) for name, result in results.items()}
    lines = [
        "## Cost check: exact counts per message (`tests/test_cost.py`)",
        "",
        f"Command (from the repository root): `{command}`; written "
        f"{datetime.date.today().isoformat()} with CPython {platform.python_version()}. "
        "Counted, not timed: the same code on the same Python gives the same counts on any "
        "machine. "
        f"The test fails when a count moves more than {TOLERANCE:.0%} from these (up or "
        "down); the counts themselves are in `benchmarks/cost_baseline.json`.",
        "",
        f"Last update: {why}",
        "",
        "| count per message | " + " | ".join(counts) + " |",
        "|---" + "|---:" * len(counts) + "|",
    ]
    for metric in METRICS:
        cells = [f"{c[metric.name]:,.3f}" if metric.name in c else "–" for c in counts.values()]
        lines.append(f"| {metric.label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Workloads: each runs a Subscriber with default policies (but `receive_timeout=0.2`, "
        "so a stop does not wait 5 s for an idle Redis read) over messages all published "
        "before it starts, with a clock that never moves and no watchdog thread:",
        "",
        *(f"* **{name}** ({result['messages']:,} messages): {_WORKLOADS[name].description}."
          for name, result in results.items()),
        "",
        "On Redis only the exact counts are kept: replies are split over socket reads as they "
        "happen to be, so Python calls and allocations vary there by a fraction of a percent. "
        "On Kafka the adapter's poll thread fetches as it happens to: every record is in the "
        "adapter's buffer before the pass starts, the thread's own calls are not counted (but "
        "the pauses, resumes and commits it asks of its client), a receive's wait "
        "(`receive_timeout=60`) never times out within a pass, and blocks are not counted: "
        "the thread's allocations change what CPython's free lists hold, and with it how many "
        "of the loop's objects are new blocks. "
        "Counts (each divided by the messages, or as said):",
        "",
        *(f"* **{metric.label}** (per {metric.per}): {metric.meaning}." for metric in METRICS),
    ]
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------------


@contextlib.contextmanager
def kafka_node(needed: bool) -> Iterator[str | None]:
    """The Kafka node's ``host:port`` for the Kafka workloads: ``$RELIABLE_SUB_COST_KAFKA_
    BOOTSTRAP``, or one started for this run (killed after it); None when none is needed."""
    if not needed or os.environ.get(KAFKA_BOOTSTRAP_ENV):
        yield os.environ.get(KAFKA_BOOTSTRAP_ENV) if needed else None
        return
    from tests.kafka_processes import KafkaBroker

    with tempfile.TemporaryDirectory(prefix="cost-kafka-") as directory:
        node = KafkaBroker(Path(directory))
        try:
            node.start()
            yield node.bootstrap
        finally:
            node.kill()


def _details(result: dict[str, Any]) -> list[str]:
    detail = result["detail"]
    lines = [f"\n{result['workload']}: {result['messages']:,} messages, "
             f"{result['seconds']}s", f"  broker + store calls: {detail['round_trips']}",
             f"  tasks: {detail['tasks']}"]
    if "redis_round_trips" in detail:
        lines.append(f"  Redis round trips: {detail['redis_round_trips']}")
    if "kafka_client_calls" in detail:
        lines.append(f"  Kafka client calls: {detail['kafka_client_calls']}")
    for function, calls in detail["top_calls"]:
        lines.append(f"  {calls / result['messages']:9.3f}  {function}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", action="append", choices=WORKLOADS,
                        help="measure only this workload (repeatable)")
    parser.add_argument("--runs", type=positive_int, default=1,
                        help="fresh runs per workload; their counts may differ by no more "
                        "than a hundredth of the tolerance")
    parser.add_argument("--top", type=int, default=0,
                        help="also list the functions called most, per message")
    parser.add_argument("--write", action="store_true",
                        help=f"rewrite {BASELINE.name} and the README section")
    parser.add_argument("--why", help="with --write: why the counts moved (kept in the file)")
    args = parser.parse_args(argv)
    if args.write and not args.why:
        parser.error("--write needs --why: the reason the baseline changes")
    if args.write and args.workload:
        parser.error("--write measures every workload: leave out --workload")
    if args.write and not has_section(SECTION_NAME):
        start, end = section_markers(SECTION_NAME)
        parser.error(f"markers {start} / {end} not found in benchmarks/README.md")
    results: dict[str, dict[str, Any]] = {}
    unstable = []
    workloads = args.workload or WORKLOADS
    with kafka_node(any(name in KAFKA_WORKLOADS for name in workloads)) as bootstrap:
        for workload in workloads:
            runs = [measure(workload, args.top, bootstrap) for _ in range(args.runs)]
            verdict, steady = spread(runs)
            if args.runs > 1:
                print(f"{workload}, {args.runs} runs: {verdict}", file=sys.stderr)
            if not steady:
                unstable.append(workload)
            results[workload] = runs[0]
            if args.top:
                print("\n".join(_details(runs[0])), file=sys.stderr)
    if unstable:
        print(f"counts of {unstable} differ between runs by more than a hundredth of the "
              "tolerance: find what makes them vary before trusting them", file=sys.stderr)
        return 1
    if args.write:
        document = baseline_document(results, args.why)
        BASELINE.write_text(json.dumps(document, indent=2) + "\n")
        command = "python -m benchmarks.cost --write --why ..."
        write_section(SECTION_NAME, readme_section(results, command, args.why))
        print(f"wrote {BASELINE} and the {SECTION_NAME} section of benchmarks/README.md")
        return 0
    if not BASELINE.exists():
        print(f"no baseline at {BASELINE}; write one with --write --why ...")
        return 1
    baseline = load_baseline()
    if baseline["python"] != python_version():
        print(f"note: the baseline was written with Python {baseline['python']}, this is "
              f"{python_version()}: counts of the interpreter's own code differ between versions")
    rows = [row for name, result in results.items() for row in compare(name, baseline, result)]
    print(comparison_table(rows))
    bad = [row for row in rows if row.verdict != "ok"]
    if bad:
        print("\n" + advice(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
