"""The Kafka adapter's options checked: names Kafka takes, seconds, counts, and the arguments of
``KafkaAdapter(...)`` and ``ensure_subscription``, each refused with a ConfigurationError naming
the field and what is allowed."""

from __future__ import annotations

import math
import re
from typing import Any

from reliable_sub.adapters._kafka_records import KEY, NONE, ORDERINGS
from reliable_sub.errors import ConfigurationError

# Kafka's legal topic names (and the names this adapter gives groups).
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
REBALANCES = ("cooperative", "eager")
STARTS = ("latest", "earliest")


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise ConfigurationError(
            f"Kafka {kind} name {name!r} must be 1-249 letters, digits, '.', '_' or '-' (and "
            "not '.' or '..')")
    return name


def seconds(where: str, value: object, minimum: float = 0.0) -> float:
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or value <= minimum):
        raise ConfigurationError(f"{where} must be seconds > {minimum:g}, got {value!r}")
    return float(value)


def check_adapter_options(bootstrap: object, rebalance: object, partitions: object,
                          replication_factor: object, buffer: object,
                          transactional_id: object) -> None:
    """Refuse ``KafkaAdapter`` arguments of the wrong kind (its seconds are checked apart)."""
    if not isinstance(bootstrap, str) or not bootstrap.strip():
        raise ConfigurationError(
            f"KafkaAdapter needs bootstrap servers as 'host:port[,host:port]', got "
            f"{bootstrap!r}")
    if rebalance not in REBALANCES:
        raise ConfigurationError(f"KafkaAdapter.rebalance must be one of {REBALANCES}, got "
                                 f"{rebalance!r}")
    for name, count in (("partitions", partitions), ("replication_factor", replication_factor)):
        if count is not None and (not isinstance(count, int) or count < 1):
            raise ConfigurationError(f"KafkaAdapter.{name} must be an int >= 1 or None, "
                                     f"got {count!r}")
    if not isinstance(buffer, int) or isinstance(buffer, bool) or buffer < 1:
        raise ConfigurationError(f"KafkaAdapter.buffer must be an int >= 1, got {buffer!r}")
    if transactional_id is not None and (not isinstance(transactional_id, str)
                                         or not transactional_id.strip()):
        raise ConfigurationError(
            "KafkaAdapter.transactional_id must be a non-empty str (one per process, stable "
            f"across its restarts) or None, got {transactional_id!r}")


def subscription_options(topic: str, subscription: str, ack_deadline: object,
                         ordering: object, start: object, options: dict[str, Any]
                         ) -> tuple[float, str]:
    """``ensure_subscription``'s arguments checked: the ack deadline and the ordering mode."""
    options.pop("retain_acked_messages", None)
    if options:
        raise ConfigurationError(
            f"KafkaAdapter.ensure_subscription got unknown options {sorted(options)}; "
            "allowed: ack_deadline, ordering, partitions, replication_factor, start, "
            "topic_config, retain_acked_messages")
    check_name("topic", topic)
    check_name("subscription", subscription)
    deadline = seconds("ensure_subscription: ack_deadline", ack_deadline)
    mode = KEY if ordering is True else NONE if ordering is False else ordering
    if mode not in ORDERINGS:
        raise ConfigurationError(f"ensure_subscription: ordering must be one of "
                                 f"{ORDERINGS} or a bool, got {ordering!r}")
    if start not in STARTS:
        raise ConfigurationError(f"ensure_subscription: start must be one of {STARTS}, "
                                 f"got {start!r}")
    assert isinstance(mode, str)
    return deadline, mode


__all__ = ["REBALANCES", "STARTS", "check_adapter_options", "check_name", "seconds",
           "subscription_options"]
