"""What the command connects to, from its options or their environment variables: built with
the options' values checked first, and asked for one answer within --connect-timeout before
the command starts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

from ..errors import AdapterError, ConfigurationError
from ..ports import Adapter, DedupStore
from .brokers import BROKERS, REDIS_SCHEMES, Broker
from .failures import UNREACHABLE, CommandError
from .urls import check_url, scheme_of, shown

T = TypeVar("T")
SQL_EXAMPLE = (
    "postgresql://user@host:5432/db, mariadb://user@host:3306/db or sqlite:///path/to/file.db")
DEFAULT_CONNECT_TIMEOUT = 10.0


@dataclass
class Connection:
    """The broker, dedup store and database the command was pointed at (any may be None).

    ``brokers`` maps each of :data:`BROKERS`' parameters (``redis_url``) to its value, and
    ``prefixes`` each prefix parameter (``redis_prefix``) to its value.
    """

    brokers: dict[str, str | None] = field(default_factory=dict)
    prefixes: dict[str, str] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)  # the brokers' other options given
    database_url: str | None = None
    outbox_table: str = "reliable_sub_outbox"
    dedup_url: str | None = None
    dedup_prefix: str = "reliable-sub:dedup"
    dedup_table: str = "reliable_sub_processed"
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Connection:
        """From the command group's options (those of BROKERS and the others by name)."""
        brokers = {broker.param: options.pop(broker.param) or None for broker in BROKERS}
        prefixes = {broker.prefix_param: options.pop(broker.prefix_param)
                    for broker in BROKERS if broker.prefix is not None}
        names = [name for broker in BROKERS for name in broker.setting_params]
        settings = {name: value for name in names
                    if (value := options.pop(name, None)) is not None}
        return cls(brokers=brokers, prefixes=prefixes, settings=settings, **options)

    def broker(self) -> tuple[Broker, str]:
        """The one broker named, and its option's value."""
        named = [(broker, value) for broker in BROKERS
                 if (value := self.brokers.get(broker.param)) is not None]
        if len(named) != 1:
            options = " or ".join(f"{b.option} ({b.envvar})" for b in BROKERS)
            given = f"; got {', '.join(_given(b) for b, _ in named)}" if named else ""
            raise click.UsageError(f"name exactly one broker: {options}{given}")
        return named[0]

    def adapter(self) -> Adapter:
        """The adapter of the one broker named (its value checked first)."""
        broker, value = self.broker()
        if broker.schemes:
            check_url(broker.option, value, broker.schemes)
        prefix = self.prefixes.get(broker.prefix_param)
        for other in BROKERS:
            for (option, _, _), name in zip(other.settings, other.setting_params, strict=True):
                if other is not broker and name in self.settings:
                    raise click.UsageError(f"{option} is an option of {other.option}; the "
                                           f"broker named is {broker.option}")
        settings = {}
        for (option, _, schemes), name in zip(broker.settings, broker.setting_params,
                                              strict=True):
            if name in self.settings:  # a setting without schemes is no URL (a region)
                settings[name] = (self.settings[name] if schemes is None
                                  else check_url(option, self.settings[name], schemes))
        return _built(broker.option, value, lambda: broker.build(value, prefix, **settings))

    def prefix_hint(self) -> str:
        """For a name the broker does not know: the key prefix it was looked up under, when
        the broker has one (the consumers' may differ)."""
        named = [broker for broker in BROKERS if self.brokers.get(broker.param) is not None]
        if len(named) != 1 or named[0].prefix is None:
            return ""
        broker = named[0]
        prefix = self.prefixes.get(broker.prefix_param, broker.prefix)
        variable = f"RELIABLE_SUB_{broker.prefix_param.upper()}"
        return (f" (looked up under {broker.prefix_option} {prefix!r}: if the consumers use "
                f"another prefix, give theirs, or set {variable})")

    async def reach_adapter(self, adapter: Adapter) -> None:
        """Wait for the broker's first answer (at most --connect-timeout seconds)."""
        broker, value = self.broker()
        await self._reach(f"the broker ({broker.option} {shown(value)})",
                          broker.probe(value, adapter))

    def dedup_store(self) -> DedupStore:
        """The consumers' dedup store: Redis for a ``redis://`` URL, else SQL."""
        url = self.dedup_url
        if not url:
            raise click.UsageError(
                "this needs the consumers' dedup store: --dedup-url (RELIABLE_SUB_DEDUP_URL), "
                "a redis:// or database URL")
        if scheme_of(url) in REDIS_SCHEMES:
            check_url("--dedup-url", url, REDIS_SCHEMES)
            from ..dedup import RedisDedupStore

            return _built("--dedup-url", url,
                          lambda: RedisDedupStore(url, prefix=self.dedup_prefix))
        example = f"redis://host:6379/0 or {SQL_EXAMPLE}"
        check_url("--dedup-url", url, None, example)
        from ..dedup import SqlDedupStore

        return _built("--dedup-url", url, lambda: SqlDedupStore(url, table=self.dedup_table),
                      also="; a Redis store takes one of "
                           + ", ".join(f"{scheme}://" for scheme in REDIS_SCHEMES))

    async def reach_store(self, store: Any) -> None:
        """Wait for the dedup store's first answer (at most --connect-timeout seconds)."""
        url = self.dedup_url
        assert url is not None
        what = f"the dedup store (--dedup-url {shown(url)})"
        if scheme_of(url) in REDIS_SCHEMES:
            await self._reach(what, store.epoch(PROBE_NAMESPACE))
        else:
            await self._reach(what, _select_one(store))

    def outbox(self) -> Any:
        """The outbox in the database of ``--database-url``."""
        url = self.database_url
        if not url:
            raise click.UsageError(
                "this needs the outbox's database: --database-url (RELIABLE_SUB_DATABASE_URL)")
        check_url("--database-url", url, None, SQL_EXAMPLE)
        from ..outbox import Outbox

        return _built("--database-url", url, lambda: Outbox(url, table=self.outbox_table))

    async def reach_outbox(self, outbox: Any) -> None:
        """Wait for the outbox database's first answer (at most --connect-timeout seconds)."""
        assert self.database_url is not None
        await self._reach(f"the database (--database-url {shown(self.database_url)})",
                          _select_one(outbox))

    async def _reach(self, what: str, answer: Awaitable[object]) -> None:
        try:
            await asyncio.wait_for(answer, self.connect_timeout)
        except AdapterError:
            pass  # not found, access denied...: it answered, and the command says the rest
        except asyncio.TimeoutError:
            raise CommandError(UNREACHABLE, (
                f"{what} did not answer within {self.connect_timeout:g} s; check the host and "
                "port (a firewall may be dropping the packets), or give --connect-timeout "
                "more")) from None
        except OSError as error:  # refused, no route, no such host: before any protocol
            raise CommandError(UNREACHABLE, f"cannot reach {what}: {error}") from None


PROBE_NAMESPACE = "reliable-sub-cli-probe"


def _given(broker: Broker) -> str:
    """``--redis-url``, or ``RELIABLE_SUB_REDIS_URL`` when the value came from there."""
    context = click.get_current_context(silent=True)
    source = context.find_root().get_parameter_source(broker.param) if context else None
    return broker.envvar if source == click.core.ParameterSource.ENVIRONMENT else broker.option


async def _select_one(on_sql: Any) -> None:
    import sqlalchemy as sa

    async with on_sql.engine.connect() as connection:
        await connection.execute(sa.text("SELECT 1"))


def _built(option: str, value: str, build: Callable[[], T], also: str = "") -> T:
    """``build()``, its complaints about ``value`` as ConfigurationErrors naming ``option``
    (and saying ``also``).

    Building parses the value and connects to nothing, so what it raises (our
    ConfigurationError, a client's ValueError, SQLAlchemy's ArgumentError) is the value's fault.
    """
    try:
        return build()
    except Exception as error:
        # SQLAlchemy's ArgumentError: a URL it cannot parse
        if not isinstance(error, (ValueError, TypeError)) and (
                type(error).__name__ != "ArgumentError"):
            raise
        raise ConfigurationError(f"{option} {shown(value)}: {error}{also}") from error


__all__ = ["DEFAULT_CONNECT_TIMEOUT", "Connection"]
