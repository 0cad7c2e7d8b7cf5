"""The figures of the fault-injection scenarios, and ``docs/reliability.md``'s table.

Each scenario adds a :class:`Row`; at the end of a pytest session run with
``RELIABILITY_REPORT=1`` the table between the ``chaos`` markers of ``docs/reliability.md`` is
rewritten from the rows (see ``tests/chaos/conftest.py``). A session that ran some scenarios
only (``-k rabbitmq``) replaces their rows and keeps the others, each group of rows under the
line that says how, when and on how loaded a machine it was produced.
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import section_markers, write_section
from tests.chaos.fleet import Count

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
SECTION = "chaos"
COMMAND = "RELIABILITY_REPORT=1 python -m pytest -m chaos -n 0"


@dataclass
class Row:
    scenario: str
    adapter: str
    dedup: str
    count: Count
    dead_lettered: int = 0
    faults: str = ""
    recovery: str = "—"
    cpu_during_outage: str = "—"
    seconds: float = 0.0


@dataclass
class LoadRow:
    """A consumer's memory through rounds of messages at full speed (scenario 7)."""

    adapter: str
    dedup: str
    messages: int
    rounds: int
    rate: float
    baseline_mib: float
    peak_mib: float
    drained_mib: float
    blocks_per_message: float


@dataclass
class DedupRow:
    """A dedup store's size per key, and how its records went (scenario 7)."""

    store: str
    keys: int
    seconds: float
    bytes_per_key: float
    retention: float
    emptied: str


ROWS: list[Row] = []
LOAD_ROWS: list[LoadRow] = []
DEDUP_ROWS: list[DedupRow] = []
# The machine's 1-minute load average when the session began and at each row recorded.
LOADS: list[float] = []
KEYWORD = ""  # the session's -k expression, if any


def begin(keyword: str) -> None:
    """A session begins (with ``-k keyword``, or none)."""
    global KEYWORD
    KEYWORD = keyword
    LOADS.append(os.getloadavg()[0])


def record(row: Row) -> None:
    ROWS.append(row)
    LOADS.append(os.getloadavg()[0])


def record_load(row: LoadRow) -> None:
    LOAD_ROWS.append(row)


def record_dedup(row: DedupRow) -> None:
    DEDUP_ROWS.append(row)


def anything_recorded() -> bool:
    return bool(ROWS or LOAD_ROWS or DEDUP_ROWS)


# The table's order: scenarios in the order of the issue, then the sabotage check.
ORDER = ("kill storm", "rolling deploy", "broker", "consumers' connections", "emulator",
         "client", "PostgreSQL", "slow handlers", "delayed nacks", "sabotage")


def _rank(scenario: str, adapter: str, dedup: str) -> tuple[int, str, str]:
    rank = next((i for i, prefix in enumerate(ORDER) if scenario.startswith(prefix)),
                len(ORDER))
    return rank, adapter, dedup


def _load() -> str:
    """The machine's load while the session ran, when it was more than its CPUs."""
    cpus = os.cpu_count() or 1
    if not LOADS or max(LOADS) < cpus:
        return ""
    low, high = min(LOADS), max(LOADS)
    said = f"{low:.1f}" if high - low < 0.5 else f"{low:.1f}-{high:.1f}"
    return (f"; a loaded machine, shared with other work: load average {said} while it ran, "
            "so runs took longer than alone")


def produced_by(rows: str = "") -> str:
    """The line that says how the rows below were made (``rows``: which, for a session that
    ran some of the scenarios only)."""
    command = f"{COMMAND} -k {KEYWORD}" if KEYWORD else COMMAND
    which = f"The {rows} rows: produced" if rows else "Produced"
    return (f"{which} by `{command}` on {datetime.date.today().isoformat()} (CPython "
            f"{platform.python_version()}, {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} CPUs; Redis, PostgreSQL, RabbitMQ and the Pub/Sub emulator on "
            f"loopback{_load()}).")


HEADER = (
    "| Scenario | Adapter | Dedup | Messages | Lost | Duplicate effects | Dead-lettered | "
    "Faults | Recovery | CPU during outage | Run (s) |",
    "|---|---|---|---:|---:|---:|---:|---|---|---|---:|",
)


def _line(row: Row) -> str:
    c = row.count
    return (f"| {row.scenario} | {row.adapter} | {row.dedup} | {c.messages:,} | {c.lost} | "
            f"{c.duplicate_effects} | {row.dead_lettered} | {row.faults} | {row.recovery} | "
            f"{row.cpu_during_outage} | {row.seconds:.0f} |")


def _key(line: str) -> tuple[str, str, str]:
    """A table line's scenario, adapter and dedup."""
    scenario, adapter, dedup = (cell.strip() for cell in line.strip("|").split("|")[:3])
    return scenario, adapter, dedup


def table(rows: list[Row], before: str = "") -> str:
    """The table of ``rows``, and of the rows of ``before`` (the section as it was) that this
    session did not run again, with the lines that say how each group was produced."""
    lines = {(row.scenario, row.adapter, row.dedup): _line(row) for row in rows}
    kept = [line for line in before.splitlines()
            if line.startswith("| ") and line not in HEADER and _key(line) not in lines]
    provenance = [produced_by()]
    if kept:
        adapters = ", ".join(sorted({row.adapter for row in rows}))
        provenance = [line for line in before.splitlines()
                      if line.strip() and not line.startswith(("|", "<!--"))
                      and not line.startswith(f"The {adapters} rows:")]
        provenance.append(produced_by(adapters))
    lines.update((_key(line), line) for line in kept)
    return "\n".join([*provenance, "", *HEADER,
                      *(lines[key] for key in sorted(lines, key=lambda key: _rank(*key)))])


def _section(name: str) -> str:
    """What is between the markers of section ``name`` in the doc now."""
    start, end = section_markers(name)
    text = DOC.read_text()
    if start not in text or end not in text:
        return ""
    return text.split(start, 1)[1].split(end, 1)[0]


def load_table(rows: list[LoadRow]) -> str:
    lines = [
        produced_by(),
        "",
        "| Adapter | Dedup | Messages × rounds | Slowest round (msg/s) | RSS after warm-up "
        "(MiB) | Peak (MiB) | After the last drain (MiB) | Blocks kept per message |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in sorted(rows, key=lambda row: row.adapter):
        lines.append(
            f"| {row.adapter} | {row.dedup} | {row.messages:,} × {row.rounds} | "
            f"{row.rate:,.0f} | {row.baseline_mib:.1f} | {row.peak_mib:.1f} | "
            f"{row.drained_mib:.1f} | {row.blocks_per_message:.4f} |")
    return "\n".join(lines)


def dedup_table(rows: list[DedupRow]) -> str:
    lines = [
        produced_by(),
        "",
        "| Store | Keys | Claimed and completed in (s) | Bytes per key | Retention (s) | "
        "Afterwards |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.store} | {row.keys:,} | {row.seconds:.1f} | {row.bytes_per_key:.0f} | "
            f"{row.retention:g} | {row.emptied} |")
    return "\n".join(lines)


def write() -> None:
    if ROWS:
        write_section(SECTION, table(ROWS, _section(SECTION)), readme=DOC)
    if LOAD_ROWS:
        write_section("load", load_table(LOAD_ROWS), readme=DOC)
    if DEDUP_ROWS:
        write_section("dedup-size", dedup_table(DEDUP_ROWS), readme=DOC)


__all__ = ["DEDUP_ROWS", "LOAD_ROWS", "ROWS", "DedupRow", "LoadRow", "Row", "begin", "record",
           "record_dedup", "record_load", "write"]
