"""The hang report names the await a hung test is stuck in."""

from __future__ import annotations

import asyncio

import pytest

from tests.hang_report import _print_running_tasks


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
