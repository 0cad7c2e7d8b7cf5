"""Idempotent functions: ``@idempotent``, idempotency keys, transactional handlers.

* :mod:`~reliable_sub.idempotency.decorator` -- :func:`idempotent`: any function, sync or async,
  runs once per idempotency key; repeats replay its stored result (:class:`IdempotentResult`).
* :mod:`~reliable_sub.idempotency.keys` -- :func:`idempotency_key` (a deterministic, namespaced
  key from a request's values) and :func:`new_idempotency_key` (a fresh UUIDv7 for clients).
* :mod:`~reliable_sub.idempotency.fingerprint` -- fingerprints of a call's arguments, so a key
  reused with other arguments is refused rather than replayed.
* :mod:`~reliable_sub.idempotency.transactional` -- transactional handlers: the handler's writes
  and its dedup record commit in one transaction.

The dedup stores they keep their records in are :mod:`reliable_sub.dedup`; the contract is in
:mod:`reliable_sub.ports`. The claim lifecycle of a running Subscriber is
:mod:`reliable_sub._runtime.claims`.
"""

from .decorator import IdempotentResult, idempotent
from .keys import idempotency_key, new_idempotency_key

__all__ = ["IdempotentResult", "idempotency_key", "idempotent", "new_idempotency_key"]
