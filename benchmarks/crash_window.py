"""The crash window, and what it costs in kill storms, per dedup store layout.

    python -m benchmarks.crash_window window              # ms from a handler's return to its record
    python -m benchmarks.crash_window kills --kills 300   # doubled effects per 1,000 SIGKILLs
    python -m benchmarks.crash_window all --write         # both, into docs/reliability.md

With a dedup store that is not the handler's own database, a handler's effect and its record are
two writes: a consumer killed between them leaves an effect without a record, and the
redelivery runs the handler again. ``window`` measures that time in one consumer
(``_crash_window_run``); ``kills`` runs the chaos suite's kill storm long enough to count the
doubles it causes, with a 95% upper bound (``_crash_kills``). Both run on the local Redis and
PostgreSQL (``--redis``, ``--postgres`` to change); the store-apart layout starts a private
``redis-server``. The machine should be otherwise idle: the window is mostly the event loop's
latency, and a loaded CPU widens it several times over.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import positive_int, write_section
from benchmarks._crash_kills import KillRun, storm
from benchmarks._crash_layouts import KILL_LAYOUTS, LAYOUTS, WINDOW_LAYOUTS
from benchmarks._crash_window_run import Window, measure

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
# docs/reliability.md's sections: each measurement rewrites its own
SECTIONS = {"window": "crash_window", "kills": "crash_kills"}
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


def window_table(windows: Sequence[Window], messages: int) -> str:
    lines = [
        f"Window: {messages:,} messages per layout, published at a steady rate to one consumer "
        f"(handlers 0-50 ms, then an `HINCRBY` effect; 50 in flight); milliseconds from the "
        f"effect's write being sent to the return of the call that made its completion "
        f"durable, and the mean of the part after the handler returned.",
        "",
        "| layout | messages/s | p50 ms | p90 ms | p99 ms | max ms | mean ms "
        "| mean ms after the return | effects at risk at any instant |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in windows:
        lines.append(f"| {w.layout} | {w.rate:,.0f} | {w.p50:.2f} | {w.p90:.2f} | {w.p99:.2f} "
                     f"| {w.max:.1f} | {w.mean:.2f} | {w.mean_after_return:.2f} "
                     f"| {w.effects_at_risk:.2f} |")
    lines.append("| redis broker, transactional SQL handler | – | 0 | 0 | 0 | 0 | 0 | 0 "
                 "| 0 (effect and record commit together) |")
    return "\n".join(lines)


def kills_table(runs: Sequence[KillRun], interval: tuple[float, float]) -> str:
    lines = [
        f"Kill storms: 3 consumer processes under a steady load, handlers 0-50 ms, a consumer "
        f"that is receiving SIGKILLed and restarted every {interval[0]:g}-{interval[1]:g} s; "
        f"effects counted outside the consumers after every message had one. Upper bound: "
        f"one-sided 95%, the doubles taken as a Poisson count.",
        "",
        "| layout | messages/s | kills | messages | lost | doubled effects | per 1,000 kills "
        "| 95% upper bound per 1,000 kills | run (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(f"| {run.layout} | {run.rate:,.0f} | {run.kills:,} | {run.messages:,} "
                     f"| {run.lost} "
                     f"| {run.doubles:,} | {run.per_thousand:,.0f} "
                     f"| {run.upper_per_thousand:,.0f} | {run.seconds:.0f} |")
    return "\n".join(lines)


def section(command: str, table: str) -> str:
    today = datetime.date.today().isoformat()
    header = (f"Produced by `{command}` on {today} (CPython {platform.python_version()}, "
              f"{platform.system()} {platform.machine()}, Redis and PostgreSQL on loopback).")
    return f"{header}\n\n{table}"


async def amain(args: argparse.Namespace) -> dict[str, str]:
    """The tables measured, by what they measure (``window``, ``kills``)."""
    tables: dict[str, str] = {}
    if args.what in ("window", "all"):
        windows = []
        for key in args.layouts or WINDOW_LAYOUTS:
            if LAYOUTS[key].window:
                windows.append(await measure(key, messages=args.messages, rate=args.rate,
                                             redis_url=args.redis, postgres_url=args.postgres))
                print(window_table(windows[-1:], args.messages).splitlines()[-2], flush=True)
        tables["window"] = window_table(windows, args.messages)
    if args.what in ("kills", "all"):
        interval = (args.interval[0], args.interval[1])
        runs = []
        for key in args.layouts or KILL_LAYOUTS:
            if LAYOUTS[key].kills:
                kills = args.baseline_kills if key == "none" else args.kills
                runs.append(await storm(key, kills=kills, interval=interval))
                print(kills_table(runs[-1:], interval).splitlines()[-1], flush=True)
        tables["kills"] = kills_table(runs, interval)
    return tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("what", choices=("window", "kills", "all"))
    parser.add_argument("--layouts", nargs="*", choices=sorted(LAYOUTS),
                        help="default: every layout the measurement applies to")
    parser.add_argument("--messages", type=positive_int, default=10_000,
                        help="window: messages per layout (default 10,000)")
    parser.add_argument("--rate", type=float, default=500.0,
                        help="window: messages per second (default 500)")
    parser.add_argument("--kills", type=positive_int, default=300,
                        help="kills: kills per layout (default 300)")
    parser.add_argument("--baseline-kills", type=positive_int, default=50,
                        help="kills: kills of the no-store baseline (default 50)")
    parser.add_argument("--interval", type=float, nargs=2, default=(0.8, 1.2),
                        metavar=("LOW", "HIGH"), help="kills: seconds between kills")
    parser.add_argument("--redis", default=DEFAULT_REDIS)
    parser.add_argument("--postgres", default=DEFAULT_POSTGRES)
    parser.add_argument("--write", action="store_true",
                        help="rewrite the measured tables' sections of docs/reliability.md")
    args = parser.parse_args(argv)
    tables = asyncio.run(amain(args))
    command = "python -m benchmarks.crash_window " + " ".join(
        sys.argv[1:] if argv is None else argv)
    for what, table in tables.items():
        text = section(command, table)
        print(text, end="\n\n")
        if args.write:
            write_section(SECTIONS[what], text, readme=DOC)


if __name__ == "__main__":
    main()
