"""Telling coroutine functions from sync ones, through partials, callable objects and wrappers.

A plain decorator around a coroutine function (``functools.wraps`` over ``async def``, as tracing
and logging libraries write them) is itself a sync function that returns a coroutine: it counts
as async here, so it is called in the event loop and what it returns is awaited. A handler's
result that is still awaitable is awaited too (:func:`settled_result`); a generator, sync or
async, is refused: returned unrun, its body would never execute.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

from .errors import ConfigurationError

# A result awaited this many times and still awaitable is refused (an awaitable returning
# itself would otherwise hold the delivery for ever).
MAX_AWAITS = 8


def _layers(function: Any) -> Iterator[Any]:
    """``function``, then each function it wraps (partials, ``__wrapped__``), outermost
    first; bounded, since a wrapper chain can be a cycle."""
    for _ in range(100):
        yield function
        if isinstance(function, functools.partial):
            function = function.func
            continue
        wrapped = getattr(function, "__wrapped__", None)
        if wrapped is None or wrapped is function:
            return
        function = wrapped


def _unwrapped(function: Any) -> Any:
    """``function`` without partials and ``__wrapped__`` wrappers."""
    *_, innermost = _layers(function)
    return innermost


def _any_layer(function: Any, test: Callable[[Any], bool]) -> bool:
    """Whether ``test`` holds for ``function``, its ``__call__``, or a function it wraps."""
    return any(test(layer) or test(getattr(layer, "__call__", None))  # noqa: B004
               for layer in _layers(function))


def is_async_callable(function: Callable[..., Any]) -> bool:
    """True for a coroutine function, or a partial, callable object or wrapper of one."""
    return _any_layer(function, inspect.iscoroutinefunction)


def check_not_generator(function: Callable[..., Any], what: str) -> None:
    """Refuse a generator function (sync or async): its body runs only when iterated, so a
    caller that calls it and uses the result would report work done that never ran."""
    if _any_layer(function, inspect.isasyncgenfunction):
        kind = "an async generator function"
    elif _any_layer(function, inspect.isgeneratorfunction):
        kind = "a generator function"
    else:
        return
    raise ConfigurationError(
        f"{what}: {_describe(function)} is {kind} (its body has a 'yield'), so calling it runs "
        "nothing; write it as a plain 'def' or 'async def' that returns its result"
    )


def check_takes(function: Callable[..., Any], count: int, call: str, what: str) -> None:
    """Refuse ``function`` when its signature cannot take ``count`` positional arguments
    (``call`` shows how it is called); a signature Python cannot read is accepted."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    signature = signature.replace(return_annotation=inspect.Signature.empty)
    try:
        signature.bind(*([None] * count))
    except TypeError as error:
        raise ConfigurationError(
            f"{what}: {_name(function)}{signature} cannot be called as {call} ({error}); "
            f"declare it to take {'that argument' if count == 1 else 'those arguments'}"
        ) from None


def unawaitable_result_error(result: Any, name: str) -> TypeError | None:
    """The error for a handler ``result`` that was never run (a generator), or None."""
    if isinstance(result, types.GeneratorType | types.AsyncGeneratorType):
        kind = type(result).__name__
        return TypeError(
            f"handler {name} returned a {kind} object, so its body never ran; return the "
            "result itself (a generator function cannot be a handler)"
        )
    return None


async def settled_result(result: Any, name: str) -> Any:
    """``result`` awaited while it is awaitable (a sync wrapper's coroutine, a returned task);
    a TypeError for a generator, or for an awaitable that never settles to a value."""
    for _ in range(MAX_AWAITS):
        if inspect.isawaitable(result):
            result = await result
            continue
        error = unawaitable_result_error(result, name)
        if error is not None:
            raise error
        return result
    if inspect.iscoroutine(result):
        result.close()
    raise TypeError(f"handler {name} returned an awaitable that was still awaitable after "
                    f"{MAX_AWAITS} awaits")


def _name(function: Any) -> str:
    name = getattr(_unwrapped(function), "__qualname__", None)
    return name if isinstance(name, str) else repr(function)


def _describe(function: Any) -> str:
    return f"{_name(function)}()"


__all__ = [
    "check_not_generator",
    "check_takes",
    "is_async_callable",
    "settled_result",
    "unawaitable_result_error",
]
