"""URLs as the command's options give them: checked before any client sees them, and shown in
messages without their passwords."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from ..errors import ConfigurationError

# user:password@ in a URL's authority (one of several, for a list of servers)
_PASSWORD = re.compile(r"(://[^:/@,]*:)[^@/,]*@")
_HIGHEST_PORT = 65535


def shown(value: str) -> str:
    """``value`` with any password replaced by ``***``, quoted, for a message."""
    return repr(_PASSWORD.sub(r"\1***@", value))


def scheme_of(value: str) -> str | None:
    """The scheme of ``value`` (``"redis"`` of ``redis://...``), or None without one."""
    scheme, separator, _ = value.partition("://")
    return scheme.lower() if separator else None


def check_url(option: str, value: str, schemes: tuple[str, ...] | None,
              example: str = "") -> str:
    """``value`` if it is a URL of one of ``schemes`` (None: of any scheme, left to the client
    to judge; ``example`` shows one) whose ports are numbers a server can listen on; else a
    ConfigurationError naming ``option``, the value and what is allowed.

    Several servers may be given, comma-separated, each a URL or (after the first) a bare
    ``host:port`` (``nats://a:4222,nats://b:4222``, ``redis+cluster://a:7000,b:7001``).
    """
    allowed = (f"use one of {', '.join(f'{scheme}://' for scheme in schemes)}" if schemes
               else f"use a URL such as {example}")
    first, *others = value.split(",")
    scheme = scheme_of(first)
    if scheme is None or (schemes is not None and scheme not in schemes):
        got = f"{scheme}://" if scheme else "no scheme"
        raise ConfigurationError(
            f"{option} {shown(value)} is not a URL this option takes ({got}); {allowed}")
    for part in (first, *others):
        if scheme_of(part) is None:
            part = f"{scheme}://{part}"
        elif schemes is not None and scheme_of(part) not in schemes:
            raise ConfigurationError(
                f"{option} {shown(value)}: {shown(part)} is not a URL this option takes; "
                f"{allowed}")
        if scheme == "unix":
            continue  # a socket path, no port
        _check_port(option, value, part)
    return value


def _check_port(option: str, value: str, part: str) -> None:
    authority = urlsplit(part)
    try:
        port = authority.port
    except ValueError:  # not a number, or beyond 65535
        port = -1
    if port is not None and not 0 < port <= _HIGHEST_PORT:
        written = authority.netloc.rpartition("@")[2].rpartition(":")[2]
        raise ConfigurationError(
            f"{option} {shown(value)} has port {written!r}; a port is a number from 1 to "
            f"{_HIGHEST_PORT}")


__all__ = ["check_url", "scheme_of", "shown"]
