"""Testing tools shipped with reliable-sub: the conformance suites, a time driver, services.

* :class:`AdapterSuite` -- the adapter conformance suite; derive a test class from it to run
  it against your own adapter (see :mod:`reliable_sub.testing.adapter_suite`).
* :class:`DedupStoreSuite` -- the same for a dedup store (:mod:`reliable_sub.testing.dedup_suite`).
* :class:`Harness`, :class:`Features`, :class:`StoreHarness` -- what the suites need from you; the
  ``*_harness`` and ``*_stores`` functions build them for this package's adapters and stores.
* :mod:`reliable_sub.testing.timing` -- drive a ``ManualClock`` from a test: virtual hours pass
  in milliseconds, in a deterministic order (``drive_until``, ``pass_time``).
* :mod:`reliable_sub.testing.services` -- reach Redis and start the Pub/Sub emulator (skip the
  test without them, or fail it under ``CI=true``).
* :class:`FaultInjector`, :class:`Faults`, :data:`DUPLICATE_DELIVERY` -- duplicates, lost acks,
  repeats, interruptions and store failures injected into your own tests
  (:mod:`reliable_sub.testing.faults`).
* :class:`~reliable_sub.testing.tcp_proxy.TcpProxy` -- a TCP proxy that stalls on demand: a
  connection that hangs without closing, between your consumer and a real broker or store.
* :func:`run_recorded`, :func:`load_recorded` -- replay recorded messages through a handler and
  get its effects per message (:mod:`reliable_sub.testing.recorded`).

Needs pytest and pytest-asyncio: ``pip install "reliable-sub[testing]"``.
"""

from reliable_sub.errors import MissingExtraError

try:
    import pytest  # noqa: F401
    import pytest_asyncio  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise MissingExtraError("reliable_sub.testing", "testing", error.name or "pytest") from error

from reliable_sub.testing.adapter_suite import AdapterSuite
from reliable_sub.testing.dedup_harness import StoreHarness
from reliable_sub.testing.dedup_suite import (
    DedupStoreSuite,
    fakeredis_stores,
    memory_stores,
    redis_stores,
    sql_stores,
)
from reliable_sub.testing.faults import (
    DUPLICATE_DELIVERY,
    FaultInjector,
    Faults,
    InjectedFault,
)
from reliable_sub.testing.harness import (
    Features,
    Harness,
    Recorder,
    fakeredis_harness,
    memory_harness,
    nats_harness,
    pubsub_harness,
    redis_harness,
)
from reliable_sub.testing.harness_kafka import kafka_harness
from reliable_sub.testing.recorded import (
    EffectsReport,
    MessageEffects,
    load_recorded,
    run_recorded,
)

__all__ = [
    "DUPLICATE_DELIVERY",
    "AdapterSuite",
    "DedupStoreSuite",
    "EffectsReport",
    "FaultInjector",
    "Faults",
    "Features",
    "Harness",
    "InjectedFault",
    "MessageEffects",
    "Recorder",
    "StoreHarness",
    "fakeredis_harness",
    "fakeredis_stores",
    "kafka_harness",
    "load_recorded",
    "memory_harness",
    "memory_stores",
    "nats_harness",
    "pubsub_harness",
    "redis_harness",
    "redis_stores",
    "run_recorded",
    "sql_stores",
]
