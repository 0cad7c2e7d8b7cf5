"""The consumer metrics reach a real Prometheus server.

A Subscriber records into the OpenTelemetry Prometheus exporter (an HTTP endpoint on a free
loopback port); a private ``prometheus`` (the Debian package's binary) scrapes it every 200 ms;
the test then asks Prometheus's HTTP query API for the consumed-messages counter by outcome and
the processing-duration histogram. Without the binary the test is skipped on a laptop and fails
under ``CI=true`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
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
    TelemetryPolicy,
)
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.clock import SystemClock
from reliable_sub.outbox import OutboxRelay
from reliable_sub.testing.services import missing_service, redis_url
from reliable_sub.testing.timing import drive_until
from tests.memory_world import serve_until, setup
from tests.outbox_support import fresh_outbox
from tests.redis_processes import free_port

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "dashboard" / "reliable-sub.json"
GENERATE = DASHBOARD.with_name("generate.py")
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

    def variable(self, label_values: str) -> list[str]:
        """What a Grafana ``label_values(selector, label)`` variable query offers."""
        inner = label_values.removeprefix("label_values(").removesuffix(")")
        selector, _, label = inner.rpartition(",")
        url = (f"http://127.0.0.1:{self.port}/api/v1/label/{label.strip()}/values?"
               + urllib.parse.urlencode({"match[]": selector.strip()}))
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return list(body["data"])

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


@pytest.fixture(params=["memory", "redis"])
def broker(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The adapter a dashboard run records on: in-memory, or Redis Streams (its own keys)."""
    if request.param == "memory":
        yield MemoryAdapter()
        return
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

    prefix = f"dash-{uuid.uuid4().hex[:8]}"
    adapter = RedisStreamsAdapter(redis_url(), key_prefix=prefix)
    adapter.dashboard_prefix = prefix  # type: ignore[attr-defined]
    try:
        yield adapter
    finally:
        keys = adapter.clients.sync.keys(f"{prefix}*")
        if keys:
            adapter.clients.sync.delete(*keys)
        adapter.close_sync()


async def test_every_dashboard_query_returns_data_for_the_chosen_subscription_only(
    exporter: tuple[Any, int], prometheus: Prometheus, broker: Any,
) -> None:
    """examples/dashboard's queries, run by Prometheus after a run that records every metric
    (a slow handler's lease extensions, a duplicate, a dead letter, a failed publish, an outbox
    relay), with the dashboard's variables substituted: each returns data, and each panel of
    one subscription shows that subscription only."""
    meter_provider, _ = exporter
    prefix = getattr(broker, "dashboard_prefix", "")
    orders, dlq = f"{prefix}orders", f"{prefix}orders-dlq"
    billing, shipping = f"{prefix}billing", f"{prefix}shipping"
    # real time: a slow message's lease must be extended; shipping, quick, is the other line
    await broker.ensure_subscription(orders, billing, ack_deadline=0.2)
    await broker.ensure_subscription(orders, shipping, ack_deadline=30)
    await broker.ensure_topic(dlq)
    sub = Subscriber(broker, meter_provider=meter_provider, dedup=MemoryDedupStore(),
                     dead_letter=DeadLetterPolicy(dlq, 1), receive_timeout=0.1,
                     retry=RetryPolicy(min_backoff=0.1, max_backoff=0.2),
                     lease=LeasePolicy(min_extension=0.2, max_extension=0.5),
                     telemetry=TelemetryPolicy(backlog_interval=0.2))

    @sub.handler(billing)
    def charge(message: Message) -> None:
        if message.data == b"poison":
            raise ValueError("cannot parse")
        if message.data == b"slow":
            time.sleep(0.6)  # holds a worker thread, not the loop

    @sub.handler(shipping)
    def ship(message: Message) -> None:
        pass

    with pytest.raises(TypeError):
        broker.publish_sync(orders, object())  # a failed publish: publish errors have data
    async with fresh_outbox("sqlite") as box:
        async with box.engine.begin() as connection:
            await box.add(connection, orders, b"from the outbox")
        relay = OutboxRelay(box, broker, meter_provider=meter_provider, metrics_interval=0.1,
                            poll_interval=0.1)
        broker.publish_sync(orders, b"poison")
        broker.publish_sync(orders, b"slow")
        broker.publish_sync(orders, b"3", {"idempotency-key": "order-3"})

        def once_acked() -> bool:  # then its second copy, a duplicate
            if sub.stats[Outcome.ACKED] >= 1 and not republished:
                republished.append(broker.publish_sync(
                    orders, b"3", {"idempotency-key": "order-3"}))
            return (sub.stats[Outcome.DEAD_LETTERED] == 1 and sub.stats[Outcome.DUPLICATE] >= 1
                    and sub.lease_manager(billing).stats.extend_calls >= 1)

        republished: list[str] = []
        async with relay:
            serving = asyncio.ensure_future(sub.serve())
            try:
                await drive_until(SystemClock(), once_acked, SCRAPE_TIMEOUT,
                                  what="every kind of outcome")
                # while it runs: the health gauge has no point once a Subscriber stops
                await check_the_dashboard(prometheus, broker, billing, shipping)
            finally:
                await sub.shutdown(timeout=5)
                await serving


async def check_the_dashboard(prometheus: Prometheus, broker: Any, billing: str,
                              shipping: str) -> None:
    async def until_async(check: Any, what: str) -> Any:
        give_up = time.monotonic() + SCRAPE_TIMEOUT
        while not (value := await asyncio.to_thread(check)):
            if time.monotonic() > give_up:
                raise AssertionError(f"Prometheus did not show {what} within {SCRAPE_TIMEOUT}s")
            await asyncio.sleep(POLL)
        return value

    system = broker.capabilities.messaging_system
    chosen = {"job": "reliable-sub", "system": system, "subscription": billing}
    for name, expected in (("job", "reliable-sub"), ("system", system),
                           ("subscription", billing), ("subscription", shipping)):
        await until_async(
            lambda n=name, e=expected: e in prometheus.variable(variable_query(n, chosen)),
            f"{expected!r} among the choices of ${name}")
    for panel, raw in dashboard_queries():
        expression = substituted(raw, chosen)
        found = await until_async(lambda e=expression: prometheus.query(e),
                                  f"data for {panel.title!r}: {expression}")
        if panel.per_subscription:
            assert {r["metric"].get(GROUP_LABEL, billing) for r in found} == {billing}, (
                panel.title)
            elsewhere = substituted(raw, {**chosen, "subscription": "nobody-here"})
            assert prometheus.query(elsewhere) == [], f"{panel.title!r} is not filtered"


GROUP_LABEL = "messaging_consumer_group_name"


def _dashboard_module() -> Any:
    spec = importlib.util.spec_from_file_location("dashboard_generate", GENERATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def substituted(expression: str, chosen: dict[str, str]) -> str:
    """``expression`` as Grafana sends it: variables replaced, range variables fixed."""
    expression = expression.replace("$__rate_interval", "1m").replace("$__range", "5m")
    for name, value in chosen.items():
        expression = expression.replace(f"${name}", value)
    return expression


def variable_query(name: str, chosen: dict[str, str]) -> str:
    """The ``label_values(selector, label)`` of the dashboard's variable ``name``."""
    dashboard = json.loads(DASHBOARD.read_text())
    [query] = [v["query"] for v in dashboard["templating"]["list"] if v["name"] == name]
    return substituted(query, chosen)


def dashboard_queries() -> list[tuple[Any, str]]:
    """Each panel of the committed dashboard (as the generator describes it) and its queries,
    as written (with the variables)."""
    panels = {panel.title: panel for panel in _dashboard_module().PANELS}
    dashboard = json.loads(DASHBOARD.read_text())
    found = [(panels[panel["title"]], target["expr"])
             for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(found) >= 15
    return found


def test_the_committed_dashboard_is_what_the_generator_writes() -> None:
    result = subprocess.run([sys.executable, str(GENERATE), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
