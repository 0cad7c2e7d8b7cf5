"""What the stages of one run share: the configuration, the routes and their lanes, the run state.

Plain records, no behaviour of a stage: the receiver, the dispatcher, the decisions and the
shutdown each take what they need of these (and callbacks into one another), never the run that
composes them (:mod:`reliable_sub._runtime.pipeline`).
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from ..batches import BatchSpec
from ..clock import Clock
from ..dedup import Claimed, DedupStore
from ..message import Delivery, Message
from ..middleware import CallNext, Middleware
from ..middleware.dead_letter import DeadLetterOrBackoff
from ..outcome import DeliveryEvent, Outcome
from ..policy import DeadLetterPolicy, FlowControl, LeasePolicy, RetryPolicy
from ..ports import Adapter
from ..telemetry.consumer import SubscriberTelemetry
from ..telemetry.instruments import RouteTelemetry
from .flow import FlowGate
from .inflight import InFlight
from .lease import LeaseManager


@dataclass(frozen=True)
class Config:
    """What a Subscriber was configured with; every stage of a run reads it."""

    adapter: Adapter
    dedup: DedupStore | None
    lease: LeasePolicy
    retry: RetryPolicy
    dead_letter: DeadLetterPolicy | None
    flow_control: FlowControl
    dedup_ttl: float
    clock: Clock
    sync_workers: int
    rng: random.Random
    receive_batch: int
    receive_timeout: float
    loop_lag_warning: float | None
    dedup_purge_interval: float | None
    on_outcome: Callable[[Message, Outcome], None] | None
    on_event: Callable[[DeliveryEvent], None] | None
    middleware: tuple[Middleware, ...]
    telemetry: SubscriberTelemetry
    unhealthy_after: float


@dataclass(eq=False)
class Route:
    """A subscription and its handler, as registered."""

    subscription: str
    handler: Callable[[Message], Any]
    is_async: bool
    namespace: str | None
    name: str
    # the Subscriber's policies, or the handler's own where it gave them
    retry: RetryPolicy
    dead_letter: DeadLetterPolicy | None
    lease: LeasePolicy
    # the most messages of this handler in flight at once (None: only the Subscriber's bound)
    max_concurrency: int | None = None
    middleware: tuple[Middleware, ...] = ()
    # handler(message, connection): its writes and its dedup record commit in one transaction
    transactional: bool = False
    # a batch handler's limits and argument types (None: one message per call)
    batch: BatchSpec | None = None


@dataclass(eq=False)
class Lane:
    """One route during one run."""

    route: Route
    namespace: str
    lease: LeaseManager
    ordered: bool
    # the middleware chain, or None: no middleware of the user's and no in-process retries,
    # so the handler is called directly and failures go straight to DeadLetterOrBackoff
    call: CallNext | None
    # the handler as called with the message alone (a transactional one wrapped in its
    # transaction)
    handler: Callable[[Message], Any]
    # the route's retry and dead-letter policies at work: a failure becomes a decision
    failure: DeadLetterOrBackoff
    # its own bound on messages in flight (the route's max_concurrency), or None
    flow: FlowGate | None = None
    receive_call: asyncio.Task[list[Delivery]] | None = None
    # deliveries were given back at max_lease_duration for want of a worker thread: receive
    # again only once one is free, so peers get them rather than this Subscriber again
    starved: bool = False
    # ordering key -> deliveries waiting for the running one of that key
    keys: dict[str, deque[Item]] = field(default_factory=dict)
    # its span name and attributes, while telemetry is on
    telemetry: RouteTelemetry | None = None
    # the receive call's name in the log and in health reports
    receive_name: str = ""
    # a batch handler's: gathers its deliveries into batches (None: one task per delivery)
    collector: Collector | None = None


class Collector(Protocol):
    """Gathers a batch handler's deliveries (:class:`reliable_sub._runtime.batches.Batches`)."""

    def add(self, item: Item) -> None: ...

    def add_many(self, items: list[Item]) -> None: ...


def close_gates(flow: FlowGate, lanes: Iterable[Lane]) -> None:
    """Close the run's flow gate and every lane's own (max_concurrency): each receive loop
    waiting for a slot wakes and sees the run stopping."""
    flow.close()
    for lane in lanes:
        if lane.flow is not None:
            lane.flow.close()


# A delivery in flight, as the stages that read its lane see it.
Item: TypeAlias = "InFlight[Lane]"


class SettleCall(Protocol):
    """:meth:`reliable_sub._runtime.decisions.Decisions.settle`, as the other stages call it."""

    def __call__(self, item: Item, outcome: Outcome, *, ack: bool, delay: float = 0.0,
                 completion: Any = None, release: Claimed | None = None) -> None: ...


class RunState:
    """The switches a stop flips, and what is in flight, read by every stage of one run."""

    __slots__ = ("accepting", "items", "receiving", "side_tasks")

    def __init__(self) -> None:
        self.receiving = False
        self.accepting = False  # False once a stop began: no handler starts after that
        self.items: set[Item] = set()
        # work started beside a delivery's task (dead-letter publishes, late releases)
        self.side_tasks: set[asyncio.Task[None]] = set()

    def track(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run ``coroutine`` as a side task, started at once; a stop waits for it."""
        task = new_task(coroutine)
        self.side_tasks.add(task)
        task.add_done_callback(self.side_tasks.discard)


# Whether new_task runs a task's first step at once, before it returns.
EAGER_TASKS = sys.version_info >= (3, 12)

# Both make the Task directly, not through the loop's task factory: one per delivery, and
# create_task's own checks and naming cost a third of what the task does.
if sys.version_info >= (3, 12):
    def new_task(coroutine: Coroutine[Any, Any, None], eager: bool = True) -> asyncio.Task[None]:
        """A task that runs its first step at once (eager start, unless not ``eager``), as its
        own task."""
        return asyncio.Task(coroutine, loop=asyncio.get_running_loop(), eager_start=eager)
else:
    def new_task(coroutine: Coroutine[Any, Any, None], eager: bool = True) -> asyncio.Task[None]:
        """A task, scheduled to start with the loop's next turn (no eager start before 3.12)."""
        return asyncio.Task(coroutine, loop=asyncio.get_running_loop())
