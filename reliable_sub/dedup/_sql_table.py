"""The SQL dedup store's table, and how keys are stored in it.

::

    namespace  key  owner  state  failures  lease_expires_at  completed_at  expires_at  result
    primary key (namespace, key); index on expires_at (for purge_expired)

``state`` is ``claimed`` (``owner`` holds it until ``lease_expires_at``), ``failed`` (released
after ``failures`` failed attempts, kept until ``expires_at``) or ``completed`` (``result`` is the
handler's result as JSON text, ``owner`` NULL). A row whose ``expires_at`` has passed counts as
absent. A namespace's dedup epoch (see :mod:`reliable_sub.dedup._epochs`) is a row of state
``epoch`` under the key ``h:epoch``, which no message key is stored as. Times are epoch seconds
from the store's clock. Namespaces and keys longer than ``READABLE_LIMIT`` characters (or that
a database cannot hold as text) are stored as ``h:`` + their SHA-256 hex, as in the Redis store.
"""

from __future__ import annotations

import hashlib

from ..errors import MissingExtraError
from ..ports import DedupKey

try:
    import sqlalchemy as sa
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("SqlDedupStore", "sql", "SQLAlchemy") from error

from .._sql_types import TABLE_OPTIONS, exact_text, long_text, seconds

DEFAULT_TABLE = "reliable_sub_processed"
# Namespaces and keys up to this many characters are stored as they are; longer ones hashed.
READABLE_LIMIT = 200
# On MariaDB a primary key holds at most 3,072 bytes: two columns of 255 four-byte characters.
_MYSQL_KEY_LENGTH = 255
_HASHED = "h:"
CLAIMED, FAILED, COMPLETED = "claimed", "failed", "completed"
# A namespace's epoch is a row of its own: key EPOCH_KEY (no message key is stored as it: keys
# that start with "h:" are stored hashed), state EPOCH, the number in ``failures``, never expiring.
EPOCH_KEY, EPOCH = "h:epoch", "epoch"
NEVER = 1e18  # epoch seconds, some thirty billion years ahead
OWNER_LENGTH = 200


def processed_table(metadata: sa.MetaData, name: str = DEFAULT_TABLE) -> sa.Table:
    """The dedup table, defined on ``metadata`` (put it in your migrations)."""
    return sa.Table(
        name,
        metadata,
        sa.Column("namespace", exact_text(2 * READABLE_LIMIT, _MYSQL_KEY_LENGTH),
                  primary_key=True),
        sa.Column("key", exact_text(2 * READABLE_LIMIT, _MYSQL_KEY_LENGTH), primary_key=True),
        sa.Column("owner", exact_text(OWNER_LENGTH), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lease_expires_at", seconds(), nullable=True),
        sa.Column("completed_at", seconds(), nullable=True),
        sa.Column("expires_at", seconds(), nullable=False),
        sa.Column("result", long_text(), nullable=True),
        sa.Index(f"ix_{name}_expires_at", "expires_at"),
        **TABLE_OPTIONS,
    )


def stored(key: DedupKey) -> tuple[str, str]:
    """The (namespace, key) as stored: as they are, or hashed when long or hash-like."""
    return stored_part(key.namespace), stored_part(key.key)


def stored_part(text: str) -> str:
    """One part of a key as stored."""
    # Databases refuse NUL in text and lone surrogates in UTF-8: those are hashed too.
    if len(text) <= READABLE_LIMIT and not text.startswith(_HASHED) and _storable(text):
        return text
    return _HASHED + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


__all__ = ["DEFAULT_TABLE", "READABLE_LIMIT", "processed_table", "stored", "stored_part"]
