"""Idempotent-consumer dedup stores: duplicates of a completed message have no effect.

A store keeps one record per :class:`DedupKey` (a namespace and an idempotency key, kept apart so
no two pairs can ever name the same record). ``claim_many`` answers atomically, per key:

* :class:`Claimed` -- nobody is handling the key; the caller now holds it for ``lease_ttl``
  seconds under a fresh *fencing token*. Renewing, completing and releasing the claim are all
  conditional on that token, so a caller whose claim lapsed (and was taken by a peer) can never
  overwrite the peer's record;
* :class:`Completed` -- it was handled; the stored result is kept as JSON text and decoded only
  when asked for, so an unreadable record never fails a claim;
* :class:`InProgress` -- a live peer holds a claim.

A record also counts *handler failures* (``failures``): a failed attempt releases its claim but
keeps the count, so the Subscriber can dead-letter after N failures however many consumers,
restarts, deferrals and stops came in between. Results are stored as JSON, never pickle.

Stores: :class:`MemoryDedupStore` (this process), ``RedisDedupStore`` (shared by every
consumer; needs ``pip install "reliable-sub[redis]"``) and ``SqlDedupStore`` (a table in your
own database; extra ``sql``, or ``mysql`` for MariaDB). ``from reliable_sub.dedup import
RedisDedupStore`` loads it on first use, so importing this package never imports redis or
SQLAlchemy.

Import everything from here; the modules of this package are private:

* ``_store_base`` -- what every store shares: fencing tokens, owner checks, the single-key
  methods;
* ``_memory`` -- :class:`MemoryDedupStore`;
* ``_redis`` -- ``RedisDedupStore``, its Lua scripts in ``lua/``;
* ``_sql`` -- ``SqlDedupStore``, with ``_sql_table`` (the table) and ``_sql_claims`` /
  ``_sql_claims_mariadb`` (the statements of PostgreSQL and SQLite; of MariaDB);
* ``_epochs`` -- dedup epochs, how a replay makes processed messages run again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._results import checked_result_json, decode_result, encode_result
from ..ports import (
    Claimed,
    ClaimResult,
    Completed,
    Completion,
    DedupKey,
    DedupStore,
    InProgress,
    SyncDedupStore,
)
from ._memory import MemoryDedupStore
from ._store_base import SingleKeyMethods, TokenSource, check_owner

if TYPE_CHECKING:  # for type checkers only: at runtime __getattr__ imports them on first use
    from ._redis import RedisDedupStore as RedisDedupStore
    from ._sql import SqlDedupStore as SqlDedupStore

__all__ = [
    "ClaimResult",
    "Claimed",
    "Completed",
    "Completion",
    "DedupKey",
    "DedupStore",
    "InProgress",
    "MemoryDedupStore",
    "RedisDedupStore",
    "SingleKeyMethods",
    "SqlDedupStore",
    "SyncDedupStore",
    "TokenSource",
    "check_owner",
    "checked_result_json",
    "decode_result",
    "encode_result",
]


def __getattr__(name: str) -> Any:
    """Import optional stores on first use, so the core never imports their client libraries.

    Without its extra (``redis``, ``sql``), a store raises :class:`MissingExtraError` naming the
    ``pip install`` to run.
    """
    if name == "RedisDedupStore":
        from ._redis import RedisDedupStore

        return RedisDedupStore
    if name == "SqlDedupStore":
        from ._sql import SqlDedupStore

        return SqlDedupStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
