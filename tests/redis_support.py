"""Reaching the real Redis the tests run against, for every test module that needs one.

``redis_url()`` returns the URL after one PING with a short timeout. When Redis is unreachable
the calling test is skipped on a laptop and fails under ``CI=true``: in CI a missing service is a
failure, never a skip. Call it from a fixture or a test::

    @pytest.fixture
    def url() -> str:
        return redis_url()
"""

from __future__ import annotations

import functools
import os

import pytest

# RELIABLE_SUB_REDIS_URL points the tests at another Redis (or at none, to try laptop mode).
DEFAULT_REDIS_URL = os.environ.get("RELIABLE_SUB_REDIS_URL", "redis://127.0.0.1:6379/0")
# A local Redis answers a PING in well under a millisecond; this only bounds a black-holed host.
PING_TIMEOUT = 1.0


def redis_url(url: str = DEFAULT_REDIS_URL) -> str:
    """``url`` once Redis answers a PING there; else skip the test (fail it when ``CI=true``)."""
    problem = _ping(url)
    if problem is not None:
        message = f"Redis at {url} is unreachable: {problem}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
        pytest.skip(message)
    return url


def redis_available(url: str = DEFAULT_REDIS_URL) -> bool:
    """Whether Redis answers at ``url`` (no skip, no failure: for choosing what to run)."""
    return _ping(url) is None


@functools.cache
def _ping(url: str) -> str | None:
    """None when Redis at ``url`` answers a PING, else why not (asked once per process)."""
    try:
        import redis
    except ImportError:
        return 'the redis package is not installed (pip install "reliable-sub[redis]")'
    client = redis.Redis.from_url(
        url, socket_connect_timeout=PING_TIMEOUT, socket_timeout=PING_TIMEOUT
    )
    try:
        client.ping()
    except redis.RedisError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        client.close()
    return None
