"""The counters of the cost check (``benchmarks.cost``), each attached at a public seam.

* :class:`CallCounter` -- Python function calls and C function calls, as the profiling hook
  (``sys.setprofile``) sees them: its ``call`` and ``c_call`` events, counted by
  :mod:`cProfile`, which is that hook implemented in C (the same events, several times cheaper
  than a Python hook function). Functions of the harness itself (the handler under test, the
  counting wrappers) and the C functions they call are left out.
* :class:`TaskCounter` -- asyncio tasks created, seen where each registers itself.
* :class:`Seams` -- calls to the adapter's and the dedup store's broker methods (receive, ack,
  nack, extend, claim, complete, release, renew), by wrapping the methods of the two instances
  the Subscriber is given; it also sees the last ack of the workload and says so.
* :class:`RedisRoundTrips` -- commands and pipelines a redis-py client sends.
* :class:`KafkaClientCalls` -- what the Kafka adapter's consumers ask of their librdkafka
  client (pause, resume, commit, seek, assignments), through the class its poll thread makes.
* :class:`IdleSignallingSelector` -- the event loop's selector, which lets a sync handler's
  thread wait until the loop has nothing to do (see there for why).

Nothing here looks inside ``reliable_sub._runtime``: whatever the delivery path becomes, these
seams stay where they are. (``KafkaClientCalls`` replaces one name in the Kafka adapter's
consumer module, the client class it instantiates: the one seam the adapter offers for it.)
"""

from __future__ import annotations

import asyncio
import cProfile
import functools
import selectors
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from types import CodeType
from typing import Any

HERE = Path(__file__).resolve().parent
# Code in these files is the harness, not the system under test.
HARNESS_FILES = frozenset(
    str(HERE / name)
    for name in ("_cost_counters.py", "_cost_run.py", "_cost_workloads.py", "cost.py")
)

ADAPTER_METHODS = ("receive", "ack", "nack", "extend", "ack_with_completions")
STORE_METHODS = (
    "claim_many", "renew", "complete_many", "release_many", "claim", "complete", "release",
)
# Methods that ack: (name, how to find the refused deliveries in what it returned).
ACKS: dict[str, Callable[[Any], Any]] = {
    "ack": lambda refused: refused,
    "ack_with_completions": lambda result: result[0],
}


def _is_harness(code: object) -> bool:
    return isinstance(code, CodeType) and code.co_filename in HARNESS_FILES


class CallCounter:
    """Counts ``call`` and ``c_call`` profiling events on the calling thread until
    :meth:`stop`, and on every thread started meanwhile for as long as it lives."""

    def __init__(self) -> None:
        self._profiler = cProfile.Profile(builtins=True)
        self._threads: list[tuple[threading.Thread, cProfile.Profile]] = []
        self._frozen: list[list[Any]] = []

    def start(self) -> None:
        threading.setprofile(self._enable_in_new_thread)
        self._profiler.enable()

    def _enable_in_new_thread(self, frame: Any, event: str, arg: Any) -> None:
        """The first profiling event of a new thread gives it a profiler of its own."""
        profiler = cProfile.Profile(builtins=True)
        self._threads.append((threading.current_thread(), profiler))  # atomic under the GIL
        profiler.enable()

    def stop(self) -> None:
        """Stop counting on this thread (new threads are no longer counted either)."""
        threading.setprofile(None)
        self._profiler.disable()
        self._frozen = [self._profiler.getstats()]

    def finish(self, timeout: float) -> None:
        """Wait for the threads started while counting to end, and add what they did. (Cut
        anywhere else, a thread's count would depend on how far it got by then.)"""
        for thread, profiler in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                raise RuntimeError(f"thread {thread.name} still runs {timeout}s after the stop")
            self._frozen.append(profiler.getstats())

    def counts(self) -> tuple[int, int, Counter[str]]:
        """Python calls, C calls, and Python calls by function (for a closer look)."""
        calls = c_calls = 0
        by_function: Counter[str] = Counter()
        for entries in self._frozen:
            for entry in entries:
                code = entry.code
                if _is_harness(code):
                    for sub in entry.calls or ():  # the C functions the harness called
                        if not isinstance(sub.code, CodeType):
                            c_calls -= sub.callcount
                elif isinstance(code, CodeType):
                    calls += entry.callcount
                    by_function[_describe(code)] += entry.callcount
                else:
                    c_calls += entry.callcount
        return calls, c_calls, by_function


def _describe(code: CodeType) -> str:
    parts = Path(code.co_filename).parts
    short = "/".join(parts[-2:])
    name = getattr(code, "co_qualname", code.co_name)  # Python 3.11+
    return f"{short}:{code.co_firstlineno} {name}"


class IdleSignallingSelector(selectors.DefaultSelector):
    """The event loop's selector, telling other threads when the loop is idle: waiting for
    I/O or a timer with no callback ready to run.

    A sync handler that returns only while the loop is idle (:meth:`wait_idle`) hands its
    result back at the same point of the loop's work every time, so with one worker thread
    the interleaving of thread and loop, and every count, is the same run after run.
    """

    def __init__(self) -> None:
        super().__init__()
        self._busy = threading.Lock()  # held by the loop except while it waits
        self._busy.acquire()

    def select(self, timeout: float | None = None) -> Any:
        if timeout is not None and timeout <= 0:  # callbacks are ready: not idle
            return super().select(timeout)
        self._busy.release()
        try:
            return super().select(timeout)
        finally:
            self._busy.acquire()

    def wait_idle(self) -> None:
        """Block the calling thread (not the loop's) until the loop is idle."""
        with self._busy:
            pass


class TaskCounter:
    """Counts the tasks created while :attr:`counting` (however made: ``loop.create_task``, a
    task factory, or ``asyncio.Task`` directly, as the dispatcher does), but those of
    coroutines defined in a file under one of the ``ignore`` paths.

    Every new task adds itself to asyncio's registry of tasks; on CPython 3.11 that is the
    WeakSet ``asyncio.tasks._all_tasks``, whose ``add`` the C Task looks up on the instance
    each time, so an instance attribute sees every task. Later Pythons keep the registry
    elsewhere: then :meth:`install` says so rather than count nothing."""

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.counting = False
        self.created: Counter[str] = Counter()
        self.ignored: Counter[str] = Counter()
        self._ignore = ignore
        self._registry: weakref.WeakSet[asyncio.Task[Any]] | None = None
        self._add: Callable[[asyncio.Task[Any]], None] | None = None

    def install(self) -> None:
        registry = getattr(asyncio.tasks, "_all_tasks", None)
        if not isinstance(registry, weakref.WeakSet):
            raise RuntimeError(
                "asyncio keeps no _all_tasks WeakSet on this Python: count tasks another way "
                "in benchmarks/_cost_counters.py"
            )
        self._registry, self._add = registry, registry.add
        registry.add = self._register  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        if self._registry is not None and self.installed:
            del self._registry.add
        self._registry = self._add = None

    @property
    def installed(self) -> bool:
        return self._registry is not None and vars(self._registry).get("add") == self._register

    def check_installed(self) -> None:
        """Fail if someone replaced the hook (the count would silently be short)."""
        if not self.installed:
            raise RuntimeError(
                "asyncio's registry of tasks was replaced during the run: tasks can no longer "
                "be counted through it; count them another way in benchmarks/_cost_*.py"
            )

    def _register(self, task: asyncio.Task[Any]) -> None:
        assert self._add is not None
        if self.counting:
            coro = task.get_coro()
            name = getattr(coro, "__qualname__", type(coro).__qualname__)
            code = getattr(coro, "cr_code", None)
            if code is not None and code.co_filename.startswith(self._ignore):
                self.ignored[name] += 1
            else:
                self.created[name] += 1
        self._add(task)

    @property
    def total(self) -> int:
        return sum(self.created.values())


class Seams:
    """Counts calls to the broker methods of the adapter and the dedup store, and calls
    ``on_drained`` right after the ack that brings the acked deliveries to ``messages``."""

    def __init__(self, messages: int, on_drained: Callable[[], None]) -> None:
        self.messages = messages
        self.counting = False
        self.calls: Counter[str] = Counter()
        self.acked = 0
        self.received = 0
        self._on_drained = on_drained

    def wrap(self, owner: object, names: Iterable[str], label: str) -> None:
        """Replace ``owner``'s methods ``names`` (those its class has) with counting ones."""
        for name in names:
            if callable(getattr(type(owner), name, None)):
                setattr(owner, name, self._counting(f"{label}.{name}", name,
                                                    getattr(owner, name)))

    def _counting(
        self, label: str, name: str, method: Callable[..., Any]
    ) -> Callable[..., Any]:
        refused_of = ACKS.get(name)

        @functools.wraps(method)  # the name tasks made of the call are known by
        async def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.calls[label] += 1
            result = await method(*args, **kwargs)
            if name == "receive":
                self.received += len(result)
            elif refused_of is not None:
                deliveries = args[0] if args else kwargs["deliveries"]
                self._acked(len(deliveries) - len(refused_of(result)))
            return result

        return counted

    def _acked(self, count: int) -> None:
        before, self.acked = self.acked, self.acked + count
        if before < self.messages <= self.acked:
            self._on_drained()

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class RedisRoundTrips:
    """Counts what a ``redis.asyncio.Redis`` client sends: one round trip per command, one per
    pipeline (instance attributes wrap ``execute_command`` and ``pipeline``)."""

    def __init__(self) -> None:
        self.counting = False
        self.sent: Counter[str] = Counter()

    def install(self, client: Any) -> None:
        send = client.execute_command
        make_pipeline = client.pipeline

        async def execute_command(*args: Any, **options: Any) -> Any:
            if self.counting:
                self.sent[str(args[0]).upper()] += 1
            return await send(*args, **options)

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make_pipeline(*args, **kwargs)
            run = pipe.execute

            async def execute(raise_on_error: bool = True) -> Any:
                if self.counting:
                    self.sent["pipeline"] += 1
                return await run(raise_on_error)

            pipe.execute = execute
            return pipe

        client.execute_command = execute_command
        client.pipeline = pipeline

    @property
    def total(self) -> int:
        return sum(self.sent.values())


# The librdkafka consumer's methods counted: everything the poll thread asks of its client but
# ``poll`` and ``consume``, whose number follows fetch timing (a poll returns at its timeout
# or its first record), not the work asked.
KAFKA_CLIENT_METHODS = (
    "pause", "resume", "seek", "commit", "committed", "assign", "incremental_assign",
    "unassign", "incremental_unassign",
)


class KafkaClientCalls:
    """Counts the Kafka adapter's consumers' calls of ``KAFKA_CLIENT_METHODS`` on their
    ``confluent_kafka.Consumer``, for as long as installed: :meth:`install` replaces the class
    the adapter's poll thread makes (``_kafka_consumer.Consumer``) by a subclass that counts;
    a commit with ``asynchronous=False`` counts as ``commit (sync)``. The calls happen on the
    poll thread, so they are counted there (a Counter only that thread writes)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._module: Any = None
        self._original: Any = None

    def install(self) -> None:
        from reliable_sub.adapters import _kafka_consumer

        module: Any = _kafka_consumer
        original = module.Consumer
        calls = self.calls

        def counting(name: str) -> Callable[..., Any]:
            method = getattr(original, name)

            def counted(client: Any, *args: Any, **kwargs: Any) -> Any:
                label = name
                if name == "commit" and kwargs.get("asynchronous", True) is False:
                    label = "commit (sync)"
                calls[label] += 1
                return method(client, *args, **kwargs)

            counted.__name__ = counted.__qualname__ = name
            return counted

        counting_class = type("CountingConsumer", (original,),
                              {name: counting(name) for name in KAFKA_CLIENT_METHODS})
        self._module, self._original = module, original
        module.Consumer = counting_class

    def uninstall(self) -> None:
        if self._module is not None:
            self._module.Consumer = self._original
        self._module = self._original = None

    def total(self, *names: str) -> int:
        return sum(count for name, count in self.calls.items()
                   if name.split(" ")[0] in names)
