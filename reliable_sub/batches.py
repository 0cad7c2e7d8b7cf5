"""Batch handlers: one call for the messages received together.

``@sub.handler("orders", batch=True)`` registers a handler that takes a list: of Messages
(``def handle(messages: list[Message])``), or of bodies decoded from JSON when the list's item
type is a pydantic model, a dataclass, a TypedDict or a msgspec Struct
(``def handle(orders: list[Order])``, ``async def handle(orders: list[Order], messages:
list[Message])``). Claims, leases, acks and dead letters stay per message, as for any handler;
a handler reports messages that failed by returning a :class:`BatchResult`.

The annotation is read once, at registration.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ._bodies import (
    Decoder,
    annotation_of,
    decoder_for,
    positional_parameters,
    type_name,
)
from ._text import safe_repr
from .errors import ConfigurationError
from .message import Message
from .policy import LeasePolicy, check_count

# What a batch handler gets when it names no limits: what one receive call brought, at most this
# many (a receive brings at most the Subscriber's receive_batch).
DEFAULT_MAX_BATCH = 100

_LISTS = (list, collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection)


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """What a batch handler returns when some of its messages failed.

    Each message named in ``failed`` (by :attr:`Message.id`) fails with its exception, as if a
    handler of it alone had raised that: retried with backoff, or dead-lettered (at once for a
    :class:`~reliable_sub.Reject` or a ``non_retryable`` type). Every other message of the
    batch succeeded and is acked. Returning ``None`` says that all of them succeeded; raising
    fails all of them.
    """

    failed: Mapping[str, BaseException] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.failed, Mapping):
            raise TypeError(f"BatchResult.failed must map message ids to exceptions, got "
                            f"{safe_repr(self.failed, 100)}")
        for message_id, error in self.failed.items():
            if not isinstance(message_id, str) or not isinstance(error, BaseException):
                raise TypeError(
                    "BatchResult.failed must map message ids (str, Message.id) to exceptions, "
                    f"got {safe_repr(message_id, 80)}: {safe_repr(error, 80)}")


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """How a batch handler is fed and called (resolved once, at registration).

    Attributes:
        max_batch: the most messages in one call.
        max_wait: seconds a batch waits for more messages after its first (0: what one
            receive brought).
        decode: turns a body into the handler's item type, or None when it takes Messages.
        body_name: the item type's name, for errors.
        takes_messages: a typed handler that takes the Messages as its second argument.
    """

    max_batch: int
    max_wait: float
    decode: Decoder | None = None
    body_name: str = "Message"
    takes_messages: bool = False

    @property
    def arguments(self) -> list[str]:
        """How the handler is called, for error messages."""
        if self.decode is None:
            return ["messages"]
        return ["bodies", "messages"] if self.takes_messages else ["bodies"]


def batch_spec(
    function: Callable[..., Any], where: str, *, max_batch: int | None, max_wait: float | None,
    lease: LeasePolicy,
) -> BatchSpec:
    """The :class:`BatchSpec` of ``function``, its limits checked against ``lease``."""
    size = DEFAULT_MAX_BATCH if max_batch is None else max_batch
    check_count(where, "max_batch", size)
    wait = 0.0 if max_wait is None else max_wait
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not (
            0 <= wait < lease.max_lease_duration):
        raise ConfigurationError(
            f"{where}: max_wait must be a number of seconds in [0, max_lease_duration="
            f"{lease.max_lease_duration:g}), got {wait!r}")
    parameters = positional_parameters(function)
    if not parameters:
        return BatchSpec(size, float(wait))
    item_type = _item_type(annotation_of(function, parameters[0], where), where)
    decode = None if item_type is None else decoder_for(item_type)
    if decode is None:
        return BatchSpec(size, float(wait))
    takes_messages = len(parameters) > 1 and (
        parameters[1].name == "messages"
        or _item_type(annotation_of(function, parameters[1], where), where) is Message
    )
    return BatchSpec(size, float(wait), decode, type_name(item_type), takes_messages)


def _item_type(annotation: Any, where: str) -> Any:
    """The item type of a list annotation (``list[Order]`` -> Order); None when unannotated.

    A body type given bare (``order: Order``) is refused: a batch handler takes a list.
    """
    if annotation is None or annotation is inspect.Parameter.empty:
        return None
    origin = typing.get_origin(annotation)
    if origin in _LISTS:
        arguments = typing.get_args(annotation)
        return arguments[0] if arguments else None
    if (origin is tuple or origin is typing.Union or origin is types.UnionType) and any(
            _names_a_body(argument) for argument in typing.get_args(annotation)):
        raise ConfigurationError(
            f"{where}: a batch handler gets a list: annotate its parameter list[...], not "
            f"{safe_repr(annotation, 80)}")
    if isinstance(annotation, type) and _names_a_body(annotation):
        raise ConfigurationError(
            f"{where}: a batch handler takes a list; annotate its parameter "
            f"list[{type_name(annotation)}], not {type_name(annotation)}")
    return None


def _names_a_body(annotation: Any) -> bool:
    """Whether ``annotation`` is, or holds, Message or a body type."""
    if isinstance(annotation, type) and (annotation is Message or decoder_for(annotation)):
        return True
    return any(_names_a_body(argument) for argument in typing.get_args(annotation))


def check_batch_options(where: str, batch: bool, max_batch: object, max_wait: object, *,
                        per_message: bool) -> None:
    """Refuse ``max_batch`` / ``max_wait`` given without ``batch=True``, and a batch handler
    with what works per message only (``per_message``: middleware, transactional=True)."""
    if not isinstance(batch, bool):
        raise ConfigurationError(f"{where}: batch must be True or False, got {batch!r}")
    if not batch and (max_batch is not None or max_wait is not None):
        raise ConfigurationError(
            f"{where}: max_batch and max_wait apply to batch handlers; pass batch=True too")
    if batch and per_message:
        raise ConfigurationError(
            f"{where}: a batch handler takes no middleware and cannot be transactional (both "
            "work per message); wrap the handler function itself, or register it without "
            "batch=True")


__all__ = ["DEFAULT_MAX_BATCH", "BatchResult", "BatchSpec", "batch_spec", "check_batch_options"]
