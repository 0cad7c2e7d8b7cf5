"""The fault-injection scenarios: marked ``chaos``; with ``RELIABILITY_REPORT=1`` a session
that ran them rewrites the table in ``docs/reliability.md``.

Scenarios run one at a time in each lane (``lane_of``: the Pub/Sub emulator's, PostgreSQL's,
Redis Streams', the Redis dedup store's size check, RabbitMQ's, Kafka's): under xdist each lane
is one unit of work, sent to one worker (see ``pytest_xdist_make_scheduler`` in
``tests/conftest.py``), so the other workers run the other tests instead of waiting; and each
scenario holds its lane's lock file while it runs, so two sessions never run two scenarios of a
lane at once. Each loads the machine with its own consumer processes; the Pub/Sub ones mostly
wait out the emulator's 10 s ack deadlines, so the lanes run side by side.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import lane_of, report
from tests.rabbitmq_processes import RabbitNode
from tests.redis_processes import RedisServer

HERE = Path(__file__).resolve().parent
LOCKS = Path(tempfile.gettempdir())


# A scenario runs 6-60 s alone; beside other tests on a busy machine longer, and under xdist it
# may first wait for the scenarios of the other workers.
SCENARIO_TIMEOUT = 420


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("RELIABILITY_REPORT") == "1" and config.getoption("numprocesses", None):
        raise pytest.UsageError("RELIABILITY_REPORT=1 needs one process: add -n 0 (each "
                                "worker would write its own rows, and their timings would "
                                "include the other workers' load)")
    report.begin(config.getoption("keyword", "") or "")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.chaos)
            item.add_marker(pytest.mark.timeout(SCENARIO_TIMEOUT))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("RELIABILITY_REPORT") == "1" and report.anything_recorded():
        report.write()


@pytest.fixture(autouse=True)
def one_scenario_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    with (LOCKS / f"reliable-sub-{lane_of(request.node.nodeid)}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, without persistence, killed at the end."""
    server = RedisServer(tmp_path, appendonly=False)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def private_rabbitmq(tmp_path: Path) -> Iterator[RabbitNode]:
    """A RabbitMQ node of the test's own (tests/rabbitmq_processes.py), to kill and restart:
    never the shared one. Killed at the end, its data with the test's directory."""
    node = RabbitNode(tmp_path)
    try:
        node.start()
        yield node
    finally:
        node.kill()
