"""Constructor arguments checked against what they must be, at construction.

A wrong object passed where an adapter, a store, a policy or a clock belongs must fail where it
was passed, with a :class:`ConfigurationError` naming the argument, what was given and the fix
-- not at ``start()`` with a bare ``AttributeError``, and never by starting and backing every
message off for ever.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from ._registry import adapter_names
from ._text import safe_repr
from .errors import ConfigurationError
from .middleware import Middleware
from .policy import (
    DeadLetterPolicy,
    FlowControl,
    LeasePolicy,
    RetryPolicy,
    TelemetryPolicy,
    check_count,
)

if TYPE_CHECKING:
    from ._runtime.lanes import Config

# What the Subscriber calls on an adapter and on a dedup store.
ADAPTER_METHODS = (
    "capabilities", "receive", "ack", "nack", "extend", "subscription_ack_deadline",
    "subscription_topic", "dedup_namespace", "topic_exists", "publish", "close",
)
DEDUP_STORE_METHODS = ("claim_many", "renew", "complete_many", "release_many", "close")
CLOCK_METHODS = ("now", "wall", "sleep")

# A URL given where an object belongs: what to build from it.
_ADAPTER_FOR_SCHEME = {
    "redis": "RedisStreamsAdapter(url)", "rediss": "RedisStreamsAdapter(url)",
    "redis+cluster": "RedisStreamsAdapter(url)", "unix": "RedisStreamsAdapter(url)",
    "nats": "NatsJetStreamAdapter(url)", "tls": "NatsJetStreamAdapter(url)",
}
_STORE_FOR_SCHEME = {
    "redis": "RedisDedupStore(url)", "rediss": "RedisDedupStore(url)",
    "redis+cluster": "RedisDedupStore(url)", "unix": "RedisDedupStore(url)",
    "postgresql": "SqlDedupStore(url)", "postgres": "SqlDedupStore(url)",
    "sqlite": "SqlDedupStore(url)", "mysql": "SqlDedupStore(url)",
    "mariadb": "SqlDedupStore(url)",
}


def _described(value: Any) -> str:
    return f"{safe_repr(value, 80)} (a {type(value).__name__})"


def _scheme(value: object) -> str:
    if isinstance(value, str) and "://" in value:
        return value.split("://", 1)[0].split("+psycopg")[0].split("+asyncpg")[0].lower()
    return ""


def check_methods(
    where: str, value: object, methods: Iterable[str], what: str, fix: str
) -> None:
    """Refuse ``value`` unless it has every one of ``methods``."""
    if isinstance(value, type):
        raise ConfigurationError(
            f"{where} must be {what}, got the class {value.__qualname__} (a type); pass an "
            f"instance: {value.__qualname__}(...)"
        )
    wanted = tuple(methods)
    missing = [name for name in wanted if not hasattr(value, name)]
    if missing:
        lacks = "" if len(missing) == len(wanted) else f", which has no {', '.join(missing)}"
        raise ConfigurationError(f"{where} must be {what}, got {_described(value)}{lacks}; {fix}")


def check_adapter(where: str, value: object) -> None:
    """Refuse anything but a broker adapter, naming the adapter a URL would need."""
    suggestion = _ADAPTER_FOR_SCHEME.get(_scheme(value))
    names = ", ".join(adapter_names()) or "MemoryAdapter"
    fix = (f"pass {suggestion} rather than the URL" if suggestion else
           f"pass an adapter instance, such as MemoryAdapter() (reliable_sub.adapters.memory); "
           f"the adapters installed: {names}")
    check_methods(where, value, ADAPTER_METHODS, "a broker adapter", fix)


def check_dedup_store(where: str, value: object) -> None:
    """Refuse anything but None or a dedup store, naming the store a URL would need."""
    if value is None:
        return
    suggestion = _STORE_FOR_SCHEME.get(_scheme(value))
    fix = (f"pass {suggestion} rather than the URL" if suggestion else
           "pass MemoryDedupStore(), RedisDedupStore(url) or SqlDedupStore(url), or None for "
           "no dedup")
    check_methods(where, value, DEDUP_STORE_METHODS, "a dedup store or None", fix)


def check_instance(where: str, value: object, kind: type, fix: str,
                   optional: bool = True) -> None:
    """Refuse ``value`` unless it is a ``kind`` (or None when ``optional``)."""
    if (value is None and optional) or isinstance(value, kind):
        return
    raise ConfigurationError(
        f"{where} must be a {kind.__name__}{' or None' if optional else ''}, got "
        f"{_described(value)}; {fix}"
    )


def check_callable(where: str, value: object, signature: str) -> None:
    """Refuse ``value`` unless it is None or callable."""
    if value is not None and not callable(value):
        raise ConfigurationError(
            f"{where} must be a callable {signature} or None, got {_described(value)}"
        )


def check_clock(where: str, value: object) -> None:
    if value is not None:
        check_methods(where, value, CLOCK_METHODS, "a Clock (now(), wall(), async sleep())",
                      "pass SystemClock() or ManualClock(), or None for the system clock")


def check_with(where: str, value: object, method: str, what: str, fix: str) -> None:
    """Refuse a non-None ``value`` without ``method`` (a provider, a random source)."""
    if value is not None:
        check_methods(where, value, (method,), what, fix)


def check_subscriber_arguments(
    adapter: object, dedup: object, lease: object, retry: object, dead_letter: object,
    flow_control: object, clock: object, rng: object, on_outcome: object, on_event: object,
    tracer_provider: object, meter_provider: object, telemetry: object,
) -> None:
    """Each argument of ``Subscriber(...)`` is what it must be, or a ConfigurationError naming
    it and the fix."""

    check_adapter("Subscriber(adapter)", adapter)
    check_dedup_store("Subscriber(dedup=)", dedup)
    check_instance("Subscriber(lease=)", lease, LeasePolicy, "pass LeasePolicy(...)")
    check_instance("Subscriber(retry=)", retry, RetryPolicy, "pass RetryPolicy(...)")
    topic = f"{dead_letter!r}" if isinstance(dead_letter, str) else "'orders-dlq'"
    check_instance("Subscriber(dead_letter=)", dead_letter, DeadLetterPolicy,
                   f"pass DeadLetterPolicy({topic}, max_delivery_attempts=5)")
    check_instance("Subscriber(flow_control=)", flow_control, FlowControl,
                   "pass FlowControl(max_messages=..., max_bytes=...)")
    check_instance("Subscriber(telemetry=)", telemetry, TelemetryPolicy,
                   "pass TelemetryPolicy(...)")
    check_clock("Subscriber(clock=)", clock)
    check_with("Subscriber(rng=)", rng, "uniform", "a random.Random",
               "pass random.Random(seed), or None")
    check_callable("Subscriber(on_outcome=)", on_outcome, "(message, outcome) -> None")
    check_callable("Subscriber(on_event=)", on_event, "(event) -> None")
    check_with("Subscriber(tracer_provider=)", tracer_provider, "get_tracer",
               "an OpenTelemetry TracerProvider", "pass the SDK's TracerProvider(), or None")
    check_with("Subscriber(meter_provider=)", meter_provider, "get_meter",
               "an OpenTelemetry MeterProvider", "pass the SDK's MeterProvider(), or None")


def check_max_concurrency(where: str, value: object) -> None:
    """Refuse a ``max_concurrency`` that is neither None nor an int of at least 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ConfigurationError(
            f"{where} max_concurrency must be an int >= 1 or None, got {_described(value)}"
        )


def handler_lease(where: str, timeout: object, lease: LeasePolicy) -> LeasePolicy:
    """The Subscriber's ``lease`` with the handler's ``timeout`` (its max_lease_duration)."""
    if timeout is None:
        return lease
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ConfigurationError(
            f"{where} timeout must be a number of seconds > 0 or None, got {_described(timeout)}"
        )
    try:
        return dataclasses.replace(lease, max_lease_duration=float(timeout))
    except ConfigurationError as error:
        raise ConfigurationError(f"{where} timeout: {error}") from None


def handler_policies(
    where: str, config: Config, *, retry: object, dead_letter: object, non_retryable: object,
    timeout: object, max_concurrency: object, in_process_retry: object = None,
) -> tuple[RetryPolicy, DeadLetterPolicy | None, LeasePolicy]:
    """A handler's retry, dead-letter and lease policies: its own where it gave them, else
    the Subscriber's (``config``), its ``non_retryable`` types added to the retry policy's, its
    ``in_process_retry`` as the retry policy's in_process_attempts and its ``timeout`` as the
    lease's max_lease_duration; all checked, the dedup window too."""
    own_retry, own_dead_letter = _retry_and_dead_letter(
        where, retry, dead_letter, non_retryable, (config.retry, config.dead_letter))
    if in_process_retry is not None:
        check_count(where, "in_process_retry", in_process_retry)
        own_retry = dataclasses.replace(own_retry,
                                        in_process_attempts=cast(int, in_process_retry))
    own_lease = handler_lease(where, timeout, config.lease)
    check_max_concurrency(where, max_concurrency)
    if config.dedup is not None and (retry, dead_letter, timeout) != (None, None, None):
        check_dedup_window(f"{where}: ", config.dedup_ttl, own_retry, own_dead_letter,
                           own_lease)
    return own_retry, own_dead_letter, own_lease


def _retry_and_dead_letter(
    where: str, retry: object, dead_letter: object, non_retryable: object,
    defaults: tuple[RetryPolicy, DeadLetterPolicy | None],
) -> tuple[RetryPolicy, DeadLetterPolicy | None]:
    check_instance(f"{where} retry", retry, RetryPolicy, "pass RetryPolicy(...)")
    check_instance(f"{where} dead_letter", dead_letter, DeadLetterPolicy,
                   "pass DeadLetterPolicy(topic)")
    own_retry = cast(RetryPolicy, retry) if retry is not None else defaults[0]
    if non_retryable:
        if not isinstance(non_retryable, tuple):
            raise ConfigurationError(
                f"{where} non_retryable must be a tuple of exception types, got "
                f"{_described(non_retryable)}"
            )
        own_retry = dataclasses.replace(
            own_retry, non_retryable=(*own_retry.non_retryable, *non_retryable))
    own_dead_letter = cast(DeadLetterPolicy, dead_letter) if dead_letter is not None else (
        defaults[1])
    return own_retry, own_dead_letter


def check_dedup_window(
    where: str, dedup_ttl: float, retry: RetryPolicy, dead_letter: DeadLetterPolicy | None,
    lease: LeasePolicy,
) -> None:
    """Every dedup mechanism has a window, and the window is the bug: refuse a dedup_ttl
    shorter than the longest span over which a message's copies can arrive. ``where`` starts
    the error (``"handler 'billing': "``; empty for the Subscriber's own policies)."""
    if dead_letter is None:
        return
    attempts = dead_letter.max_delivery_attempts
    backoffs = sum(retry.max_backoff_for(a) for a in range(1, attempts))
    span = backoffs + lease.max_lease_duration
    if dedup_ttl < span:
        raise ConfigurationError(
            f"{where}Subscriber.dedup_ttl={dedup_ttl:g}s is shorter than the longest "
            f"redelivery span {span:g}s (backoffs for {attempts} attempts, {backoffs:g}s, "
            f"plus max_lease_duration {lease.max_lease_duration:g}s): a duplicate could "
            f"arrive after its record expired; raise dedup_ttl to at least {span:g}"
        )


def check_route_names(subscription: object, namespace: object) -> None:
    """Refuse a handler's subscription or namespace that is not a non-empty str."""
    if callable(subscription):  # @sub.handler without its parentheses
        name = getattr(subscription, "__name__", "handler")
        raise ConfigurationError(
            f"@handler needs the subscription's name: write @sub.handler(\"<subscription>\") "
            f"above {name}, not @sub.handler")
    if not isinstance(subscription, str) or not subscription:
        raise ConfigurationError(
            f"handler: subscription must be a non-empty str, got {subscription!r}")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise ConfigurationError(
            f"handler: namespace must be a non-empty str or None, got {namespace!r}")


def checked_middleware(middleware: object, what: str) -> tuple[Middleware, ...]:
    """``middleware`` as a tuple, each one callable."""
    if not isinstance(middleware, list | tuple):
        raise ConfigurationError(f"{what} must be a list of middleware, got {middleware!r}")
    for item in middleware:
        if not callable(item):
            raise ConfigurationError(
                f"{what}: {item!r} is not a middleware (async (context, call_next) -> Decision)")
    return tuple(middleware)


__all__ = [
    "check_adapter",
    "check_callable",
    "check_clock",
    "check_dedup_store",
    "check_dedup_window",
    "check_instance",
    "check_max_concurrency",
    "check_methods",
    "check_route_names",
    "check_subscriber_arguments",
    "check_with",
    "checked_middleware",
    "handler_lease",
    "handler_policies",
]
