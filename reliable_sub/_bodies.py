"""Typed message bodies: a handler whose first parameter is annotated with a pydantic model, a
dataclass, a TypedDict or a msgspec Struct gets the body decoded from JSON and validated, not the
Message.

The annotation is read once, when the handler is registered; an untyped handler is registered
as it is and costs nothing more per message. A body that does not decode or validate raises
:class:`BodyValidationError`, a :class:`~reliable_sub.Reject`: the message is dead-lettered at
its first attempt. With pydantic installed, dataclasses and TypedDicts are validated by pydantic
too (field types, coercions); without it, a dataclass is built from the JSON object's fields and
a TypedDict checked for its required keys, and field types are not checked.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

from ._text import describe_error
from .errors import BodyValidationError, ConfigurationError
from .message import Message

# The validation error cut to this many characters in the rejection (the dead letter's
# error-message holds 1000 bytes).
ERROR_LIMIT = 800


Decoder = Callable[[bytes], Any]


@dataclasses.dataclass(frozen=True)
class TypedHandler:
    """A handler that takes a decoded body: ``call(message, *rest)`` decodes the body and
    calls it as ``handler(body, *rest)``, or ``handler(body, message, *rest)``."""

    call: Callable[..., Any]
    body_type: type
    takes_message: bool

    @property
    def arguments(self) -> list[str]:
        """How the handler is called, for error messages."""
        return ["body", "message"] if self.takes_message else ["body"]


def typed_handler(function: Callable[..., Any], where: str) -> TypedHandler | None:
    """``function`` as a :class:`TypedHandler` when its first parameter is annotated with a
    body type (it gets the Message too when its second parameter is annotated ``Message`` or
    named ``message``); None for an untyped handler."""
    parameters = positional_parameters(function)
    if not parameters:
        return None
    body_type = annotation_of(function, parameters[0], where)
    decode = decoder_for(body_type)
    if decode is None:
        return None
    wants_message = len(parameters) > 1 and (
        parameters[1].name == "message"
        or annotation_of(function, parameters[1], where) is Message
    )
    name = type_name(body_type)

    def with_body(message: Message, *rest: Any) -> Any:
        body = body_of(decode, name, message)
        if wants_message:
            return function(body, message, *rest)
        return function(body, *rest)

    return TypedHandler(with_body, body_type, wants_message)


def type_name(body_type: Any) -> str:
    """``body_type``'s name, as errors say it."""
    return getattr(body_type, "__qualname__", repr(body_type))


def body_of(decode: Decoder, name: str, message: Message) -> Any:
    """``message``'s body decoded as the type called ``name``, or a BodyValidationError."""
    try:
        return decode(message.data)
    except Exception as error:  # any: a validator of the user's may raise anything
        raise BodyValidationError(
            f"the body of message {message.id} is not a valid {name}: "
            f"{describe_error(error, ERROR_LIMIT)}"
        ) from error


def positional_parameters(function: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a callable Python cannot read: taken as untyped
        return []
    return [p for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def annotation_of(function: Callable[..., Any], parameter: inspect.Parameter, where: str) -> Any:
    """``parameter``'s annotation, evaluated in the handler's module when it is a string
    (``from __future__ import annotations``, a forward reference). A string naming ``Message``
    that cannot be evaluated (imported under ``TYPE_CHECKING``) is taken as Message."""
    annotation = parameter.annotation
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, _globals_of(function))  # as get_annotations(eval_str=True)
    except NameError as error:
        if annotation == "Message" or annotation.endswith(".Message"):
            return Message
        raise ConfigurationError(
            f"{where}: the annotation {annotation!r} of parameter {parameter.name!r} cannot "
            f"be resolved ({error}); define or import that type before the handler"
        ) from None
    except Exception:  # not an expression of a type: not a body type either
        return None


def _globals_of(function: Any) -> dict[str, Any]:
    while isinstance(function, functools.partial):
        function = function.func
    if not inspect.isroutine(function):
        function = getattr(type(function), "__call__", function)  # noqa: B004
    namespace = getattr(inspect.unwrap(function), "__globals__", None)
    return namespace if isinstance(namespace, dict) else {}


def decoder_for(annotation: Any) -> Decoder | None:
    """How to turn a body into ``annotation`` (None when it is not a body type)."""
    if not isinstance(annotation, type) or issubclass(annotation, Message):
        return None
    if _is_pydantic_model(annotation):
        return annotation.model_validate_json  # type: ignore[attr-defined, no-any-return]
    if _is_msgspec_struct(annotation):
        import msgspec

        return msgspec.json.Decoder(annotation).decode
    is_dataclass = dataclasses.is_dataclass(annotation)
    is_typed_dict = typing.is_typeddict(annotation)
    if not (is_dataclass or is_typed_dict):
        return None
    pydantic_decoder = _pydantic_decoder(annotation)
    if pydantic_decoder is not None:
        return pydantic_decoder
    if is_dataclass:
        return _dataclass_decoder(annotation)
    return _typed_dict_decoder(annotation)


def _is_pydantic_model(annotation: type) -> bool:
    return hasattr(annotation, "model_validate_json") and hasattr(annotation, "model_fields")


def _is_msgspec_struct(annotation: type) -> bool:
    return hasattr(annotation, "__struct_fields__") and type(annotation).__module__.startswith(
        "msgspec")


def _pydantic_decoder(annotation: type) -> Decoder | None:
    try:
        from pydantic import PydanticUserError, TypeAdapter
    except ImportError:
        return None
    try:
        return TypeAdapter(annotation).validate_json
    except PydanticUserError:  # typing.TypedDict before Python 3.12: checked without pydantic
        return None


def _json_object(data: bytes) -> dict[str, Any]:
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _dataclass_decoder(annotation: type) -> Decoder:
    def decode(data: bytes) -> Any:
        return annotation(**_json_object(data))

    return decode


def _typed_dict_decoder(annotation: type) -> Decoder:
    required = annotation.__required_keys__  # type: ignore[attr-defined]

    def decode(data: bytes) -> Any:
        value = _json_object(data)
        missing = sorted(required - value.keys())
        if missing:
            raise ValueError(f"missing keys: {', '.join(missing)}")
        return value

    return decode


def result_decoder(function: Callable[..., Any]) -> Callable[[Any], Any] | None:
    """For a replay by ``@idempotent``: turns the stored JSON value back into ``function``'s
    annotated return type when that is a pydantic model or a dataclass; None otherwise (and for
    an annotation that cannot be resolved: the replay returns the JSON value)."""
    try:
        annotation = inspect.signature(function).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, _globals_of(function))  # as get_annotations does
        except Exception:
            return None
    if not isinstance(annotation, type):
        return None
    if _is_pydantic_model(annotation):
        return annotation.model_validate  # type: ignore[attr-defined, no-any-return]
    if _is_msgspec_struct(annotation):
        import msgspec

        return lambda value: msgspec.convert(value, annotation)
    if not dataclasses.is_dataclass(annotation):
        return None
    try:
        from pydantic import TypeAdapter
    except ImportError:
        return lambda value: annotation(**value)
    return TypeAdapter(annotation).validate_python


def json_payload(data: object, where: str) -> bytes:
    """``data`` (a pydantic model, a dataclass or a JSON value) as ASCII JSON (non-ASCII
    characters escaped, so it always encodes), or a TypeError naming its type."""
    try:
        text = json.dumps(data, allow_nan=False, separators=(",", ":"), default=jsonable)
    except (TypeError, ValueError, RecursionError) as error:
        raise TypeError(
            f"{where}: data must be bytes, a pydantic model, a dataclass or JSON-serialisable, "
            f"got {type(data).__name__} ({error})"
        ) from error
    return text.encode("ascii")


def jsonable(value: Any) -> Any:
    """A handler result the JSON encoder does not know, as JSON-ready data: a pydantic model
    (its JSON mode dump) or a dataclass instance; TypeError for anything else."""
    if _is_pydantic_model(type(value)):
        return value.model_dump(mode="json")
    if _is_msgspec_struct(type(value)):
        import msgspec

        return msgspec.to_builtins(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


__all__ = [
    "TypedHandler",
    "json_payload",
    "jsonable",
    "result_decoder",
    "typed_handler",
]
