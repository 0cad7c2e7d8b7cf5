"""The SQS adapter's clients: aiobotocore per event loop, boto3 for the blocking twins, and the
one place their settings and errors are read.

Settings come as boto3 users expect them: the endpoint from ``endpoint_url=``, else
``AWS_ENDPOINT_URL_SQS`` / ``AWS_ENDPOINT_URL`` or the profile (botocore reads them); the
region from ``region_name=``, else ``AWS_DEFAULT_REGION`` or the profile, else ``AWS_REGION``
(which botocore does not read, but Lambda and ECS set); credentials from the usual chain unless
given. The retry mode is ``standard`` unless ``AWS_RETRY_MODE`` names another (botocore's own
default, ``legacy``, retries fewer errors); ``AWS_MAX_ATTEMPTS`` is honoured.

Errors are told apart by their code as botocore reads it: ``QueryErrorCode`` when the service
sends one (AWS, query-compatible JSON: ``Code`` is then the legacy
``AWS.SimpleQueueService.NonExistentQueue``), else ``Code`` (ElasticMQ): the same names on AWS
and on the local servers.

Calls that take several steps (creating a queue, resolving a subscription) are written once, as
generators of ``(operation, parameters)`` (``Steps``), and driven by either client.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import boto3
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.config import Config
from botocore.exceptions import ClientError

from reliable_sub.errors import AccessDeniedError, ConfigurationError

if TYPE_CHECKING:
    from types_aiobotocore_sqs import SQSClient as AsyncSQSClient
    from types_boto3_sqs import SQSClient as SyncSQSClient

T = TypeVar("T")

# Connections one client keeps: the receives, deletes and visibility changes in flight together.
DEFAULT_POOL = 50
# Seconds to connect; a read waits longer than SQS's longest poll (20 s).
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 40.0
DEFAULT_RETRY_MODE = "standard"

QUEUE_DOES_NOT_EXIST = "QueueDoesNotExist"
QUEUE_EXISTS = frozenset({"QueueAlreadyExists", "QueueNameExists"})
ACCESS_DENIED = frozenset({"AccessDenied", "AccessDeniedException",
                           "AuthorizationError", "InvalidClientTokenId", "InvalidSecurity"})

# One step of a call: an SQS operation (the client's method name) and its parameters.
Call = tuple[str, dict[str, Any]]
Steps = Generator[Call, dict[str, Any], T]


def error_code(error: ClientError) -> str:
    """The error's name, the same on AWS and the local servers (see the module's docstring)."""
    found = error.response.get("Error", {})
    return str(found.get("QueryErrorCode") or found.get("Code") or "")


def access_checked(error: ClientError, what: str) -> Exception:
    """``error`` as an AccessDeniedError naming ``what`` when it is one, else ``error``."""
    if error_code(error) in ACCESS_DENIED:
        return AccessDeniedError(f"SQS refused {what}: {error}; grant the caller the SQS "
                                 "permission it names")
    return error


@dataclass(frozen=True)
class Settings:
    """What both clients are made with."""

    endpoint_url: str | None
    region_name: str
    options: dict[str, str] = field(default_factory=dict)  # profile and credentials
    pool: int = DEFAULT_POOL

    def config_values(self) -> dict[str, Any]:
        retries: dict[str, Any] = {}
        if not os.environ.get("AWS_RETRY_MODE"):
            retries["mode"] = DEFAULT_RETRY_MODE
        return {"max_pool_connections": self.pool, "connect_timeout": CONNECT_TIMEOUT,
                "read_timeout": READ_TIMEOUT, "retries": retries}

    def client_arguments(self) -> dict[str, Any]:
        arguments: dict[str, Any] = {"region_name": self.region_name}
        if self.endpoint_url:
            arguments["endpoint_url"] = self.endpoint_url
        arguments.update({k: v for k, v in self.options.items() if k != "profile_name"})
        return arguments

    def endpoint(self) -> str:
        """The endpoint the clients go to (for spans)."""
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_SQS")
                or os.environ.get("AWS_ENDPOINT_URL")
                or f"https://sqs.{self.region_name}.amazonaws.com")


def settings_of(endpoint_url: str | None, region_name: str | None, profile_name: str | None,
                credentials: dict[str, str], pool: int) -> Settings:
    """The clients' settings, or a ConfigurationError naming what is missing."""
    if endpoint_url is not None:
        parts = urlsplit(endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(
                f"SqsAdapter.endpoint_url must be an http:// or https:// URL, got "
                f"{endpoint_url!r}")
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 1:
        raise ConfigurationError(f"SqsAdapter.max_pool_connections must be an int >= 1, got "
                                 f"{pool!r}")
    region = region_name
    if region is None:
        session = boto3.session.Session(profile_name=profile_name)
        region = session.region_name or os.environ.get("AWS_REGION")
    if not region:
        raise ConfigurationError(
            "SqsAdapter needs an AWS region: pass region_name=, or set AWS_DEFAULT_REGION "
            "(or a region in your AWS profile)")
    options = dict(credentials)
    if profile_name is not None:
        options["profile_name"] = profile_name
    return Settings(endpoint_url, region, options, pool)


# botocore's data loader (the service models it read from disk, and caches): one for every
# session of the process. A session per event loop keeps credentials that refresh (their locks
# belong to a loop) apart; loading the models again cost ~60 ms a new loop, seconds on a loaded
# machine, inside the first receive call's bound.
_loader: Any = None
_loader_lock = threading.Lock()


def _share_the_loader(session: Any) -> None:
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _loader)


class AsyncClient:
    """One event loop's aiobotocore client, made on first use; counts its requests."""

    def __init__(self, settings: Settings, counts: dict[str, int]) -> None:
        self._settings = settings
        self._counts = counts
        self._lock = asyncio.Lock()
        self._context: Any = None
        self._client: AsyncSQSClient | None = None

    async def get(self) -> AsyncSQSClient:
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                session = get_session()
                _share_the_loader(session)
                profile = self._settings.options.get("profile_name")
                if profile is not None:
                    session.set_config_variable("profile", profile)
                context = session.create_client(
                    "sqs", config=AioConfig(**self._settings.config_values()),
                    **self._settings.client_arguments())
                client = await context.__aenter__()
                client.meta.events.register("request-created.sqs", self._count)
                self._context, self._client = context, client
        return self._client

    def _count(self, **_: Any) -> None:
        self._counts["requests"] += 1

    async def close(self) -> None:
        context, self._context, self._client = self._context, None, None
        if context is not None:
            await context.__aexit__(None, None, None)


class SyncClient:
    """The blocking twins' boto3 client, made on first use (boto3 clients are thread-safe)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._client: SyncSQSClient | None = None

    def get(self) -> SyncSQSClient:
        with self._lock:
            if self._client is None:
                session = boto3.session.Session(
                    profile_name=self._settings.options.get("profile_name"))
                self._client = session.client(
                    "sqs", config=Config(**self._settings.config_values()),
                    **self._settings.client_arguments())
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


async def run_async(steps: Steps[T], client: AsyncSQSClient) -> T:
    """Drive ``steps`` with the aiobotocore client (a ClientError goes back into them)."""
    reply: dict[str, Any] | None = None
    error: ClientError | None = None
    while True:
        try:
            operation, parameters = (steps.send(reply) if error is None  # type: ignore[arg-type]
                                     else steps.throw(error))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            reply, error = await getattr(client, operation)(**parameters), None
        except ClientError as failed:
            reply, error = None, failed


def run_sync(steps: Steps[T], client: SyncSQSClient) -> T:
    """Drive ``steps`` with the boto3 client."""
    reply: dict[str, Any] | None = None
    error: ClientError | None = None
    while True:
        try:
            operation, parameters = (steps.send(reply) if error is None  # type: ignore[arg-type]
                                     else steps.throw(error))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            reply, error = getattr(client, operation)(**parameters), None
        except ClientError as failed:
            reply, error = None, failed
