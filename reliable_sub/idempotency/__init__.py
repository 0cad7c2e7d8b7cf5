"""Idempotent consumers: the claim lifecycle and the dedup stores behind ``reliable_sub.dedup``.

* :mod:`~reliable_sub.idempotency.claims` -- the one owner of the claim lifecycle in a Subscriber
  (claim a batch, refresh, renew with the lease, complete or release with the settle).
* :mod:`~reliable_sub.idempotency.memory_store` -- :class:`MemoryDedupStore` and what every store
  shares (fencing tokens, owner checks, single-key methods).
* :mod:`~reliable_sub.idempotency.redis_store` -- :class:`RedisDedupStore` (extra ``redis``), its
  Lua scripts in ``lua/``.

Import stores from :mod:`reliable_sub.dedup`; the contract is in :mod:`reliable_sub.ports`.
"""
