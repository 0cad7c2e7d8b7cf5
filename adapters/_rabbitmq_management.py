"""A subscription's figures from RabbitMQ's management plugin (its HTTP API), for
``RabbitMQAdapter(management_url=...)``.

AMQP tells a queue's *ready* messages only; the management API tells the rest. One request per
reading, ``GET /api/queues/{vhost}?name=...&use_regex=true`` (the name filter works on a paged
listing only), lists the subscription's queue and its delay queues with ``messages`` (ready and
unacked) and ``messages_unacknowledged``:

* backlog: ``messages`` of the queue and of its delay queues, as on the other brokers (a message
  nacked with a delay waits in a delay queue, and is not yet acked);
* in flight: the queue's ``messages_unacknowledged``: delivered to a consumer and not yet acked
  -- with a consumer's prefetch, also what the broker pushed ahead that no handler has yet;
* the oldest message's age: unknown. The API tells ``head_message_timestamp`` (the ``timestamp``
  property of the next message to deliver, not of the oldest unacked one) for classic queues
  only; for quorum queues (a subscription's) it tells nothing (RabbitMQ 3.10).

The figures are the broker's statistics, which trail by up to 10 s with RabbitMQ's defaults:
queues write theirs every 5 s (``collect_statistics_interval``; a quorum queue on its tick,
``quorum_tick_interval``) and the management agent collects them every 5 s (its shortest
``sample_retention_policies`` interval). A queue declared within that time has none yet: its
figures read as unknown. A listing costs the broker a pass over the vhost's queues (27 ms with
2,000 queues on the machine of the tests; a queue read by name, 1 ms).

A management API that does not answer (down, refusing, hung past ``timeout``, an error status,
credentials refused) leaves the figures unknown: it is logged once when it starts and once when
it answers again, never per reading.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, quote, unquote, urlencode, urlsplit

from reliable_sub.errors import ConfigurationError

# the adapter's logger, as _rabbitmq_link's
logger = logging.getLogger("reliable_sub.adapters.rabbitmq")

# Seconds a reading may take before its figures are unknown: the API answers in a few ms.
DEFAULT_TIMEOUT = 5.0
# One page holds the queue and every delay queue (about 40 lengths reach a day); the API's most.
_PAGE_SIZE = 500
# A filtered listing is a few hundred bytes: a larger answer is not the management API's.
_MOST_BYTES = 1 << 20
_COLUMNS = "name,messages,messages_unacknowledged"
_EXAMPLE = "'http://guest:guest@127.0.0.1:15672/'"


@dataclass(frozen=True)
class Figures:
    """A subscription's queue as the management API lists it (None: not told yet)."""

    backlog: int | None
    in_flight: int | None


class Unlisted(LookupError):
    """The management API lists no queue of that name in the vhost."""


class ManagementAPI:
    """Reads queues' figures from the management API at ``url`` (credentials from its
    ``user:password@``, else from ``amqp_url``'s, else guest/guest), in the vhost of
    ``amqp_url``."""

    def __init__(self, url: object, amqp_url: str, prefix: str,
                 timeout: object = DEFAULT_TIMEOUT) -> None:
        parts = _checked(url)
        if not (isinstance(timeout, int | float) and not isinstance(timeout, bool)
                and timeout > 0 and math.isfinite(timeout)):
            raise ConfigurationError(f"RabbitMQAdapter.management_timeout must be seconds > 0, "
                                     f"got {timeout!r}")
        amqp = urlsplit(amqp_url)
        login = parts if parts.username is not None else amqp
        user = unquote(login.username) if login.username is not None else "guest"
        password = unquote(login.password) if login.password is not None else (
            "" if login is parts else "guest")
        self._authorization = "Basic " + base64.b64encode(
            f"{user}:{password}".encode()).decode("ascii")
        self.vhost = unquote(amqp.path[1:]) or "/"
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            netloc += f":{parts.port}"
        self.shown = f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}/"  # no password
        self._listing = f"{self.shown}api/queues/{quote(self.vhost, safe='')}"
        self._prefix = prefix
        self.timeout = float(timeout)
        # no proxy from the environment (the API is reached as the AMQP port is, directly) and
        # no redirect (the credentials go to the URL given only)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                                   _NoRedirect())
        self._failing: str | None = None  # why the last reading failed (logged once)
        self._unlisted: set[str] = set()  # queues the API did not list (logged once each)

    async def figures(self, queue: str) -> Figures | None:
        """``queue``'s figures, or None when the API did not answer (logged once per outage);
        :class:`Unlisted` when it answered without the queue."""
        try:
            listed = await asyncio.wait_for(asyncio.to_thread(self._list, queue), self.timeout)
        except Exception as error:
            self._failed(error)
            return None
        if self._failing is not None:
            self._failing = None
            logger.info("the RabbitMQ management API at %s answers again", self.shown)
        rows = {row["name"]: row for row in listed if isinstance(row.get("name"), str)}
        if queue not in rows:
            raise Unlisted(queue)
        self._unlisted.discard(queue)
        backlog: int | None = 0
        for row in rows.values():
            backlog = _plus(backlog, row.get("messages"))
        return Figures(backlog, _plus(0, rows[queue].get("messages_unacknowledged")))

    def _list(self, queue: str) -> list[dict[str, Any]]:
        """The rows of ``queue`` and its delay queues (blocking: run in a thread)."""
        delays = re.escape(f"{self._prefix}.delay.{queue}.")
        pattern = f"^(?:{re.escape(queue)}|{delays}[0-9]+)$"
        query = urlencode({"page": 1, "page_size": _PAGE_SIZE, "use_regex": "true",
                           "name": pattern, "columns": _COLUMNS})
        request = urllib.request.Request(f"{self._listing}?{query}", headers={
            "Authorization": self._authorization, "Accept": "application/json"})
        with self._opener.open(request, timeout=self.timeout) as response:
            body = response.read(_MOST_BYTES + 1)
        if len(body) > _MOST_BYTES:
            raise ValueError(f"an answer of over {_MOST_BYTES} bytes")
        page = json.loads(body)
        items = page.get("items") if isinstance(page, dict) else None
        if not isinstance(items, list) or page.get("filtered_count") != len(items):
            raise ValueError(f"not a listing of one page: {str(page)[:200]}")
        # the API matches names ignoring case (RabbitMQ 3.10): 'Orders' is another queue
        exact = re.compile(pattern)
        return [row for row in items if isinstance(row, dict)
                and isinstance(row.get("name"), str) and exact.fullmatch(row["name"])]

    def _failed(self, error: BaseException) -> None:
        why = _why(error)
        if self._failing is None:
            logger.warning("the RabbitMQ management API at %s did not answer (%s): backlog "
                           "figures are unknown until it does", self.shown, why)
        self._failing = why

    @property
    def failing(self) -> str | None:
        """Why the last reading failed (None: it answered)."""
        return None if self._failing is None else (
            f"the RabbitMQ management API at {self.shown} did not answer ({self._failing})")

    def warn_unlisted(self, queue: str) -> None:
        """The API answered without ``queue``, which AMQP finds: another broker's API?"""
        if queue in self._unlisted:
            return
        self._unlisted.add(queue)
        logger.warning("the RabbitMQ management API at %s lists no queue %r in vhost %r, which "
                       "the broker has: does management_url point at the broker of the AMQP "
                       "URL? Its figures are unknown", self.shown, queue, self.vhost)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx is raised as an HTTPError


def _plus(total: int | None, value: object) -> int | None:
    """``total + value``, or None when either is unknown (no figure from the broker yet)."""
    if total is None or not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return None
    return total + value


def _why(error: BaseException) -> str:
    if isinstance(error, TimeoutError | asyncio.TimeoutError):
        return "no answer within the management timeout"
    if isinstance(error, urllib.error.HTTPError):
        if error.code in (401, 403):
            return (f"HTTP {error.code}: the user is refused; it needs the 'monitoring' or "
                    "'management' tag and access to the vhost")
        return f"HTTP {error.code} {error.reason}"
    if isinstance(error, urllib.error.URLError):
        return str(error.reason)
    return f"{type(error).__name__}: {error}"


def _checked(url: object) -> SplitResult:
    """``url`` split, if it is the http(s) URL of a host; else a ConfigurationError."""
    fix = f"give the management plugin's http:// or https:// URL, e.g. {_EXAMPLE}"
    if not isinstance(url, str):
        raise ConfigurationError(f"RabbitMQAdapter.management_url must be a str; {fix}; got "
                                 f"{type(url).__name__} {url!r}")
    parts = urlsplit(url)
    shown = repr(re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url))
    if parts.scheme not in ("http", "https"):
        raise ConfigurationError(f"RabbitMQAdapter.management_url {shown} is not an http:// "
                                 f"or https:// URL ({fix}; the AMQP URL is the first argument)")
    try:
        port = parts.port  # ValueError for a port that is no number up to 65535
    except ValueError:
        port = 0
    if port == 0:
        raise ConfigurationError(f"RabbitMQAdapter.management_url {shown} has a port that is "
                                 f"not a number from 1 to 65535; {fix}")
    if not parts.hostname or parts.query or parts.fragment:
        raise ConfigurationError(f"RabbitMQAdapter.management_url {shown} must name a host, "
                                 f"with no query or fragment; {fix}")
    return parts
