"""What the command connects to, from its options or their environment variables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

from ..ports import Adapter, DedupStore


@dataclass
class Connection:
    """The broker, dedup store and database the command was pointed at (any may be None)."""

    redis_url: str | None = None
    redis_prefix: str = "reliable-sub"
    pubsub_project: str | None = None
    database_url: str | None = None
    outbox_table: str = "reliable_sub_outbox"
    dedup_url: str | None = None
    dedup_prefix: str = "reliable-sub:dedup"
    dedup_table: str = "reliable_sub_processed"

    def adapter(self) -> Adapter:
        """The broker's adapter: Redis Streams or Pub/Sub, whichever was named (exactly one)."""
        if (self.redis_url is None) == (self.pubsub_project is None):
            raise click.UsageError(
                "name exactly one broker: --redis-url (RELIABLE_SUB_REDIS_URL) or "
                "--pubsub-project (RELIABLE_SUB_PUBSUB_PROJECT)")
        if self.redis_url is not None:
            from ..adapters.redis_streams import RedisStreamsAdapter

            return RedisStreamsAdapter(self.redis_url, consumer="reliable-sub-cli",
                                       key_prefix=self.redis_prefix)
        from ..adapters.pubsub import PubSubAdapter

        assert self.pubsub_project is not None
        return PubSubAdapter(self.pubsub_project)

    def dedup_store(self) -> DedupStore:
        """The consumers' dedup store: Redis for a ``redis://`` URL, else SQL."""
        if self.dedup_url is None:
            raise click.UsageError(
                "this needs the consumers' dedup store: --dedup-url (RELIABLE_SUB_DEDUP_URL), "
                "a redis:// or database URL")
        if self.dedup_url.startswith(("redis://", "rediss://", "unix://")):
            from ..idempotency.redis_store import RedisDedupStore

            return RedisDedupStore(self.dedup_url, prefix=self.dedup_prefix)
        from ..idempotency.sql_store import SqlDedupStore

        return SqlDedupStore(self.dedup_url, table=self.dedup_table)

    def outbox(self) -> Any:
        """The outbox in the database of ``--database-url``."""
        if self.database_url is None:
            raise click.UsageError(
                "this needs the outbox's database: --database-url (RELIABLE_SUB_DATABASE_URL)")
        from ..outbox import Outbox

        return Outbox(self.database_url, table=self.outbox_table)
