"""Idempotent consumers: the dedup stores behind ``reliable_sub.dedup``.

* :mod:`~reliable_sub.idempotency.memory_store` -- :class:`MemoryDedupStore` and what every store
  shares (fencing tokens, owner checks, single-key methods).
* :mod:`~reliable_sub.idempotency.redis_store` -- :class:`RedisDedupStore` (extra ``redis``), its
  Lua scripts in ``lua/``.
* :mod:`~reliable_sub.idempotency.decorator` -- :func:`idempotent`: any function, sync or async,
  runs once per idempotency key; repeats replay its stored result (:class:`IdempotentResult`).
* :mod:`~reliable_sub.idempotency.keys` -- :func:`idempotency_key` (a deterministic, namespaced
  key from a request's values) and :func:`new_idempotency_key` (a fresh UUIDv7 for clients).

Import stores from :mod:`reliable_sub.dedup`; the contract is in :mod:`reliable_sub.ports`. The
claim lifecycle of a running Subscriber is :mod:`reliable_sub.runtime.claims`.
"""

from .decorator import IdempotentResult, idempotent
from .keys import idempotency_key, new_idempotency_key

__all__ = ["IdempotentResult", "idempotency_key", "idempotent", "new_idempotency_key"]
