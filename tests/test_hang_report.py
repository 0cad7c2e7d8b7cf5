"""The hang report names the await a hung test is stuck in."""

from __future__ import annotations

import asyncio

import pytest

from tests.hang_report import _print_running_tasks, await_chain


async def test_the_report_shows_each_task_and_its_await(capsys: pytest.CaptureFixture[str]) -> None:
    never = asyncio.Event()

    async def stuck_on_an_event() -> None:
        await never.wait()

    task = asyncio.create_task(stuck_on_an_event())
    await asyncio.sleep(0)
    # from another thread, as the timer does, while this loop runs
    await asyncio.to_thread(_print_running_tasks, "a test")
    task.cancel()
    err = capsys.readouterr().err
    assert "a test is about to time out" in err
    assert "stuck_on_an_event" in err and "never.wait()" in err


async def test_the_report_follows_the_awaits_down_to_the_future() -> None:
    never = asyncio.Event()

    async def inner() -> None:
        await never.wait()

    async def outer() -> None:
        await inner()

    task = asyncio.create_task(outer())
    await asyncio.sleep(0)
    chain = "\n".join(await_chain(task))
    task.cancel()
    assert chain.index("in outer") < chain.index("in inner") < chain.index("in wait")
    assert "await inner()" in chain and "never.wait()" in chain
    assert "awaiting <Future pending" in chain
