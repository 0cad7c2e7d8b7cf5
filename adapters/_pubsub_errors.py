"""The Pub/Sub adapter's errors: Google API errors raised as this library's named ones.

A ``NotFound`` or ``PermissionDenied`` becomes ``UnknownTopicError``, ``UnknownSubscriptionError``
or ``AccessDeniedError`` with the name and the fix; a snapshot's ``AlreadyExists`` and
``NotFound`` become ``SnapshotExistsError`` and ``UnknownSnapshotError``; an exactly-once
subscription's partial failure is read for the ack ids that failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from google.api_core import exceptions as google_errors

from reliable_sub.errors import (
    AccessDeniedError,
    SnapshotExistsError,
    UnknownSnapshotError,
    UnknownSubscriptionError,
    UnknownTopicError,
)

# ErrorInfo reason of a partly failed acknowledge/modifyAckDeadline on exactly-once delivery;
# its metadata maps each failed ack id to PERMANENT_FAILURE_* or TRANSIENT_FAILURE_*.
EXACTLY_ONCE_FAILURE = "EXACTLY_ONCE_ACKID_FAILURE"


def named(
    error: google_errors.GoogleAPICallError, *, topic: str | None = None,
    subscription: str | None = None,
) -> Exception:
    """``error`` as the library's named error, or itself when it is neither kind."""
    text = getattr(error, "message", None) or str(error)
    if isinstance(error, google_errors.PermissionDenied):
        what = f"subscription {subscription!r}" if subscription else f"topic {topic!r}"
        return AccessDeniedError(
            f"Pub/Sub refused access to {what} ({text}); grant the service account the "
            "Pub/Sub subscriber/publisher role on it"
        )
    if isinstance(error, google_errors.NotFound):
        if subscription is not None and (topic is None or "ubscription" in text):
            return UnknownSubscriptionError(
                f"subscription {subscription!r} does not exist on Pub/Sub ({text}); create it "
                "with ensure_subscription"
            )
        return UnknownTopicError(
            f"topic {topic!r} does not exist on Pub/Sub ({text}); create it with ensure_topic "
            "or ensure_subscription"
        )
    return error


@contextlib.contextmanager
def snapshot_errors(name: str | None) -> Iterator[None]:
    """Raise a snapshot's NotFound and AlreadyExists as the library's named errors."""
    try:
        yield
    except google_errors.AlreadyExists as error:
        raise SnapshotExistsError(f"snapshot {name!r} already exists") from error
    except google_errors.NotFound as error:
        if name is not None and "napshot" in (getattr(error, "message", None) or str(error)):
            raise UnknownSnapshotError(f"snapshot {name!r} does not exist ({error})") from error
        raise


@contextlib.contextmanager
def named_errors(*, topic: str | None = None, subscription: str | None = None) -> Iterator[None]:
    """Raise NotFound and PermissionDenied as the library's named errors."""
    try:
        yield
    except (google_errors.NotFound, google_errors.PermissionDenied) as error:
        raise named(error, topic=topic, subscription=subscription) from error


def failed_ack_ids(
    error: google_errors.GoogleAPICallError,
) -> tuple[set[str], set[str]] | None:
    """(permanently, transiently) failed ack ids of an exactly-once subscription's partial
    failure, from the error's ErrorInfo; None when the error carries no such list (then
    nothing in the request took effect)."""
    if error.reason != EXACTLY_ONCE_FAILURE:
        return None
    metadata = error.metadata or {}
    permanent = {ack for ack, why in metadata.items() if why.startswith("PERMANENT_FAILURE")}
    transient = {ack for ack, why in metadata.items() if why.startswith("TRANSIENT_FAILURE")}
    return permanent, transient
