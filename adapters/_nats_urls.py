"""Reading the NATS adapter's URL: the servers it names, each of a scheme nats-py can use.

nats-py takes any string: ``redis://host:6379`` becomes a server named ``redis`` on port 4222,
and the call fails later, far from the mistake, as a connection that cannot be made. A
comma-separated string (several servers of a cluster) it refuses as an "invalid connect url
option"; it wants a list. So the adapter reads its URL once, at construction.
"""

from __future__ import annotations

from reliable_sub.errors import ConfigurationError

# nats-py's schemes: plain TCP, TLS, WebSocket and WebSocket over TLS. A server without a
# scheme (``host:port``) is taken as nats://, as nats-py does.
SCHEMES = ("nats", "tls", "ws", "wss")
_WEBSOCKET = ("ws://", "wss://")
_USE = ("a NATS URL is nats://host:port (tls:// for TLS, ws:// or wss:// for a WebSocket), or "
        "several of them comma-separated for a cluster")


def servers_of(url: str) -> list[str]:
    """The servers ``url`` names (comma-separated for a cluster); ConfigurationError if one
    has a scheme nats-py cannot use, or if WebSocket and other servers are mixed."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(f"NatsJetStreamAdapter needs a URL, got {url!r}; {_USE}")
    servers = [part.strip() for part in url.split(",")]
    for server in servers:
        scheme, separator, _ = server.partition("://")
        if not server or (separator and scheme not in SCHEMES):
            got = f"scheme {scheme + '://'!r}" if separator else "an empty server"
            raise ConfigurationError(
                f"NatsJetStreamAdapter cannot use {shown(url)!r} ({got}); {_USE}")
    if len({server.startswith(_WEBSOCKET) for server in servers}) > 1:
        raise ConfigurationError(
            f"NatsJetStreamAdapter cannot use {shown(url)!r}: it mixes WebSocket servers "
            "(ws://, wss://) with others, and nats-py connects to one kind")
    return servers


def shown(url: str) -> str:
    """``url`` with every password in it as ``***``."""
    return ",".join(_without_password(server) for server in url.split(","))


def _without_password(server: str) -> str:
    scheme, separator, rest = server.partition("://")
    credentials, at, hosts = rest.rpartition("@")
    if not at or ":" not in credentials:
        return server
    user = credentials.partition(":")[0]
    return f"{scheme}{separator}{user}:***@{hosts}"
