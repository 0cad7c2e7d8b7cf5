"""What the RabbitMQ adapter says when a connection cannot be opened: one of our errors naming
what was wrong and the fix, the client's own kept as the cause.

aio-pika and aiormq say these things in their own words: refused credentials are a
``ProbableAuthenticationError`` (a ``ConnectionError``, so they read as an outage); a virtual
host that does not exist, or that the user may not use, is an ``InvalidFrameError`` about an
unexpected ``Connection.Close``, with a 120-line traceback; a server that is not RabbitMQ and
waits for a line (Redis) is a bare ``TimeoutError``. aiormq also logs an ERROR of its own for each
connection that fails before ours is raised (``error when creating transport``), once per
reconnect attempt in an outage: :class:`QuietTransportErrors` leaves that to us (it is kept when
aiormq's logger is set to DEBUG).
"""

from __future__ import annotations

import logging
from urllib.parse import unquote, urlsplit

from aiormq.exceptions import AMQPConnectionError, InvalidFrameError, ProbableAuthenticationError

from reliable_sub.errors import CredentialsRefusedError


def _where(url: str) -> tuple[str, str, str]:
    """The user, ``host:port`` and virtual host of an AMQP URL (never its password)."""
    parts = urlsplit(url)
    secure = parts.scheme == "amqps"
    port = parts.port or (5671 if secure else 5672)
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    return unquote(parts.username or "guest"), f"{parts.hostname or 'localhost'}:{port}", vhost


def connect_error(error: BaseException, url: str, timeout: float) -> Exception | None:
    """Ours for a failed ``aio_pika.connect`` (None: let the client's error go as it is)."""
    user, where, vhost = _where(url)
    if isinstance(error, ProbableAuthenticationError):
        return CredentialsRefusedError(
            f"RabbitMQ at {where} refused the credentials of user {user!r} ({error.args[0]}); "
            "check the user and password in the URL")
    if isinstance(error, InvalidFrameError) and "Connection.Close" in str(error):
        return CredentialsRefusedError(
            f"RabbitMQ at {where} refused virtual host {vhost!r}: it does not exist, or user "
            f"{user!r} may not use it (rabbitmqctl list_vhosts, list_user_permissions "
            f"{user}); the URL's path names it ('/' is %2F, or no path)")
    if isinstance(error, TimeoutError):
        return ConnectionError(
            f"RabbitMQ at {where} did not complete the AMQP handshake within {timeout:g}s: a "
            "server that is not RabbitMQ on that port (5672 is AMQP's), or one that is stalled")
    if isinstance(error, AMQPConnectionError):
        cause = error.__cause__ or error
        if isinstance(cause, ConnectionRefusedError):
            return ConnectionError(f"RabbitMQ at {where} refused the connection (nothing "
                                   f"listens on that port?): {cause}")
        return ConnectionError(f"the connection to RabbitMQ at {where} failed: {cause}")
    return None


class QuietTransportErrors(logging.Filter):
    """Drops aiormq's ``error when creating transport`` records unless its logger is at DEBUG:
    the adapter raises the failure itself, and the Subscriber logs one line per outage."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("error when creating transport"):
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_aiormq() -> None:
    """Install :class:`QuietTransportErrors` on aiormq's connection logger (once)."""
    client = logging.getLogger("aiormq.connection")
    if not any(isinstance(found, QuietTransportErrors) for found in client.filters):
        client.addFilter(QuietTransportErrors())


__all__ = ["QuietTransportErrors", "connect_error", "quiet_aiormq"]
