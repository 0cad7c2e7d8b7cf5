from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.conformance.harness import HARNESSES, Harness

# The adapters a test of the Subscriber's own logic runs on: the in-memory broker (virtual time)
# and Redis (a real service, real time). The Pub/Sub emulator's 10 s minimum ack deadline makes
# each such test cost tens of seconds there, for the same code path.
LOCAL = sorted(name for name in HARNESSES if name != "pubsub")


async def _harness(name: str) -> AsyncIterator[Harness]:
    h = HARNESSES[name]()
    await h.adapter()
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture(params=sorted(HARNESSES))
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """Every adapter."""
    async for h in _harness(request.param):
        yield h


@pytest.fixture(params=LOCAL)
async def local_harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The in-memory broker and Redis (fakeredis on a laptop without Redis)."""
    async for h in _harness(request.param):
        yield h
