"""``@idempotent`` over a plain sync decorator around ``async def`` (#24 item 1): the call is
async, the function runs once, and its real result is stored and replayed (before, the sync
wrapper's coroutine was taken for the result: never awaited, nothing stored)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from reliable_sub import MemoryDedupStore
from reliable_sub.errors import ResultNotSerializableError
from reliable_sub.idempotency import idempotent


def logged(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


async def test_a_sync_decorator_around_async_def_runs_once_and_replays_its_result() -> None:
    store = MemoryDedupStore()
    runs: list[str] = []

    @idempotent(store, key="request_id")
    @logged
    async def charge(request_id: str, amount: int) -> dict[str, int]:
        runs.append(request_id)
        return {"charged": amount}

    assert await charge("r1", 10) == {"charged": 10}
    info = await charge.call_with_info("r1", 10)
    assert (info.value, info.replayed) == ({"charged": 10}, True)
    assert runs == ["r1"]


def test_a_sync_function_that_returns_a_coroutine_is_refused_not_stored() -> None:
    """A truly sync function handing back a coroutine: it did not do its work; the call fails
    (the claim is released) rather than storing a result of work that never ran."""
    store = MemoryDedupStore()

    async def work(request_id: str) -> str:
        return request_id

    charge = idempotent(store, key="request_id", namespace="charge")(
        lambda request_id: work(request_id))
    with pytest.raises(ResultNotSerializableError, match="returned an awaitable"):
        charge("r2")
    with pytest.raises(ResultNotSerializableError, match="returned an awaitable"):
        charge("r2")  # not replayed: nothing was stored
