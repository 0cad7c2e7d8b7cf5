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
    """A call named a subscription the broker does not have; the message names it and the fix."""


class UnknownTopicError(AdapterError, LookupError):
    """A call named a topic the broker does not have; the message names it and the fix."""


class UnroutableError(AdapterError):
    """The broker took a message but no subscription of its topic would get it (a RabbitMQ
    exchange with no queue bound): a dead letter published so is redelivered instead."""


class UnknownSnapshotError(AdapterError, LookupError):
    """A snapshot name that the broker does not know."""


class SnapshotExistsError(AdapterError, ValueError):
    """A snapshot name that is already taken."""


class AccessDeniedError(AdapterError, PermissionError):
    """The broker refused a call for lack of permission; the message names the resource."""


class CredentialsRefusedError(AccessDeniedError):
    """The broker or store refused the credentials given, or the virtual host or database they
    name: a configuration to fix (the CLI exits with 2), not an outage."""


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


class StoredResultError(ReliableSubError, ValueError):
    """A dedup record's stored result is not valid JSON (written by something else)."""


class InvalidMessageError(ReliableSubError, ValueError):
    """``publish`` refused a message the broker cannot carry as given (Pub/Sub: neither data
    nor attributes, an attribute beyond its limits, over its size limit); nothing was sent, and
    no other message is affected. The message names what is wrong and the limit."""


class MalformedMessageError(ReliableSubError, ValueError):
    """A broker entry could not be read as a message; it is dead-lettered without a handler."""


class Reject(ReliableSubError):
    """Raise it from a handler to dead-letter this delivery at once: one attempt, no in-process
    retry, no backoff, whatever the RetryPolicy allows (for a message that can never succeed:
    a body that fails validation, an account that does not exist). ``reason`` becomes the dead
    letter's ``error-message``; its ``dead-letter-reason`` is ``rejected``.

    Without a DeadLetterPolicy the message is logged at ERROR and redelivered after
    ``RetryPolicy.max_backoff``: nothing is dropped. ``RetryPolicy.non_retryable`` makes other
    exception types behave the same.
    """

    def __init__(self, reason: str = "rejected by the handler") -> None:
        super().__init__(reason)
        self.reason = reason


class BodyValidationError(Reject):
    """A message body did not decode as JSON or did not validate as the handler's body type
    (see typed bodies in :meth:`Subscriber.handler`): dead-lettered at its first attempt."""


class HandlerTimeoutError(ReliableSubError, TimeoutError):
    """A handler was still running at ``LeasePolicy.max_lease_duration``: a failed attempt."""


class ClaimLostError(ReliableSubError):
    """A transactional handler's dedup claim was taken over by a peer before its transaction
    committed: the transaction (the handler's writes included) was rolled back, and the message
    is deferred to the peer, which holds the key now."""


class IdempotencyInProgressError(ReliableSubError):
    """An ``@idempotent`` call found its key held by a call still running (or it waited for
    that call longer than ``wait_timeout``); retry later with the same key.

    Attributes:
        key: the idempotency key.
        expires_in: seconds left on the running call's claim when last seen (it is renewed
            while that call runs; it lapses this long after a crash).
    """

    def __init__(self, message: str, *, key: str = "", expires_in: float = 0.0) -> None:
        super().__init__(message)
        self.key = key
        self.expires_in = expires_in


class IdempotencyKeyReuseError(ReliableSubError, ValueError):
    """An ``@idempotent`` call reused an idempotency key with other arguments than the call
    that completed it: a client bug (one key per distinct request), never replayed.

    Attributes:
        key: the idempotency key.
    """

    def __init__(self, message: str, *, key: str = "") -> None:
        super().__init__(message)
        self.key = key


__all__ = [
    "AccessDeniedError",
    "AdapterError",
    "BodyValidationError",
    "ClaimLostError",
    "ConfigurationError",
    "CredentialsRefusedError",
    "HandlerTimeoutError",
    "IdempotencyInProgressError",
    "IdempotencyKeyReuseError",
    "InvalidMessageError",
    "MalformedMessageError",
    "MissingExtraError",
    "Reject",
    "ReliableSubError",
    "ResultNotSerializableError",
    "SnapshotExistsError",
    "StoredResultError",
    "UnknownSnapshotError",
    "UnknownSubscriptionError",
    "UnknownTopicError",
    "UnroutableError",
]
