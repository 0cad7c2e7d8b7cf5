"""The transactional outbox (extra ``sql``): events written in the business transaction.

* :mod:`~reliable_sub.outbox.table` -- the table (``outbox_table(metadata, name)``);
* :mod:`~reliable_sub.outbox.outbox` -- :class:`Outbox` and its :meth:`~Outbox.add`.

The relay that publishes committed rows is not built yet (issue #11).
"""

from .outbox import CONTENT_TYPE, JSON_CONTENT_TYPE, Outbox
from .table import DEFAULT_TABLE, outbox_table

__all__ = ["CONTENT_TYPE", "DEFAULT_TABLE", "JSON_CONTENT_TYPE", "Outbox", "outbox_table"]
