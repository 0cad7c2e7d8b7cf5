"""Run a handler against recorded messages and see what it did with each one.

Take messages from production (or write them by hand), replay them through a real Subscriber on
the in-memory broker, with faults if you like, and get a report per message: how often the
handler ran, how often it finished, how the deliveries ended, and how many effects the message
had::

    report = await run_recorded(charge, load_recorded("tests/orders.jsonl"),
                                faults=Faults(duplicate=1.0), effects=payments_of)
    assert report.doubled() == [] and report.lost() == [], report.table()

Time is a :class:`~reliable_sub.clock.ManualClock` driven while the loop is idle: ack deadlines,
backoffs and lease renewals take no real time. The handler's own waits (HTTP calls, sleeps) do.
The handler sees the recorded data, attributes and ordering key, but a message id given by the
in-memory broker; the report maps each back to its recorded message.
"""

from __future__ import annotations

import base64
import functools
import inspect
import json
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from reliable_sub._callables import is_async_callable
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.clock import ManualClock
from reliable_sub.dedup import DedupStore, MemoryDedupStore
from reliable_sub.message import Message
from reliable_sub.outcome import Outcome
from reliable_sub.subscriber import Subscriber
from reliable_sub.testing.faults import FaultInjector, Faults
from reliable_sub.testing.timing import drive_until

TOPIC = "recorded"
SUBSCRIPTION = "recorded-replay"
# Clock seconds a replay may take before it is called stuck: backoffs of many attempts fit.
DEFAULT_WITHIN = 24 * 3600.0
# The outcomes after which a delivery is not coming back.
FINAL_OUTCOMES = frozenset({Outcome.ACKED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED})


@dataclass
class MessageEffects:
    """What became of one recorded message.

    Attributes:
        index: its position in the recorded list.
        message: the recorded message.
        calls: times the handler was called with it.
        returned: times the handler returned (did its work) for it.
        outcomes: how each of its deliveries ended, in order.
        errors: what each failed call raised, as ``Type: text``.
        effects: its effects: what your ``effects`` function counted for it; without one,
            the handler's returns for its idempotency key (all recorded messages with that key).
    """

    index: int
    message: Message
    calls: int = 0
    returned: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    effects: int = 0

    @property
    def final(self) -> Outcome | None:
        """How its last delivery ended, if that delivery is not coming back."""
        for outcome in reversed(self.outcomes):
            if outcome in FINAL_OUTCOMES:
                return outcome
        return None


@dataclass
class EffectsReport:
    """A replay's result: one :class:`MessageEffects` per recorded message, in order.

    Attributes:
        messages: per recorded message.
        injected: the faults injected, by name (empty without faults).
        seed: the fault injector's seed, to repeat a run.
    """

    messages: list[MessageEffects]
    injected: Counter[str] = field(default_factory=Counter)
    seed: int | None = None

    def doubled(self) -> list[MessageEffects]:
        """Messages with more than one effect."""
        return [entry for entry in self.messages if entry.effects > 1]

    def lost(self) -> list[MessageEffects]:
        """Messages with no effect that were not dead-lettered."""
        return [entry for entry in self.messages
                if entry.effects == 0 and entry.final is not Outcome.DEAD_LETTERED]

    def dead_lettered(self) -> list[MessageEffects]:
        """Messages whose last delivery went to the dead-letter topic."""
        return [entry for entry in self.messages if entry.final is Outcome.DEAD_LETTERED]

    def table(self) -> str:
        """The report as a text table, for an assertion message."""
        rows = [("#", "key", "calls", "returned", "effects", "outcomes", "last error")]
        for entry in self.messages:
            rows.append((
                str(entry.index), _short(entry.message.idempotency_key), str(entry.calls),
                str(entry.returned), str(entry.effects),
                ",".join(outcome.value for outcome in entry.outcomes),
                _short(entry.errors[-1], 60) if entry.errors else "",
            ))
        widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                 for row in rows]
        if self.injected:
            faults = ", ".join(f"{name} {count}" for name, count in sorted(self.injected.items()))
            lines.append(f"faults injected (seed {self.seed}): {faults}")
        return "\n".join(line.rstrip() for line in lines)


async def run_recorded(
    handler: Callable[..., Any],
    messages: Iterable[Message],
    *,
    dedup: DedupStore | Literal["memory"] | None = "memory",
    faults: Faults | FaultInjector | None = None,
    effects: Callable[[Message], int | Awaitable[int]] | None = None,
    ack_deadline: float = 10.0,
    ordering: bool = False,
    transactional: bool = False,
    within: float = DEFAULT_WITHIN,
    **subscriber_options: Any,
) -> EffectsReport:
    """Run ``handler`` on ``messages`` through a Subscriber on the in-memory broker.

    Returns once every message's last delivery is settled for good (acked, a duplicate or
    dead-lettered) and nothing is left at the broker.

    Args:
        handler: your handler, sync or async, as you register it.
        messages: the recorded messages (their data, attributes and ordering key are
            published; see :func:`load_recorded`).
        dedup: the dedup store (default: a fresh ``MemoryDedupStore``; None: none).
        faults: faults to inject (a :class:`~reliable_sub.testing.faults.Faults`, or an
            injector you keep to read its counts); its middleware goes last in ``middleware``.
        effects: counts a recorded message's effects after the run, from where your handler
            leaves them (a database, a fake payment API...); sync or async.
        ack_deadline: the subscription's ack deadline (clock seconds).
        ordering: deliver messages of one ordering key in order, one at a time.
        transactional: register the handler with ``transactional=True`` (``dedup`` must be a
            ``SqlDedupStore``; the handler is called with a connection too).
        within: clock seconds the replay may take (an AssertionError after that).
        subscriber_options: passed to :class:`~reliable_sub.Subscriber` (``retry``,
            ``dead_letter``, ``lease``, ``middleware``...; not ``clock``).
    """
    recorded = list(messages)
    clock = ManualClock()
    broker = MemoryAdapter(clock=clock)
    broker.ensure_subscription_sync(TOPIC, SUBSCRIPTION, ack_deadline=ack_deadline,
                                    ordering=ordering)
    dead_letter = subscriber_options.get("dead_letter")
    if dead_letter is not None:
        broker.ensure_subscription_sync(dead_letter.topic, f"{dead_letter.topic}-sub")

    injector = faults if isinstance(faults, FaultInjector) or faults is None else (
        FaultInjector(faults))
    store = MemoryDedupStore(clock=clock) if dedup == "memory" else dedup
    assert not isinstance(store, str)
    adapter: Any = broker
    if injector is not None:
        adapter = injector.adapter(broker)
        store = injector.store(store) if store is not None else None
        middleware = [*subscriber_options.pop("middleware", ()), injector.middleware]
        subscriber_options["middleware"] = middleware

    entries = [MessageEffects(index, message) for index, message in enumerate(recorded)]
    by_broker_id: dict[str, MessageEffects] = {}
    lock = threading.Lock()  # sync handlers count from worker threads

    def on_outcome(message: Message, outcome: Outcome) -> None:
        by_broker_id[message.id].outcomes.append(outcome)

    sub = Subscriber(adapter, dedup=store, clock=clock, on_outcome=on_outcome,
                     **subscriber_options)
    sub.handler(SUBSCRIPTION, transactional=transactional)(
        _counting(handler, by_broker_id, lock))
    for entry in entries:
        message = entry.message
        broker_id = broker.publish_sync(TOPIC, message.data, dict(message.attributes),
                                        message.ordering_key)
        by_broker_id[broker_id] = entry

    def replayed() -> bool:
        return (all(entry.final is not None for entry in entries)
                and broker.backlog(SUBSCRIPTION) == 0
                and (injector is None or injector.pending == 0))

    async with sub:
        await drive_until(clock, replayed, within, what="every recorded message settled")
    await _count_effects(entries, effects)
    return EffectsReport(entries, Counter(injector.injected) if injector else Counter(),
                         injector.seed if injector else None)


def _counting(
    handler: Callable[..., Any], by_broker_id: dict[str, MessageEffects],
    lock: threading.Lock,
) -> Callable[..., Any]:
    """``handler``, sync or async as it is, counting its calls and returns per message."""

    def count(message: Message, what: str, error: BaseException | None = None) -> None:
        with lock:
            entry = by_broker_id[message.id]
            if what == "call":
                entry.calls += 1
            elif what == "return":
                entry.returned += 1
            else:
                entry.errors.append(f"{type(error).__name__}: {error}")

    if is_async_callable(handler):
        @functools.wraps(handler)
        async def counted_async(message: Message, *args: Any) -> Any:
            count(message, "call")
            try:
                result = await handler(message, *args)
            except BaseException as error:
                count(message, "error", error)
                raise
            count(message, "return")
            return result
        return counted_async

    @functools.wraps(handler)
    def counted(message: Message, *args: Any) -> Any:
        count(message, "call")
        try:
            result = handler(message, *args)
        except BaseException as error:
            count(message, "error", error)
            raise
        count(message, "return")
        return result
    return counted


async def _count_effects(
    entries: list[MessageEffects], effects: Callable[[Message], int | Awaitable[int]] | None
) -> None:
    if effects is not None:
        for entry in entries:
            counted = effects(entry.message)
            entry.effects = await counted if inspect.isawaitable(counted) else counted
        return
    returns: Counter[str] = Counter()
    for entry in entries:
        returns[entry.message.idempotency_key] += entry.returned
    for entry in entries:
        entry.effects = returns[entry.message.idempotency_key]


def load_recorded(path: str | Path) -> list[Message]:
    """Messages from a JSON Lines file, one object per line.

    Each object has ``data`` (text, stored as UTF-8) or ``data_base64``, and optionally ``id``,
    ``attributes`` (strings to strings) and ``ordering_key``. Blank lines are skipped. A bad
    line raises ValueError naming the file and line.
    """
    path = Path(path)
    messages = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            messages.append(_recorded_message(json.loads(line), number))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{path}:{number}: {error}") from None
    return messages


def _recorded_message(record: Any, number: int) -> Message:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "data_base64" in record:
        data = base64.b64decode(record["data_base64"], validate=True)
    elif isinstance(record.get("data"), str):
        data = record["data"].encode()
    else:
        raise ValueError('needs "data" (text) or "data_base64"')
    attributes = record.get("attributes") or {}
    if not (isinstance(attributes, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in attributes.items())):
        raise ValueError('"attributes" must map strings to strings')
    ordering_key = record.get("ordering_key")
    if ordering_key is not None and not isinstance(ordering_key, str):
        raise ValueError('"ordering_key" must be a string')
    return Message(id=str(record.get("id", f"line-{number}")), data=data,
                   attributes=attributes, ordering_key=ordering_key)


def _short(text: str, width: int = 24) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


__all__ = [
    "SUBSCRIPTION",
    "TOPIC",
    "EffectsReport",
    "MessageEffects",
    "load_recorded",
    "run_recorded",
]
