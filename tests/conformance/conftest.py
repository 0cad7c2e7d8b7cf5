from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.conformance.harness import HARNESSES, Harness


@pytest.fixture(params=sorted(HARNESSES))
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    h = HARNESSES[request.param]()
    await h.adapter()
    try:
        yield h
    finally:
        await h.close()
