"""After a failure: redeliver after a backoff, or, at the last allowed attempt, dead-letter."""

from __future__ import annotations

import logging
import random
from typing import Any

from .._text import describe_error, error_type, safe_str
from ..message import Message
from ..policy import DeadLetterPolicy, RetryPolicy
from ..ports import LAYOUT_ATTRIBUTES, Publisher, PublishesRouted
from . import CallNext, Context, Decision, Verdict

logger = logging.getLogger("reliable_sub.subscriber")

# Pub/Sub attribute values are limited to 1024 bytes; the error message is cut to this many
# bytes of UTF-8 to fit.
ERROR_MESSAGE_LIMIT = 1000
# Attribute names the dead-letter copy sets; a publisher's attributes of the same names (behind
# any number of PUBLISHER_ATTRIBUTE_PREFIX) are kept with one prefix more.
DEAD_LETTER_ATTRIBUTES = (
    "original-message-id",
    "original-subscription",
    "delivery-attempts",
    "handler-failures",
    "error-type",
    "error-message",
    "dead-letter-reason",
)
# Why a message was dead-lettered (the ``dead-letter-reason`` attribute).
ATTEMPTS_USED_UP = "max-delivery-attempts"
REJECTED = "rejected"  # Reject, or a RetryPolicy.non_retryable exception
UNREADABLE = "unreadable"  # a broker entry that cannot be read as a message
RUNNING_TOO_LONG = "running-too-long"  # still running on a peer, period after period
PUBLISHER_ATTRIBUTE_PREFIX = "publisher-"

_FAILED = Verdict.FAILED  # read for every message: see reliable_sub/_runtime/members.py


class DeadLetterOrBackoff:
    """Turns a failed attempt into a decision: the failure is counted; below
    ``max_delivery_attempts`` failures the message is redelivered after the RetryPolicy's
    backoff, at it a copy is published to the dead-letter topic (and the original acked).
    Without a DeadLetterPolicy failures are redelivered forever. A permanent failure
    (:meth:`RetryPolicy.is_permanent`) is dead-lettered at its first attempt; without a policy
    it is logged at ERROR and redelivered after ``max_backoff``.

    The first failure of a message is logged at WARNING with its traceback, later ones without;
    a dead letter at ERROR. A dead-letter publish that fails is logged and the message
    redelivered, so nothing is lost.
    """

    def __init__(
        self,
        retry: RetryPolicy,
        dead_letter: DeadLetterPolicy | None,
        publisher: Publisher,
        rng: random.Random,
    ) -> None:
        self._retry = retry
        self._policy = dead_letter
        self._publisher = publisher
        self._rng = rng

    async def __call__(self, context: Context, call_next: CallNext) -> Decision:
        decision = await call_next(context)
        if decision.verdict is not _FAILED or decision.error is None:
            return decision
        return await self.after_failure(context.message, context.failures, decision.error)

    async def after_failure(
        self, message: Message, failures_before: int, error: BaseException
    ) -> Decision:
        """The decision after ``message`` failed with ``error``."""
        failures = failures_before + 1
        policy = self._policy
        if self._retry.is_permanent(error):
            return await self._rejected(message, failures, error)
        if policy is not None and failures >= policy.max_delivery_attempts:
            return await self.dead_letter(message, failures, error)
        delay = self._retry.backoff(failures, self._rng)
        logger.warning(
            "message %s of %r failed (attempt %d: %s); redelivering in %.1fs",
            message.id, message.subscription, failures, describe_error(error, 500), delay,
            exc_info=error if failures == 1 else None,
            extra=log_fields(message, failures, "retried"),
        )
        return Decision(Verdict.REDELIVER, error=error, delay=delay, failures=failures)

    async def _rejected(
        self, message: Message, failures: int, error: BaseException
    ) -> Decision:
        if self._policy is not None:
            return await self.dead_letter(message, failures, error, REJECTED)
        delay = self._retry.max_backoff
        logger.error(
            "message %s of %r was rejected (%s) and there is no dead-letter policy to take it; "
            "redelivering in %.1fs", message.id, message.subscription,
            describe_error(error, 500), delay, exc_info=error,
            extra=log_fields(message, failures, "retried"),
        )
        return Decision(Verdict.REDELIVER, error=error, delay=delay, failures=failures)

    async def dead_letter(
        self, message: Message, failures: int, error: BaseException,
        reason: str = ATTEMPTS_USED_UP,
    ) -> Decision:
        """Publish ``message`` to the dead-letter topic; redeliver it if that fails."""
        policy = self._policy
        assert policy is not None
        attributes = dead_letter_attributes(message, failures, error, reason)
        try:
            if isinstance(self._publisher, PublishesRouted):  # no subscription: not dropped
                await self._publisher.publish_routed(policy.topic, message.data, attributes)
            else:
                await self._publisher.publish(policy.topic, message.data, attributes)
        except Exception:
            logger.error(
                "publishing message %s to dead-letter topic %r failed; it stays on %r and is "
                "retried", message.id, policy.topic, message.subscription, exc_info=True,
                extra=log_fields(message, failures, "retried"),
            )
            delay = self._retry.backoff(failures, self._rng)
            return Decision(Verdict.REDELIVER, error=error, delay=delay, failures=failures)
        logger.error(
            "message %s of %r dead-lettered to %r (%s) after %d failed attempt%s (%s)",
            message.id, message.subscription, policy.topic, reason, failures,
            "" if failures == 1 else "s",
            describe_error(error, 500), exc_info=error if failures <= 1 else None,
            extra=log_fields(message, failures, "dead_lettered"),
        )
        return Decision(Verdict.DEAD_LETTERED, error=error, failures=failures)


def dead_letter_attributes(
    message: Message, failures: int, error: BaseException, reason: str = ATTEMPTS_USED_UP,
) -> dict[str, str]:
    """The attributes of a dead-letter copy: the publisher's (each named like ours, behind any
    number of ``PUBLISHER_ATTRIBUTE_PREFIX``, gets one prefix more: ``error-type`` becomes
    ``publisher-error-type``, ``publisher-error-type`` becomes
    ``publisher-publisher-error-type``, so nothing collides and the renaming can be undone),
    then where it came from and why it failed. The layout attributes an adapter set on a message
    from another producer (``LAYOUT_ATTRIBUTES``: ``redis-fields`` ...) are renamed the same
    way: the copy is written in the adapter's own layout, and a replay restores them."""
    attributes = {
        (PUBLISHER_ATTRIBUTE_PREFIX + name if named_like_ours(name) else name): value
        for name, value in message.attributes.items()
    }
    attributes.update({
        "original-message-id": message.id,
        "original-subscription": message.subscription,
        "delivery-attempts": str(message.delivery_attempt),
        "handler-failures": str(failures),
        "error-type": error_type(error),
        "error-message": _cut(safe_str(error), ERROR_MESSAGE_LIMIT),
        "dead-letter-reason": reason,
    })
    return attributes


def named_like_ours(name: str) -> bool:
    """``name`` is one of ours (or a layout attribute), behind any number of publisher
    prefixes."""
    while name.startswith(PUBLISHER_ATTRIBUTE_PREFIX):
        name = name[len(PUBLISHER_ATTRIBUTE_PREFIX):]
    return name in DEAD_LETTER_ATTRIBUTES or name in LAYOUT_ATTRIBUTES


def _cut(text: str, limit: int) -> str:
    """``text`` as at most ``limit`` bytes of UTF-8, whole characters only; characters UTF-8
    cannot carry (lone surrogates) are written as backslash escapes."""
    encoded = text.encode("utf-8", "backslashreplace")
    return encoded[:limit].decode("utf-8", "ignore")


def log_fields(message: Message, failures: int, outcome: str) -> dict[str, Any]:
    """The ``extra=`` fields of a log record about ``message``."""
    return {
        "message_id": message.id,
        "subscription": message.subscription,
        "attempt": message.delivery_attempt,
        "failures": failures,
        "outcome": outcome,
    }


__all__ = [
    "ATTEMPTS_USED_UP",
    "DEAD_LETTER_ATTRIBUTES",
    "PUBLISHER_ATTRIBUTE_PREFIX",
    "REJECTED",
    "RUNNING_TOO_LONG",
    "UNREADABLE",
    "DeadLetterOrBackoff",
    "dead_letter_attributes",
    "log_fields",
    "named_like_ours",
]
