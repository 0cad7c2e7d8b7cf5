"""The adapter contract, re-exported from :mod:`reliable_sub.ports` where the core defines it."""

from reliable_sub.ports import (
    AcksWithCompletions,
    Adapter,
    Admin,
    BatchPublisher,
    Capabilities,
    Consumer,
    Outgoing,
    Publisher,
    checked_message,
)

__all__ = [
    "AcksWithCompletions",
    "Adapter",
    "Admin",
    "BatchPublisher",
    "Capabilities",
    "Consumer",
    "Outgoing",
    "Publisher",
    "checked_message",
]
