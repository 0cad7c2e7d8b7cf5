"""The brokers the command operates on, one entry each in :data:`BROKERS`.

The global options, the check of their values, the choice of adapter and the first call that
proves the broker answers all follow from an entry: another adapter is one more entry (its
option, its URL schemes, a function that builds it), and nothing else changes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..errors import ConfigurationError
from ..ports import Adapter

# A topic no one uses: asking whether it exists costs one round trip and changes nothing.
PROBE_TOPIC = "reliable-sub-cli-probe"
# The connection name servers show for the command (nats server report connections ...).
CLIENT_NAME = "reliable-sub-cli"
PUBSUB_ENDPOINT = "pubsub.googleapis.com:443"


async def ask_for_a_topic(value: str, adapter: Adapter) -> None:
    """Probe for most brokers: whether a topic exists (any answer proves the broker is there)."""
    await adapter.topic_exists(PROBE_TOPIC)


@dataclass(frozen=True)
class Broker:
    """One broker the command can operate on.

    Attributes:
        option: its global option (``--redis-url``); the environment variable is
            ``RELIABLE_SUB_`` and the option's name in capitals (``RELIABLE_SUB_REDIS_URL``).
        help: the option's help text.
        build: makes the adapter from the option's value and the ``--<name>-prefix`` value.
        schemes: the URL schemes the value may have (checked before the adapter sees it);
            empty when the value is no URL.
        prefix: the default of a ``--<name>-prefix`` option (the adapter's key prefix), or
            None for an adapter without one.
        probe: one call that must get an answer from the broker within --connect-timeout
            before the command starts (any answer will do: a refusal proves it is there).
        settings: more options of this broker, as (option, help, URL schemes, or None for a
            value that is no URL); their values (URLs checked against those schemes first)
            reach ``build`` as keyword arguments named after the option, when given.
        prefix_name: the prefix option when not ``--<name>-prefix`` (``--sqs-queue-prefix``).
    """

    option: str
    help: str
    build: Callable[..., Adapter]
    schemes: tuple[str, ...] = ()
    prefix: str | None = None
    probe: Callable[[str, Adapter], Awaitable[None]] = ask_for_a_topic
    settings: tuple[tuple[str, str, tuple[str, ...] | None], ...] = ()
    prefix_name: str | None = None

    @property
    def param(self) -> str:
        """The option's parameter name (``redis_url``)."""
        return param_of(self.option)

    @property
    def setting_params(self) -> list[str]:
        """The parameter names of :attr:`settings`."""
        return [param_of(option) for option, _, _ in self.settings]

    @property
    def envvar(self) -> str:
        return f"RELIABLE_SUB_{self.param.upper()}"

    @property
    def prefix_option(self) -> str:
        """``--redis-prefix`` for ``--redis-url`` (or :attr:`prefix_name`)."""
        return self.prefix_name or f"--{self.param.split('_')[0]}-prefix"

    @property
    def prefix_param(self) -> str:
        return self.prefix_option.removeprefix("--").replace("-", "_")


def param_of(option: str) -> str:
    """An option's parameter name: ``--redis-url`` -> ``redis_url``."""
    return option.removeprefix("--").replace("-", "_")


def _redis(url: str, prefix: str | None) -> Adapter:
    from ..adapters.redis_streams import RedisStreamsAdapter

    assert prefix is not None
    return RedisStreamsAdapter(url, consumer=CLIENT_NAME, key_prefix=prefix)


def _nats(url: str, prefix: str | None) -> Adapter:
    from ..adapters.nats_jetstream import NatsJetStreamAdapter

    assert prefix is not None
    return NatsJetStreamAdapter(url, prefix=prefix, name=CLIENT_NAME)


def _rabbitmq(url: str, prefix: str | None, amqp_management_url: str | None = None) -> Adapter:
    from ..adapters.rabbitmq import RabbitMQAdapter

    assert prefix is not None
    return RabbitMQAdapter(url, prefix=prefix, name=CLIENT_NAME,
                           management_url=amqp_management_url)


def _kafka(bootstrap: str, prefix: str | None) -> Adapter:
    from ..adapters.kafka import KafkaAdapter

    assert prefix is not None
    return KafkaAdapter(bootstrap, prefix=prefix, client_id=CLIENT_NAME)


def _sqs(endpoint: str, prefix: str | None, sqs_region: str | None = None) -> Adapter:
    from ..adapters.sqs import SqsAdapter

    return SqsAdapter(endpoint_url=endpoint, region_name=sqs_region, queue_prefix=prefix or "")


def _pubsub(project: str, _prefix: str | None) -> Adapter:
    from ..adapters.pubsub import PubSubAdapter

    return PubSubAdapter(project)


async def _reach_pubsub(project: str, adapter: Adapter) -> None:
    """Pub/Sub's admin calls block a thread and retry for a minute: instead, credentials (off
    the emulator), a TCP connection (a refusal is known at once), then a gRPC channel ready
    (a server that takes the connection and never speaks HTTP/2 is not)."""
    import grpc

    host = os.environ.get("PUBSUB_EMULATOR_HOST")
    if not host:
        import google.auth

        google.auth.default()  # DefaultCredentialsError: no credentials to call with
    name, _, port = (host or PUBSUB_ENDPOINT).rpartition(":")
    if not name or not port.isdigit():
        raise ConfigurationError(
            f"PUBSUB_EMULATOR_HOST {host!r} must be host:port, e.g. 127.0.0.1:8085")
    _, writer = await asyncio.open_connection(name.strip("[]"), int(port))
    writer.close()
    await writer.wait_closed()
    channel = (grpc.aio.insecure_channel(host) if host else
               grpc.aio.secure_channel(PUBSUB_ENDPOINT, grpc.ssl_channel_credentials()))
    try:
        await channel.channel_ready()
    finally:
        await channel.close()


REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")

BROKERS: tuple[Broker, ...] = (
    Broker("--redis-url", "The Redis Streams broker (redis://host:port/db, or "
           "redis+cluster://host:port for a cluster).", _redis, REDIS_SCHEMES,
           prefix="reliable-sub"),
    Broker("--nats-url", "The NATS JetStream broker (nats://host:port; several "
           "comma-separated for a cluster).", _nats, ("nats", "tls", "ws", "wss"),
           prefix="reliable-sub"),
    Broker("--amqp-url", "The RabbitMQ broker (amqp://user:password@host:port/vhost).",
           _rabbitmq, ("amqp", "amqps"), prefix="reliable-sub",
           settings=(("--amqp-management-url", "The RabbitMQ management plugin's URL "
                      "(http://user:password@host:15672/): stats then show backlog and "
                      "in-flight figures.", ("http", "https")),)),
    Broker("--kafka-bootstrap", "The Kafka cluster's bootstrap servers (host:port, several "
           "comma-separated).", _kafka, prefix="reliable-sub"),
    Broker("--sqs-endpoint", "The Amazon SQS endpoint (https://sqs.REGION.amazonaws.com, or a "
           "local server's http://host:port); region and credentials from the usual AWS "
           "settings.", _sqs, ("http", "https"), prefix="", prefix_name="--sqs-queue-prefix",
           settings=(("--sqs-region", "The AWS region (default: AWS_DEFAULT_REGION, the "
                      "profile's, else AWS_REGION).", None),)),
    Broker("--pubsub-project", "The Pub/Sub project (PUBSUB_EMULATOR_HOST selects the "
           "emulator).", _pubsub, probe=_reach_pubsub),
)


__all__ = ["BROKERS", "REDIS_SCHEMES", "Broker"]
