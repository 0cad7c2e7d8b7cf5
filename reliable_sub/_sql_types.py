"""Column types of the library's tables that mean the same on every database it supports.

SQLAlchemy's generic types are right on PostgreSQL and SQLite, and wrong on MariaDB in three
ways that break the tables' promises: ``Float`` is a 4-byte ``FLOAT`` there (an epoch time read
back thousands of seconds off), ``Text``/``LargeBinary`` hold at most 64 KiB, and the server's
default collation takes ``abc``/``ABC``, ``e``/``é`` and ``a``/``a `` for the same key. Each
helper here keeps the generic type and adds the MariaDB variant. Import it only where the
``sql`` extra is needed.
"""

from __future__ import annotations

from typing import Any

from .errors import MissingExtraError

try:
    import sqlalchemy as sa
    from sqlalchemy.dialects import mysql
except ImportError as error:  # the sql extra is not installed
    raise MissingExtraError("The SQL store and outbox", "sql", "SQLAlchemy") from error

from ._sql_engines import MYSQL_DIALECTS

# Compares code points, byte for byte, trailing spaces included (a binary NO PAD collation).
EXACT_COLLATION = "utf8mb4_nopad_bin"
# Table options: every text column utf8mb4 (the server's default may be latin1 or utf8mb3).
TABLE_OPTIONS: dict[str, Any] = {"mysql_charset": "utf8mb4", "mariadb_charset": "utf8mb4"}


def exact_text(length: int, mysql_length: int | None = None) -> sa.types.TypeEngine[str]:
    """A string compared exactly (keys, owners). ``mysql_length``: a shorter length on
    MariaDB, where a primary key may take at most 3,072 bytes (4 per character)."""
    variant = mysql.VARCHAR(mysql_length or length, charset="utf8mb4", collation=EXACT_COLLATION)
    return sa.String(length).with_variant(variant, *MYSQL_DIALECTS)


def seconds() -> sa.types.TypeEngine[float]:
    """Epoch seconds: double precision everywhere."""
    return sa.Float().with_variant(mysql.DOUBLE(asdecimal=False), *MYSQL_DIALECTS)


def long_text() -> sa.types.TypeEngine[str]:
    """Text of any length (results, attributes, errors)."""
    return sa.Text().with_variant(mysql.LONGTEXT(charset="utf8mb4"), *MYSQL_DIALECTS)


def long_bytes() -> sa.types.TypeEngine[bytes]:
    """Bytes of any length (message bodies)."""
    return sa.LargeBinary().with_variant(mysql.LONGBLOB(), *MYSQL_DIALECTS)


__all__ = ["EXACT_COLLATION", "TABLE_OPTIONS", "exact_text", "long_bytes", "long_text",
           "seconds"]
