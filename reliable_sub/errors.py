"""The one exceptions module: every error reliable-sub raises derives from ReliableSubError."""

from __future__ import annotations


class ReliableSubError(Exception):
    """Base class of every error raised by reliable-sub."""


class ConfigurationError(ReliableSubError, ValueError):
    """A policy or constructor argument is outside its allowed range.

    Also a ``ValueError``, so callers that validate input generically still catch it.
    """


class AdapterError(ReliableSubError):
    """A broker call failed; the message it concerned is retried or redelivered, never dropped."""


class UnknownSubscriptionError(AdapterError, LookupError):
    """A call named a subscription (or topic) the broker does not have."""


class MissingExtraError(ReliableSubError, ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` to run."""

    def __init__(self, feature: str, extra: str, missing: str) -> None:
        super().__init__(
            f"{feature} needs the {missing!r} package, which is not installed; "
            f'run: pip install "reliable-sub[{extra}]"'
        )
        self.extra = extra


class ResultNotSerializableError(ReliableSubError, TypeError):
    """A handler returned a value that cannot be stored as JSON in the dedup store."""
