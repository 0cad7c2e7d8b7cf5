"""The transactional outbox (extra ``sql``): events written in the business transaction.

* :mod:`~reliable_sub.outbox.table` -- the table (``outbox_table(metadata, name)``);
* :mod:`~reliable_sub.outbox.outbox` -- :class:`Outbox` and its :meth:`~Outbox.add`;
* :mod:`~reliable_sub.outbox.relay` -- :class:`OutboxRelay`, which publishes committed rows.
"""

from .outbox import CONTENT_TYPE, JSON_CONTENT_TYPE, Outbox
from .relay import IDEMPOTENCY_KEY_ATTRIBUTE, Backlog, OutboxRelay
from .table import DEFAULT_TABLE, outbox_table

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_TABLE",
    "IDEMPOTENCY_KEY_ATTRIBUTE",
    "JSON_CONTENT_TYPE",
    "Backlog",
    "Outbox",
    "OutboxRelay",
    "outbox_table",
]
