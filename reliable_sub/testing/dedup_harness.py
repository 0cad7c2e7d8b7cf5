"""What the shipped dedup-store suite runs against: a store, a peer over the same records,
and how to make time pass for them (see :mod:`reliable_sub.testing.dedup_suite`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from reliable_sub.ports import DedupKey, DedupStore


@dataclass
class StoreHarness:
    name: str
    store: DedupStore
    peer: DedupStore
    short_ttl: float
    wait_until_gone: Callable[[DedupKey], Awaitable[None]]
    write_raw: Callable[[DedupKey, str], Awaitable[None]]
    cleanup: Callable[[], Awaitable[None]]
    prepare: Callable[[], Awaitable[None]] | None = None  # e.g. create the schema
    # Another instance over the same records with the given owner (closed by cleanup); the
    # owner tests are skipped without it.
    another: Callable[[str], DedupStore] | None = None


__all__ = ["StoreHarness"]
