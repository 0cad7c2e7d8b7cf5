"""Every adapter, imported without the client its extra installs, raises MissingExtraError
naming the pip install (#47: the nats extra raised a bare ModuleNotFoundError, because a private
module importing nats-py was imported before the guarded block). One subprocess per adapter,
the client's top-level package made unimportable (``sys.modules[name] = None``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

ADAPTERS = [
    ("reliable_sub.adapters.nats_jetstream", "nats", "nats"),
    ("reliable_sub.adapters.rabbitmq", "aio_pika", "rabbitmq"),
    ("reliable_sub.adapters.rabbitmq", "aiormq", "rabbitmq"),
    ("reliable_sub.adapters.redis_streams", "redis", "redis"),
    ("reliable_sub.adapters.pubsub", "google", "pubsub"),
    ("reliable_sub.adapters.kafka", "confluent_kafka", "kafka"),
    ("reliable_sub.adapters.sqs", "aiobotocore", "sqs"),
    ("reliable_sub.adapters.sqs", "botocore", "sqs"),
]


@pytest.mark.parametrize(("module", "client", "extra"), ADAPTERS)
def test_an_adapter_without_its_client_names_the_extra(module: str, client: str,
                                                       extra: str) -> None:
    script = (
        f"import sys; sys.modules[{client!r}] = None\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error)\n"
        "else:\n"
        "    print('imported without the client')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MissingExtraError "), result.stdout + result.stderr
    assert f'pip install "reliable-sub[{extra}]"' in result.stdout, result.stdout
