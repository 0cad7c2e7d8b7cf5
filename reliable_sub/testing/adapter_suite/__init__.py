"""The adapter conformance suite: one specification, run unchanged against every adapter.

Write a test class that derives from :class:`AdapterSuite`, declare what your adapter does in
``features`` and say how to make it in ``make_harness``; pytest then runs the whole suite
against it::

    from reliable_sub.testing import AdapterSuite, Features, Harness

    class TestMyBroker(AdapterSuite):
        def make_harness(self) -> Harness:
            return Harness(name="my-broker", clock=SystemClock(), ack_deadline=2.0, tick=0.2,
                           new_adapter=make_my_adapter,
                           features=Features(ordering=False, refuses_stale_acks=True))

The suite covers the adapter contract (ack, deadline expiry, nack delays, extend, fan-out and
ordering where the broker has them), the Subscriber's guarantees on top of it (no loss, lease
extension, dead letters, deduplication), stop, restart and close, hostile handlers, settling
under failure, hung handlers, telemetry (spans per attempt, linked to the producer; metrics),
seek, snapshots and replay modes (on adapters that can seek), the dead-letter tools, typed
bodies, batch handlers, and health through a connection that stalls (behind a TCP proxy, where
the harness gives the broker's ``url``). It needs
pytest, pytest-asyncio and opentelemetry-sdk (``pip install "reliable-sub[testing]"``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import ModuleType

import pytest
import pytest_asyncio

from reliable_sub.testing.adapter_suite import (
    batches,
    bodies,
    dead_letter_tools,
    delivery,
    failures,
    guarantees,
    hostile_handlers,
    hostile_results,
    inspection,
    lifecycle,
    replay,
    settling,
    stalls,
    telemetry,
)
from reliable_sub.testing.harness import Harness

MODULES: tuple[ModuleType, ...] = (
    delivery, guarantees, lifecycle, hostile_handlers, hostile_results, settling, failures,
    telemetry, replay, dead_letter_tools, inspection, bodies, batches, stalls,
)


class AdapterSuite:
    """Every conformance test, run against the harness :meth:`make_harness` returns."""

    pytestmark = [pytest.mark.conformance, pytest.mark.asyncio]

    def make_harness(self) -> Harness:
        """The adapter under test (override)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_harness()")

    @pytest_asyncio.fixture
    async def harness(self) -> AsyncIterator[Harness]:
        harness = self.make_harness()
        await harness.adapter()
        try:
            yield harness
        finally:
            await harness.close()

    @staticmethod
    async def test_declared_features_match_the_capabilities(harness: Harness) -> None:
        """A wrong flag would silently skip tests or run ones that cannot pass: compare."""
        declared, actual = harness.features, harness.capabilities
        assert declared.ordering == actual.ordering, "Features.ordering"
        assert declared.cancel_safe_receive == actual.cancel_safe_receive, (
            "Features.cancel_safe_receive"
        )
        assert declared.fan_out == actual.fan_out, "Features.fan_out"
        assert declared.partition_owned == actual.partition_owned, "Features.partition_owned"
        if actual.refuses_stale_acks:
            assert declared.refuses_stale_acks, "the adapter refuses stale acks: declare it"


def _gather() -> None:
    for module in MODULES:
        for name, value in vars(module).items():
            if name.startswith("test_") and callable(value):
                assert not hasattr(AdapterSuite, name), f"two suite tests named {name}"
                setattr(AdapterSuite, name, staticmethod(value))


_gather()

__all__ = ["AdapterSuite", "Harness"]
