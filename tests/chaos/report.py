"""The figures of the fault-injection scenarios, and ``docs/reliability.md``'s table.

Each scenario adds a :class:`Row`; at the end of a pytest session run with
``RELIABILITY_REPORT=1`` the table between the ``chaos`` markers of ``docs/reliability.md`` is
rewritten from the rows (see ``tests/chaos/conftest.py``).
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import write_section
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


def record(row: Row) -> None:
    ROWS.append(row)


def record_load(row: LoadRow) -> None:
    LOAD_ROWS.append(row)


def record_dedup(row: DedupRow) -> None:
    DEDUP_ROWS.append(row)


def anything_recorded() -> bool:
    return bool(ROWS or LOAD_ROWS or DEDUP_ROWS)


# The table's order: scenarios in the order of the issue, then the sabotage check.
ORDER = ("kill storm", "rolling deploy", "broker", "emulator", "client", "PostgreSQL",
         "slow handlers", "sabotage")


def _rank(row: Row) -> tuple[int, str, str]:
    rank = next((i for i, prefix in enumerate(ORDER) if row.scenario.startswith(prefix)),
                len(ORDER))
    return rank, row.adapter, row.dedup


def produced_by() -> str:
    return (f"Produced by `{COMMAND}` on {datetime.date.today().isoformat()} (CPython "
            f"{platform.python_version()}, {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} CPUs; Redis, PostgreSQL and the Pub/Sub emulator on loopback).")


def table(rows: list[Row]) -> str:
    lines = [
        produced_by(),
        "",
        "| Scenario | Adapter | Dedup | Messages | Lost | Duplicate effects | Dead-lettered | "
        "Faults | Recovery | CPU during outage | Run (s) |",
        "|---|---|---|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for row in sorted(rows, key=_rank):
        c = row.count
        lines.append(
            f"| {row.scenario} | {row.adapter} | {row.dedup} | {c.messages:,} | {c.lost} | "
            f"{c.duplicate_effects} | {row.dead_lettered} | {row.faults} | {row.recovery} | "
            f"{row.cpu_during_outage} | {row.seconds:.0f} |")
    return "\n".join(lines)


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
        write_section(SECTION, table(ROWS), readme=DOC)
    if LOAD_ROWS:
        write_section("load", load_table(LOAD_ROWS), readme=DOC)
    if DEDUP_ROWS:
        write_section("dedup-size", dedup_table(DEDUP_ROWS), readme=DOC)


__all__ = ["DEDUP_ROWS", "LOAD_ROWS", "ROWS", "DedupRow", "LoadRow", "Row", "record",
           "record_dedup", "record_load", "write"]
