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
from collections.abc import Callable, Coroutine, Iterator
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
from reliable_sub.outbox import OutboxRelay
from reliable_sub.testing.services import missing_service, redis_url
from reliable_sub.testing.timing import REAL_WAIT_SLACK
from tests.hang_report import await_chain
from tests.memory_world import serve_until, setup
from tests.outbox_support import fresh_outbox
from tests.redis_processes import free_port

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "dashboard" / "reliable-sub.json"
GENERATE = DASHBOARD.with_name("generate.py")
# One deadline for a whole test: Prometheus's start, the Subscriber's run and every query (about
# 6 s on an idle machine, most of it Prometheus handing its scrape loop the target). Well inside
# pytest's 120 s with the stops and the teardown, so that a slow step fails naming what it
# waited on and what Prometheus last answered, instead of a timeout that names nothing.
BUDGET = 60.0
# The Subscriber's shutdown (its handlers get 5 s of it): past this it failed, naming where
# each task of the loop waits.
STOP_WITHIN = 15.0
POLL = 0.1
# One HTTP request to Prometheus (a query, or a diagnostic's); retried within the deadline.
REQUEST_TIMEOUT = 5.0


class Deadline:
    """The test's one deadline, and how long each phase took of it (for the failure's
    message)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()
        self.give_up = self.start + seconds
        self.phases: list[tuple[str, float]] = []
        self._phase: tuple[str, float] | None = None

    def left(self) -> float:
        return self.give_up - time.monotonic()

    def passed(self) -> bool:
        return time.monotonic() > self.give_up

    def phase(self, name: str) -> None:
        """Start phase ``name`` (ending the previous one)."""
        now = time.monotonic()
        if self._phase is not None:
            self.phases.append((self._phase[0], now - self._phase[1]))
        self._phase = (name, now)

    def report(self) -> str:
        now = time.monotonic()
        phases = [*self.phases]
        if self._phase is not None:
            phases.append((f"{self._phase[0]} (unfinished)", now - self._phase[1]))
        done = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in phases)
        return f"{now - self.start:.1f}s of the {self.seconds:.0f}s budget: {done}"


class Prometheus:
    """A private ``prometheus`` scraping one target every 200 ms, and its HTTP API."""

    def __init__(self, directory: Path, target: int, deadline: Deadline) -> None:
        executable = shutil.which("prometheus")
        if executable is None:
            missing_service("prometheus is not on PATH (Debian package prometheus)")
        self.port = free_port()
        self.target = target
        self.deadline = deadline
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 200ms\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: reliable-sub\n    scrape_interval: 200ms\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
        )
        self.log_path = directory / "prometheus.log"
        self.log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [str(executable), f"--config.file={config}",
             f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        deadline.phase("prometheus start")
        until(self, self._ready, "/-/ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n"
                                 + self._log_tail())
        with self._get("/-/ready") as reply:
            return bool(reply.status == 200)

    def _get(self, path: str, timeout: float = REQUEST_TIMEOUT) -> Any:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout)

    def _api(self, path: str, timeout: float = REQUEST_TIMEOUT) -> Any:
        with self._get(path, timeout) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expression: str) -> list[dict[str, Any]]:
        found = self._api("/api/v1/query?" + urllib.parse.urlencode({"query": expression}))
        return list(found["result"])

    def variable(self, label_values: str) -> list[str]:
        """What a Grafana ``label_values(selector, label)`` variable query offers."""
        inner = label_values.removeprefix("label_values(").removesuffix(")")
        selector, _, label = inner.rpartition(",")
        found = self._api(f"/api/v1/label/{label.strip()}/values?"
                          + urllib.parse.urlencode({"match[]": selector.strip()}))
        return list(found)

    def diagnosis(self) -> str:
        """What Prometheus tells of its scrapes now: the target's health, last scrape and
        error, the ``up`` and scrape-duration series, and its log's last lines."""
        lines = []
        try:
            targets = self._api("/api/v1/targets", timeout=2)["activeTargets"]
            if not targets:
                lines.append("no active target yet (Prometheus hands its scrape loop the "
                             "configured targets about 5 s after it starts)")
            for target in targets:
                lines.append(
                    f"target {target['scrapeUrl']}: health {target['health']}, last scrape "
                    f"{target['lastScrape']} ({target['lastScrapeDuration']:.3f}s), "
                    f"scrape timeout {target.get('scrapeTimeout')}, "
                    f"last error {target['lastError']!r}")
            for expression in ("up", "scrape_duration_seconds", "scrape_samples_scraped",
                               "count_over_time(up[1m])", "sum_over_time(up[1m])"):
                found = self._api("/api/v1/query?"
                                  + urllib.parse.urlencode({"query": expression}), timeout=2)
                lines.append(f"{expression} = {[r['value'] for r in found['result']]}")
        except Exception as error:  # a diagnosis must not hide the failure it explains
            lines.append(f"(asking Prometheus failed: {error!r})")
        lines.append(f"exporter on port {self.target}: {self._exporter_answer()}")
        return "\n".join(lines) + "\nprometheus's log, last lines:\n" + self._log_tail()

    def scrapes(self) -> str:
        """How the scrapes went: how many succeeded of how many, the slowest one."""
        figures = []
        for expression in ("sum_over_time(up[5m])", "count_over_time(up[5m])",
                           "max_over_time(scrape_duration_seconds[5m])"):
            try:
                found = self.query(expression)
                figures.append(found[0]["value"][1] if found else "none")
            except Exception as error:
                figures.append(repr(error))
        return f"scrapes up {figures[0]} of {figures[1]}, slowest {figures[2]}s"

    def _exporter_answer(self) -> str:
        began = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.target}/metrics",
                                        timeout=2) as reply:
                size = len(reply.read())
        except Exception as error:
            return f"{error!r} after {time.monotonic() - began:.3f}s"
        return f"{size} bytes in {time.monotonic() - began:.3f}s"

    def _log_tail(self, lines: int = 15) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture
def deadline() -> Deadline:
    """The test's one deadline, from before Prometheus starts."""
    return Deadline(BUDGET)


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
def prometheus(tmp_path: Path, exporter: tuple[Any, int],
               deadline: Deadline) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path, exporter[1], deadline)
    try:
        yield server
    finally:
        server.stop()


class Waited:
    """The last answer of a check that is polled: its value, or the error it raised."""

    def __init__(self) -> None:
        self.answer: object = "(not asked yet)"

    def ask(self, check: Callable[[], Any]) -> Any:
        try:
            self.answer = check()
        except OSError as error:  # a request that failed or timed out: ask again
            self.answer = error
            return None
        return self.answer


def failed(prometheus: Prometheus, what: str, waited: Waited,
           more: Callable[[], str] | None = None) -> AssertionError:
    """The failure of a wait that ran out of the deadline: what it waited on, its last answer,
    how the budget went, and what Prometheus tells of its scrapes."""
    answer = repr(waited.answer)
    if len(answer) > 2000:
        answer = answer[:2000] + "..."
    return AssertionError(
        f"waited for {what}; out of time after {prometheus.deadline.report()}\n"
        f"last answer: {answer}\n" + (f"{more()}\n" if more is not None else "")
        + prometheus.diagnosis())


def until(prometheus: Prometheus, check: Callable[[], Any], what: str) -> Any:
    """``check()``'s first true value, polled until the test's deadline."""
    waited = Waited()
    while not (value := waited.ask(check)):
        if prometheus.deadline.passed():
            raise failed(prometheus, what, waited)
        time.sleep(POLL)
    return value


async def until_async(prometheus: Prometheus, check: Callable[[], Any], what: str,
                      more: Callable[[], str] | None = None, *, blocking: bool = True) -> Any:
    """As :func:`until`, from the event loop: a ``blocking`` check (an HTTP request) runs in a
    thread, so the Subscriber being watched keeps running."""
    waited = Waited()
    while not (value := (await asyncio.to_thread(waited.ask, check) if blocking
                         else waited.ask(check))):
        if prometheus.deadline.passed():
            raise failed(prometheus, what, waited, more)
        await asyncio.sleep(POLL)
    return value


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
    prometheus.deadline.phase("run")
    await serve_until(sub, lambda: sub.stats[Outcome.ACKED] == 3
                      and sub.stats[Outcome.DEAD_LETTERED] == 1, "the four messages",
                      within=max(1.0, prometheus.deadline.left() - REAL_WAIT_SLACK))

    def consumed() -> dict[str, float] | None:
        found = {r["metric"].get("reliable_sub_outcome"): float(r["value"][1])
                 for r in prometheus.query("messaging_client_consumed_messages_total")}
        return found if found.get("acked") == 3 and found.get("dead_lettered") == 1 else None

    prometheus.deadline.phase("queries")
    by_outcome = until(prometheus, consumed, "the consumed-messages counter by outcome")
    per_subscription = ("sum by (messaging_destination_subscription_name) "
                        "(messaging_process_duration_seconds_count)")
    [count] = until(prometheus, lambda: prometheus.query(per_subscription),
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
    prometheus.deadline.phase("run")
    # real time: a slow message's lease must be extended; shipping, quick, is the other line
    await broker.ensure_subscription(orders, billing, ack_deadline=0.2)
    await broker.ensure_subscription(orders, shipping, ack_deadline=30)
    await broker.ensure_subscription(dlq, f"{dlq}-sub", ack_deadline=30)  # keeps dead letters
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

        def run_state() -> str:
            stopped = (f"stopped: {serving.exception() if not serving.cancelled() else None!r}"
                       if serving.done() else "running")
            return (f"Subscriber {stopped}, healthy {sub.healthy()}, outcomes "
                    f"{ {k: v for k, v in sub.stats.as_dict().items() if v} }, lease extensions "
                    f"{sub.lease_manager(billing).stats.extend_calls}")

        republished: list[str] = []
        async with relay:
            serving = asyncio.ensure_future(sub.serve())
            try:
                await until_async(prometheus, once_acked, "every kind of outcome", run_state,
                                  blocking=False)
                # while it runs: the health gauge has no point once a Subscriber stops
                await check_the_dashboard(prometheus, broker, billing, shipping, run_state)
            finally:
                prometheus.deadline.phase("shutdown")

                async def shut_down() -> None:
                    await sub.shutdown(timeout=5)
                    await serving

                await stopped_within(shut_down(), "the Subscriber's shutdown")
    prometheus.deadline.phase("done")
    print(f"phases: {prometheus.deadline.report()}; {prometheus.scrapes()}")


async def stopped_within(stop: Coroutine[Any, Any, None], what: str) -> None:
    """Await ``stop`` (a shutdown) for ``STOP_WITHIN`` seconds, then fail naming where each
    task of the loop waits (a stop that never ends would otherwise hold the test until pytest's
    timeout, which names nothing)."""
    stopping = asyncio.ensure_future(stop)
    done, _ = await asyncio.wait({stopping}, timeout=STOP_WITHIN)
    if done:
        return stopping.result()
    tasks = "\n".join(f"--- {task!r}\n" + "\n".join(await_chain(task))
                      for task in asyncio.all_tasks() if task is not asyncio.current_task())
    stopping.cancel()  # and so what it awaits: best effort, for the teardown's sake
    raise AssertionError(f"{what} did not end within {STOP_WITHIN}s; the loop's tasks:\n{tasks}")


async def check_the_dashboard(prometheus: Prometheus, broker: Any, billing: str,
                              shipping: str, run_state: Callable[[], str]) -> None:
    system = broker.capabilities.messaging_system
    chosen = {"job": "reliable-sub", "system": system, "subscription": billing}
    for name, expected in (("job", "reliable-sub"), ("system", system),
                           ("subscription", billing), ("subscription", shipping)):
        query = variable_query(name, chosen)
        prometheus.deadline.phase(f"variable ${name}")
        await until_async(prometheus, lambda q=query, e=expected: e in prometheus.variable(q),
                          f"{expected!r} among the choices of ${name}: {query}", run_state)
    for panel, raw in dashboard_queries():
        expression = substituted(raw, chosen)
        prometheus.deadline.phase(f"query {panel.title!r}")
        found = await until_async(prometheus, lambda e=expression: prometheus.query(e),
                                  f"data for {panel.title!r}: {expression}", run_state)
        if panel.per_subscription:
            assert {r["metric"].get(GROUP_LABEL, billing) for r in found} == {billing}, (
                panel.title)
            elsewhere = substituted(raw, {**chosen, "subscription": "nobody-here"})
            assert await asyncio.to_thread(prometheus.query, elsewhere) == [], (
                f"{panel.title!r} is not filtered")


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
