"""Spike: which SQS client for an asyncio SDK? boto3 in threads against aiobotocore, on ElasticMQ.

    python -m benchmarks.sqs_clients_spike                    # 20,000 messages, 2 runs each
    python -m benchmarks.sqs_clients_spike --concurrency 4 --runs 3
    python -m benchmarks.sqs_clients_spike --persistent       # ElasticMQ with its H2 store
    python -m benchmarks.sqs_clients_spike --server moto      # moto's server instead
    python -m benchmarks.sqs_clients_spike --settings         # how each client finds its endpoint

Each run pre-fills a fresh queue with ``SendMessageBatch`` (10 a call, ``--concurrency`` calls
in flight: the send figures), then drains it with the raw consume loop an adapter would run:
``--concurrency`` loops, each ``ReceiveMessage(MaxNumberOfMessages=10, WaitTimeSeconds=1)``
then one ``DeleteMessageBatch`` for what it got, until every message is deleted. Variants run
alternately (A B C A B C), on one server started for the whole spike (its JIT warmed by a first,
untimed pass of each: :data:`WARMUP_MESSAGES`). Requests are counted by botocore's
``request-created`` event (so a retry counts), CPU from the process's own clock and the server's
``/proc/<pid>/stat``.

A spike, not a benchmark of the SDK: the numbers decide the adapter's client (no README
section). Measured 2026-12-01 (2 cores, shared with another job: load 4-10), ElasticMQ 1.7.1 in
memory, 8 calls in flight, 3 alternating runs: consume 5,700-6,800 msgs/s with aiobotocore 3.10
against 3,600-3,800 with boto3 1.43 in threads (to_thread or an own pool alike), 0.2 requests
per message for all, client CPU 136-145 µs/msg against 206-250; send 9,300-12,800 msgs/s
against 6,500-7,800. At 4 in flight: 4,800-6,000 against 3,200-3,800. With the H2 store the
server is the bottleneck (1,200-1,900 msgs/s for both). The commit that added this file has
the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from tests.sqs_processes import ElasticMqServer, MotoServer, _HttpSqsServer

MESSAGES = 20_000
RUNS = 2
CONCURRENCY = 8
BATCH = 10  # SQS's maximum entries per batch call and messages per receive
# Long enough that an idle loop does not spin, short enough that the last loops end soon after
# the queue is drained (an empty receive waits this long).
WAIT_TIME = 1
BODY = "x" * 100  # a small JSON-sized body
# An untimed pass per variant first: ElasticMQ's JIT takes ~10,000 messages to settle (the
# server's CPU per message still halves between a first and a second 5,000-message pass).
WARMUP_MESSAGES = 10_000
# The server's JVM for a throughput spike: the full JIT (not the tests' client compiler only),
# one GC thread, a heap for 20,000 messages in flight.
SPIKE_JVM_OPTIONS = ("-XX:+UseSerialGC", "-Xmx1g")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Tally:
    """What one pass did."""

    requests: int = 0
    receives: int = 0
    empty_receives: int = 0
    deleted: int = 0

    def count(self, **_: Any) -> None:  # botocore's request-created handler
        self.requests += 1

    def reset(self) -> None:
        self.requests = self.receives = self.empty_receives = self.deleted = 0


@dataclass
class Result:
    variant: str
    send_rates: list[float] = field(default_factory=list)
    consume_rates: list[float] = field(default_factory=list)
    consume_requests: list[float] = field(default_factory=list)  # per message
    messages_per_receive: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)  # µs per consumed message
    server_cpu: list[float] = field(default_factory=list)  # µs per consumed message


class Client(Protocol):
    """One call interface over either client: ``await call("receive_message", ...)``."""

    name: str
    tally: Tally

    async def open(self, options: dict[str, str], pool: int) -> None: ...

    async def call(self, operation: str, **params: Any) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class Boto3InThreads:
    """boto3's blocking client, each call on a worker thread: ``asyncio.to_thread`` (the loop's
    default executor, min(32, CPUs + 4) threads) or, with ``pool``, an executor of its own."""

    def __init__(self, own_pool: bool) -> None:
        self.own_pool = own_pool
        self.name = "boto3, own thread pool" if own_pool else "boto3, asyncio.to_thread"
        self.executor: ThreadPoolExecutor | None = None
        self.tally = Tally()

    async def open(self, options: dict[str, str], pool: int) -> None:
        import boto3
        from botocore.config import Config

        self.client = boto3.client("sqs", config=Config(max_pool_connections=pool), **options)
        self.client.meta.events.register("request-created.sqs", self.tally.count)
        if self.own_pool:
            self.executor = ThreadPoolExecutor(pool, thread_name_prefix="boto3")

    async def call(self, operation: str, **params: Any) -> dict[str, Any]:
        method = functools.partial(getattr(self.client, operation), **params)
        if self.executor is None:
            return await asyncio.to_thread(method)
        return await asyncio.get_running_loop().run_in_executor(self.executor, method)

    async def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
        self.client.close()


class AioBotocore:
    """aiobotocore's native asyncio client (aiohttp underneath)."""

    name = "aiobotocore"

    def __init__(self) -> None:
        self.tally = Tally()

    async def open(self, options: dict[str, str], pool: int) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        self._context = get_session().create_client(
            "sqs", config=AioConfig(max_pool_connections=pool), **options)
        self.client = await self._context.__aenter__()
        self.client.meta.events.register("request-created.sqs", self.tally.count)

    async def call(self, operation: str, **params: Any) -> dict[str, Any]:
        return await getattr(self.client, operation)(**params)  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._context.__aexit__(None, None, None)


VARIANTS: dict[str, Callable[[], Client]] = {
    "boto3-to-thread": lambda: Boto3InThreads(own_pool=False),
    "boto3-pool": lambda: Boto3InThreads(own_pool=True),
    "aiobotocore": AioBotocore,
}


async def fill(client: Client, url: str, messages: int, concurrency: int) -> float:
    """Send ``messages`` in batches of 10, ``concurrency`` calls in flight; the seconds taken."""
    batches = iter(range(0, messages, BATCH))

    async def sender() -> None:
        for start in batches:
            reply = await client.call("send_message_batch", QueueUrl=url, Entries=[
                {"Id": str(n), "MessageBody": BODY} for n in range(min(BATCH, messages - start))])
            assert not reply.get("Failed"), reply["Failed"]

    started = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return time.perf_counter() - started


async def drain(client: Client, url: str, messages: int, concurrency: int) -> float:
    """The raw consume loop: ``concurrency`` receive-then-delete loops until all are deleted."""
    tally = client.tally
    drained = asyncio.get_running_loop().create_future()

    async def consumer() -> None:
        while tally.deleted < messages:
            reply = await client.call("receive_message", QueueUrl=url, WaitTimeSeconds=WAIT_TIME,
                                      MaxNumberOfMessages=BATCH)
            tally.receives += 1
            received = reply.get("Messages", [])
            if not received:
                tally.empty_receives += 1
                continue
            done = await client.call("delete_message_batch", QueueUrl=url, Entries=[
                {"Id": str(n), "ReceiptHandle": m["ReceiptHandle"]}
                for n, m in enumerate(received)])
            tally.deleted += len(done.get("Successful", []))
            if tally.deleted >= messages and not drained.done():
                drained.set_result(time.perf_counter())

    started = time.perf_counter()
    await asyncio.gather(*(consumer() for _ in range(concurrency)))
    # timed to the last delete: the other loops' last empty long polls are not the client's cost
    return float(drained.result()) - started


def server_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


async def one_pass(variant: str, server: _HttpSqsServer, messages: int, concurrency: int,
                   result: Result | None) -> None:
    client = VARIANTS[variant]()
    await client.open(server.client_options, pool=2 * concurrency)
    try:
        url = (await client.call("create_queue", QueueName=f"spike-{uuid.uuid4().hex[:8]}"))[
            "QueueUrl"]
        send_seconds = await fill(client, url, messages, concurrency)
        client.tally.reset()
        assert server.process is not None
        cpu, server_cpu = time.process_time(), server_cpu_seconds(server.process.pid)
        seconds = await drain(client, url, messages, concurrency)
        cpu, server_cpu = (time.process_time() - cpu,
                           server_cpu_seconds(server.process.pid) - server_cpu)
        await client.call("delete_queue", QueueUrl=url)
    finally:
        await client.close()
    if result is None:  # the warm-up pass
        return
    tally = client.tally
    assert tally.deleted == messages, (tally.deleted, messages)
    result.send_rates.append(messages / send_seconds)
    result.consume_rates.append(messages / seconds)
    result.consume_requests.append(tally.requests / messages)
    result.messages_per_receive.append(messages / (tally.receives - tally.empty_receives))
    result.client_cpu.append(cpu * 1e6 / messages)
    result.server_cpu.append(server_cpu * 1e6 / messages)


def report(results: dict[str, Result], args: argparse.Namespace) -> str:
    def runs(values: list[float], digits: int = 0) -> str:
        return " / ".join(f"{value:,.{digits}f}" for value in values)

    lines = [
        f"{args.messages:,} messages of {len(BODY)} B, {args.concurrency} calls in flight, "
        f"{args.runs} runs per variant (alternating; each run's figure shown, in order); "
        + ("moto's server; " if args.server == "moto" else
           f"ElasticMQ {'with H2 persistence' if args.persistent else 'in memory'}; ")
        + ", ".join(f"{name} {metadata.version(name)}"
                    for name in ("boto3", "botocore", "aiobotocore", "aiohttp")),
        "",
        "| client | send msgs/s (SendMessageBatch) | consume msgs/s | requests / message "
        "| messages / receive | client CPU µs / msg | server CPU µs / msg |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results.values():
        lines.append(
            f"| {result.variant} | {runs(result.send_rates)} | {runs(result.consume_rates)} | "
            f"{runs(result.consume_requests, 3)} | {runs(result.messages_per_receive, 2)} | "
            f"{runs(result.client_cpu)} | {runs(result.server_cpu)} |")
    medians = {name: statistics.median(r.consume_rates) for name, r in results.items()}
    lines += ["", "median consume msgs/s: " + ", ".join(f"{name} {rate:,.0f}"
                                                        for name, rate in medians.items())]
    return "\n".join(lines)


async def spike(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory(prefix="sqs-spike-") as directory:
        server: _HttpSqsServer = (
            MotoServer(Path(directory)) if args.server == "moto" else
            ElasticMqServer(Path(directory), persistent=args.persistent,
                            jvm_options=SPIKE_JVM_OPTIONS))
        server.start()
        try:
            for variant in args.variants:  # warm the server's JIT and each client's imports
                await one_pass(variant, server, min(args.messages, WARMUP_MESSAGES),
                               args.concurrency, None)
            results = {name: Result(VARIANTS[name]().name) for name in args.variants}
            for run in range(args.runs):
                for variant in args.variants:
                    await one_pass(variant, server, args.messages, args.concurrency,
                                   results[variant])
                    print(f"run {run + 1}: {variant}: "
                          f"{results[variant].consume_rates[-1]:,.0f} msgs/s", file=sys.stderr)
        finally:
            server.stop()
    return report(results, args)


# -- how each client reads its settings, and what importing it costs ----------------------------

_SETTINGS_PROBE = """
import asyncio, json, os, sys, time
started = time.perf_counter()
if sys.argv[1] == "boto3":
    import boto3
    imported = time.perf_counter()
    client = boto3.client("sqs")
    made = time.perf_counter()
    config = client.meta.config
    print(json.dumps({"endpoint": client.meta.endpoint_url, "region": client.meta.region_name,
                      "pool": config.max_pool_connections, "retries": config.retries,
                      "import_ms": (imported - started) * 1e3,
                      "client_ms": (made - imported) * 1e3}))
else:
    from aiobotocore.session import get_session
    imported = time.perf_counter()
    async def main():
        async with get_session().create_client("sqs") as client:
            made = time.perf_counter()
            config = client.meta.config
            print(json.dumps({"endpoint": client.meta.endpoint_url,
                              "region": client.meta.region_name,
                              "pool": config.max_pool_connections, "retries": config.retries,
                              "import_ms": (imported - started) * 1e3,
                              "client_ms": (made - imported) * 1e3}))
    asyncio.run(main())
"""


def settings() -> str:
    """Which endpoint and region each client picks up from the standard AWS settings (env
    variables, a profile in a config file), its defaults for the pool and retries, and the
    cost of importing it and making a client (fresh interpreters)."""
    lines = ["| settings | client | endpoint | region | pool | retries | import ms | "
             "client ms |", "|---|---|---|---|---|---|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="sqs-settings-") as directory:
        config = Path(directory) / "config"
        config.write_text(
            "[profile local]\nregion = eu-west-1\nservices = local-sqs\n"
            "[services local-sqs]\nsqs =\n  endpoint_url = http://127.0.0.1:9/profile\n"
        )
        base = {name: value for name, value in os.environ.items()
                if not name.startswith("AWS_")}
        base.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
                    AWS_CONFIG_FILE=str(config),
                    AWS_SHARED_CREDENTIALS_FILE=str(Path(directory) / "none"))
        cases = {
            "AWS_ENDPOINT_URL + AWS_DEFAULT_REGION": dict(
                AWS_ENDPOINT_URL="http://127.0.0.1:9/all", AWS_DEFAULT_REGION="us-west-2"),
            "AWS_ENDPOINT_URL_SQS (beside AWS_ENDPOINT_URL) + AWS_DEFAULT_REGION": dict(
                AWS_ENDPOINT_URL="http://127.0.0.1:9/all",
                AWS_ENDPOINT_URL_SQS="http://127.0.0.1:9/sqs", AWS_DEFAULT_REGION="ap-south-1"),
            "AWS_REGION only (the other SDKs' name)": dict(AWS_REGION="ap-south-1"),
            "AWS_PROFILE=local (services section)": dict(AWS_PROFILE="local"),
            "AWS_RETRY_MODE=standard, AWS_MAX_ATTEMPTS=7": dict(
                AWS_DEFAULT_REGION="us-east-1", AWS_RETRY_MODE="standard",
                AWS_MAX_ATTEMPTS="7"),
            "nothing but a region": dict(AWS_DEFAULT_REGION="us-east-1"),
        }
        for label, extra in cases.items():
            for name in ("boto3", "aiobotocore"):
                done = subprocess.run([sys.executable, "-c", _SETTINGS_PROBE, name],
                                      env={**base, **extra}, capture_output=True, text=True,
                                      timeout=60, check=False)
                if done.returncode != 0:
                    lines.append(f"| {label} | {name} | failed: "
                                 f"{done.stderr.strip().splitlines()[-1]} | | | | | |")
                    continue
                seen = json.loads(done.stdout)
                lines.append(f"| {label} | {name} | {seen['endpoint']} | {seen['region']} | "
                             f"{seen['pool']} | {seen['retries']} | {seen['import_ms']:.0f} | "
                             f"{seen['client_ms']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=MESSAGES)
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS),
                        default=list(VARIANTS))
    parser.add_argument("--server", choices=["elasticmq", "moto"], default="elasticmq")
    parser.add_argument("--persistent", action="store_true", help="ElasticMQ with its H2 store")
    parser.add_argument("--settings", action="store_true",
                        help="only show how each client reads the standard AWS settings")
    args = parser.parse_args(argv)
    if args.settings:
        print(settings())
        return 0
    print(asyncio.run(spike(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
