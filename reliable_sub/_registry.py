"""The adapters installed, by name, from the entry-point group ``reliable_sub.adapters`` (the
shipped ones are declared in pyproject.toml; a third party's package declares its own the same
way, as SQLAlchemy finds dialects). Nothing here imports an adapter: hints name them from the
entry points alone."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

GROUP = "reliable_sub.adapters"
# The shipped adapters' names, in the order hints list them; others follow by name.
SHIPPED = ("memory", "redis", "pubsub", "nats", "rabbitmq", "kafka", "sqs")


def installed() -> list[EntryPoint]:
    """Every adapter's entry point: the shipped ones first, in :data:`SHIPPED`'s order."""
    found = {point.name: point for point in entry_points(group=GROUP)}
    order = [name for name in SHIPPED if name in found]
    order += sorted(name for name in found if name not in SHIPPED)
    return [found[name] for name in order]


def adapter_names() -> list[str]:
    """The installed adapters' class names (``KafkaAdapter``), in :func:`installed`'s order."""
    return [point.value.rpartition(":")[2] for point in installed()]


__all__ = ["GROUP", "SHIPPED", "adapter_names", "installed"]
