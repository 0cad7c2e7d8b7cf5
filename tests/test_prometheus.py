"""The consumer metrics reach a real Prometheus server.

A Subscriber records into the OpenTelemetry Prometheus exporter (an HTTP endpoint on a free
loopback port); a private ``prometheus`` (the Debian package's binary) scrapes it every 200 ms;
the test then asks Prometheus's HTTP query API for the consumed-messages counter by outcome and
the processing-duration histogram. Without the binary the test is skipped on a laptop and fails
under ``CI=true`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reliable_sub import (
    DeadLetterPolicy,
    LeasePolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    RetryPolicy,
    Subscriber,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.outbox import OutboxRelay
from reliable_sub.testing.services import missing_service
from tests.memory_world import serve_until, setup
from tests.outbox_support import fresh_outbox
from tests.redis_processes import free_port

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "dashboard" / "reliable-sub.json"
# How long Prometheus may take to start, and to scrape what the Subscriber recorded.
START_TIMEOUT = 30.0
SCRAPE_TIMEOUT = 30.0
POLL = 0.1


class Prometheus:
    def __init__(self, directory: Path, target: int) -> None:
        executable = shutil.which("prometheus")
        if executable is None:
            missing_service("prometheus is not on PATH (Debian package prometheus)")
        self.port = free_port()
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 200ms\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: reliable-sub\n    scrape_interval: 200ms\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
        )
        self.log = (directory / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [str(executable), f"--config.file={config}",
             f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        give_up = time.monotonic() + START_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready",
                                            timeout=1) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > give_up:
                raise AssertionError(f"prometheus was not ready within {START_TIMEOUT}s")
            time.sleep(POLL)

    def query(self, expression: str) -> list[dict[str, Any]]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expression}))
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture
def exporter() -> Iterator[tuple[Any, int]]:
    """An SDK MeterProvider whose metrics an HTTP endpoint serves in Prometheus's format."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    reader = PrometheusMetricReader()
    registry.register(reader._collector)  # this test's own registry, not the process's
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    provider = MeterProvider(metric_readers=[reader])
    try:
        yield provider, port
    finally:
        provider.shutdown()
        server.shutdown()
        thread.join(timeout=10)


@pytest.fixture
def prometheus(tmp_path: Path, exporter: tuple[Any, int]) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path, exporter[1])
    try:
        yield server
    finally:
        server.stop()


def until(check: Any, what: str) -> Any:
    give_up = time.monotonic() + SCRAPE_TIMEOUT
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"Prometheus did not show {what} within {SCRAPE_TIMEOUT}s")
        time.sleep(POLL)


async def test_prometheus_shows_consumed_messages_by_outcome_and_processing_time(
    exporter: tuple[Any, int], prometheus: Prometheus,
) -> None:
    meter_provider, _ = exporter
    clock, broker, sub = setup(meter_provider=meter_provider, dedup=MemoryDedupStore(),
                               dead_letter=DeadLetterPolicy("orders-dlq", 1))
    del clock  # served on the real clock

    @sub.handler("billing")
    def charge(message: Message) -> None:
        if message.data == b"poison":
            raise ValueError("cannot parse")

    for data in (b"1", b"2", b"3", b"poison"):
        broker.publish_sync("orders", data)
    await serve_until(sub, lambda: sub.stats[Outcome.ACKED] == 3
                      and sub.stats[Outcome.DEAD_LETTERED] == 1, "the four messages")

    def consumed() -> dict[str, float] | None:
        found = {r["metric"].get("reliable_sub_outcome"): float(r["value"][1])
                 for r in prometheus.query("messaging_client_consumed_messages_total")}
        return found if found.get("acked") == 3 and found.get("dead_lettered") == 1 else None

    by_outcome = until(consumed, "the consumed-messages counter by outcome")
    per_subscription = ("sum by (messaging_destination_subscription_name) "
                        "(messaging_process_duration_seconds_count)")
    [count] = until(lambda: prometheus.query(per_subscription),
                    "the processing-duration histogram")
    assert by_outcome == {"acked": 3, "dead_lettered": 1}
    assert count["metric"]["messaging_destination_subscription_name"] == "billing"
    assert float(count["value"][1]) == 4, "four handler runs timed"
    buckets = prometheus.query("messaging_process_duration_seconds_bucket")
    assert {r["metric"]["le"] for r in buckets} >= {"0.005", "10.0", "+Inf"}


async def test_every_dashboard_query_returns_data_after_a_run(
    exporter: tuple[Any, int], prometheus: Prometheus,
) -> None:
    """examples/dashboard's queries, run by Prometheus after a run that records every metric:
    a slow handler (lease extensions), a duplicate, a dead letter, an outbox relay."""
    meter_provider, _ = exporter
    broker = MemoryAdapter()  # real time: the slow handler's lease must be extended
    broker.ensure_subscription_sync("orders", "billing")
    broker.ensure_subscription_sync("orders", "slow", ack_deadline=0.2)
    broker.ensure_topic_sync("orders-dlq")
    sub = Subscriber(broker, meter_provider=meter_provider, dedup=MemoryDedupStore(),
                     dead_letter=DeadLetterPolicy("orders-dlq", 1),
                     retry=RetryPolicy(min_backoff=0.1, max_backoff=0.2),
                     lease=LeasePolicy(min_extension=0.2, max_extension=0.5))

    @sub.handler("billing")
    def charge(message: Message) -> None:
        if message.data == b"poison":
            raise ValueError("cannot parse")

    @sub.handler("slow")
    def slow(message: Message) -> None:
        time.sleep(0.6)  # a slow handler (it holds a worker thread, not the loop)

    async with fresh_outbox("sqlite") as box:
        async with box.engine.begin() as connection:
            await box.add(connection, "orders", b"from the outbox")
        relay = OutboxRelay(box, broker, meter_provider=meter_provider, metrics_interval=0.1,
                            poll_interval=0.1)
        broker.publish_sync("orders", b"poison")
        broker.publish_sync("orders", b"3", {"idempotency-key": "order-3"})

        def once_acked() -> bool:  # then its second copy, a duplicate
            if sub.stats[Outcome.ACKED] >= 1 and not republished:
                republished.append(broker.publish_sync(
                    "orders", b"3", {"idempotency-key": "order-3"}))
            return (sub.stats[Outcome.DEAD_LETTERED] == 1 and sub.stats[Outcome.DUPLICATE] >= 1
                    and sub.lease_manager("slow").stats.extend_calls >= 1)

        republished: list[str] = []
        async with relay:
            await serve_until(sub, once_acked, "every kind of outcome")

    for title, expression in dashboard_queries():
        until(lambda e=expression: prometheus.query(e), f"data for {title!r}: {expression}")


def dashboard_queries() -> list[tuple[str, str]]:
    """Each dashboard panel's queries, with Grafana's range variables as fixed windows."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expression = (target["expr"].replace("$__rate_interval", "1m")
                          .replace("$__range", "5m"))
            found.append((panel["title"], expression))
    assert len(found) >= 10
    return found
