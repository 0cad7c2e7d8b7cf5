"""Wrong objects where an adapter, a store, a policy or a handler belongs fail where they were
passed, with a ConfigurationError naming the argument, what was given and the fix (#24): never
at ``start()`` with a bare AttributeError, never by starting and backing off for ever."""

from __future__ import annotations

import functools
import random
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from reliable_sub import (
    ConfigurationError,
    DeadLetterPolicy,
    FlowControl,
    LeasePolicy,
    MemoryDedupStore,
    Message,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dead_letters import DeadLetterQueue
from reliable_sub.outbox import Outbox, OutboxRelay

BAD_SUBSCRIBER_ARGUMENTS: list[tuple[tuple[Any, ...], dict[str, Any], list[str]]] = [
    (("redis://127.0.0.1:6379",), {}, ["Subscriber(adapter)", "'redis://127.0.0.1:6379'",
                                       "RedisStreamsAdapter(url)"]),
    (("nats://127.0.0.1:4222",), {}, ["NatsJetStreamAdapter(url)"]),
    ((None,), {}, ["Subscriber(adapter)", "None", "MemoryAdapter()"]),
    ((MemoryAdapter,), {}, ["Subscriber(adapter)", "the class MemoryAdapter",
                            "MemoryAdapter(...)"]),
    ((), {"dedup": "redis://127.0.0.1:6379"}, ["Subscriber(dedup=)", "RedisDedupStore(url)"]),
    ((), {"dedup": "postgresql://localhost/test"}, ["SqlDedupStore(url)"]),
    ((), {"dedup": object()}, ["Subscriber(dedup=)", "MemoryDedupStore()"]),
    ((), {"dead_letter": "orders-dlq"}, ["Subscriber(dead_letter=)",
                                         "DeadLetterPolicy('orders-dlq'"]),
    ((), {"retry": RetryPolicy}, ["Subscriber(retry=)", "RetryPolicy(...)"]),
    ((), {"retry": {"min_backoff": 1}}, ["Subscriber(retry=)"]),
    ((), {"lease": 30}, ["Subscriber(lease=)", "LeasePolicy(...)"]),
    ((), {"flow_control": 100}, ["Subscriber(flow_control=)", "FlowControl("]),
    ((), {"clock": 0.0}, ["Subscriber(clock=)", "ManualClock()"]),
    ((), {"rng": 42}, ["Subscriber(rng=)", "random.Random(seed)"]),
    ((), {"on_outcome": "print"}, ["Subscriber(on_outcome=)", "callable"]),
    ((), {"on_event": 1}, ["Subscriber(on_event=)"]),
    ((), {"tracer_provider": "otel"}, ["Subscriber(tracer_provider=)", "TracerProvider"]),
    ((), {"meter_provider": object()}, ["Subscriber(meter_provider=)", "MeterProvider"]),
    ((), {"telemetry": "hashed"}, ["Subscriber(telemetry=)", "TelemetryPolicy"]),
]


@pytest.mark.parametrize(("args", "options", "says"), BAD_SUBSCRIBER_ARGUMENTS)
def test_a_wrong_object_is_refused_at_construction_naming_the_argument_and_the_fix(
    args: tuple[Any, ...], options: dict[str, Any], says: list[str]
) -> None:
    adapter = args[0] if args else MemoryAdapter()
    with pytest.raises(ConfigurationError) as raised:
        Subscriber(adapter, **options)
    for part in says:
        assert part in str(raised.value)


def test_right_objects_are_accepted() -> None:
    Subscriber(MemoryAdapter(), dedup=MemoryDedupStore(), lease=LeasePolicy(),
               retry=RetryPolicy(), dead_letter=DeadLetterPolicy("dlq"),
               flow_control=FlowControl(), rng=random.Random(1), on_outcome=print,
               on_event=print)


@pytest.mark.parametrize(
    ("policy", "field", "value"),
    [(RetryPolicy, "min_backoff", "1"), (RetryPolicy, "max_backoff", None),
     (RetryPolicy, "in_process_wait", [0.1]), (LeasePolicy, "min_extension", "10"),
     (LeasePolicy, "max_lease_duration", True), (LeasePolicy, "percentile", "99")],
)
def test_a_policy_field_of_the_wrong_type_is_a_configuration_error(
    policy: Callable[..., Any], field: str, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match=rf"{policy.__name__}\.{field} must be a number"):
        policy(**{field: value})


def test_other_constructors_check_their_objects(tmp_path: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"DeadLetterQueue\(adapter\)"):
        DeadLetterQueue("redis://127.0.0.1:6379", "dlq")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"DeadLetterQueue\(subscription\)"):
        DeadLetterQueue(MemoryAdapter(), None)  # type: ignore[arg-type]
    outbox = Outbox(f"sqlite:///{tmp_path}/outbox.db")
    with pytest.raises(ConfigurationError, match=r"OutboxRelay\(clock=\)"):
        OutboxRelay(outbox, MemoryAdapter(), clock=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"OutboxRelay\(rng=\)"):
        OutboxRelay(outbox, MemoryAdapter(), rng="seed")  # type: ignore[arg-type]


# -- handlers --------------------------------------------------------------------------------


def _sync_generator(message: Message) -> Iterator[None]:
    yield None


async def _async_generator(message: Message) -> AsyncIterator[None]:
    yield None


def _no_parameter() -> None:
    return None


def _two_required(message: Message, other: Any) -> None:
    return None


def _wrapped(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    ("handler", "says"),
    [(_async_generator, "is an async generator function"),
     (_sync_generator, "is a generator function"),
     (_wrapped(_async_generator), "is an async generator function"),
     (_no_parameter, "_no_parameter() cannot be called as handler(message)"),
     (_two_required, "cannot be called as handler(message)"),
     (lambda: None, "cannot be called as handler(message)")],
)
def test_a_handler_that_cannot_run_a_message_is_refused_at_registration(
    handler: Callable[..., Any], says: str
) -> None:
    sub = Subscriber(MemoryAdapter())
    with pytest.raises(ConfigurationError, match="handler of 'billing'") as raised:
        sub.handler("billing")(handler)
    assert says in str(raised.value)


@pytest.mark.parametrize(
    "handler",
    [lambda message: None, lambda message, extra=1: None, lambda *args: None,
     functools.partial(_two_required, other=1), _wrapped(lambda message: None), print],
)
def test_handlers_that_can_take_a_message_are_accepted(handler: Callable[..., Any]) -> None:
    Subscriber(MemoryAdapter()).handler("billing")(handler)


def test_a_transactional_handler_must_take_the_connection_too() -> None:
    from reliable_sub.dedup import SqlDedupStore

    sub = Subscriber(MemoryAdapter(), dedup=SqlDedupStore("sqlite:///:memory:"))
    with pytest.raises(ConfigurationError, match=r"handler\(message, connection\)"):
        sub.handler("billing", transactional=True)(lambda message: None)
    sub.handler("billing", transactional=True)(lambda message, connection: None)
