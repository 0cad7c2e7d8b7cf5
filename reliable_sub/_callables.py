"""Telling coroutine functions from sync ones, through partials and callable objects."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


def is_async_callable(function: Callable[..., Any]) -> bool:
    while isinstance(function, functools.partial):
        function = function.func
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004
    )
