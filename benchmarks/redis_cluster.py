"""Redis Streams on one node vs. a Redis Cluster: the Subscriber with and without dedup.

    python -m benchmarks.redis_cluster            # print the table
    python -m benchmarks.redis_cluster --write    # ... and rewrite the README section

Starts a private ``redis-server`` and a 3-master cluster (``tests/redis_processes.py``); each
repetition publishes the backlog into 3 streams hash-tagged onto different masters, then starts
1 or 3 consumer processes (``--child``) that count every request they write to a Redis socket.
The layout and the rows: ``templates/redis_cluster.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from benchmarks._harness import add_runs, measured_on, paired, publish, render, table

COMMAND = "python -m benchmarks.redis_cluster --write"
SECTION_NAME = "redis_cluster"
STREAMS = 3
DEFAULT_MESSAGES = 30_000  # per run, spread evenly over the streams
DEFAULT_REPETITIONS = 3
PUBLISH_CHUNK = 1_000
PAYLOAD = b"x" * 64
ACK_DEADLINE = 30.0
POLL_INTERVAL = 0.01
RUN_DEADLINE = 120.0
CHILD_TIMEOUT = 30.0
# The adapter's key prefix, so also part of each group's dedup namespace (and so of its slot).
KEY_PREFIX = "bench"
# Goal from the issue: the cluster path with dedup at least this share of the single node's
# msgs/s per consumer.
CLUSTER_DEDUP_MIN_RATIO = 0.8  # #27 (it was 0.7 before)


@dataclasses.dataclass(frozen=True)
class Variant:
    deployment: str  # "single" or "cluster"
    dedup: str  # "none", "dedup" (completions with the XACK where the slots allow) or "apart"
    processes: int

    @property
    def label(self) -> str:
        dedup = {
            "none": "no dedup",
            "dedup": "RedisDedupStore",
            "apart": "RedisDedupStore, completions in their own call",
        }[self.dedup]
        return f"{self.deployment}, {dedup}, {self.processes} process{'es' * (self.processes > 1)}"


VARIANTS = (
    Variant("single", "none", 1),
    Variant("cluster", "none", 1),
    Variant("single", "dedup", 1),
    Variant("single", "apart", 1),
    Variant("cluster", "dedup", 1),
    Variant("single", "none", 3),
    Variant("cluster", "none", 3),
    Variant("single", "dedup", 3),
    Variant("cluster", "dedup", 3),
)


@dataclasses.dataclass
class Run:
    seconds: float
    handled: int
    round_trips: int
    client_cpu: float  # seconds, all consumer processes
    master_cpu: float  # seconds, every master (the single server counts as one)
    replica_cpu: float


# -- the consumer process ------------------------------------------------------------------------


def count_round_trips() -> list[int]:
    """Count every request redis-py's asyncio connections write from now on (one per command,
    one per pipeline batch to one node)."""
    from redis.asyncio.connection import AbstractConnection

    sent = [0]
    original = AbstractConnection.send_packed_command

    async def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        sent[0] += 1
        await original(self, command, check_health)

    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
    return sent


async def consume(settings: dict[str, Any]) -> None:
    from reliable_sub import Message, Subscriber
    from reliable_sub.adapters.redis_streams import RedisStreamsAdapter
    from reliable_sub.dedup import RedisDedupStore
    from reliable_sub.ports import DedupStore

    class CompletionsApart(RedisStreamsAdapter):
        """Never takes the combined completions + XACK script: two calls per ack batch."""

        def shares_store(self, store: DedupStore) -> bool:
            return False

    adapter_type = CompletionsApart if settings["dedup"] == "apart" else RedisStreamsAdapter
    adapter = adapter_type(settings["url"], consumer=settings["consumer"],
                           key_prefix=settings["prefix"])
    store = None
    if settings["dedup"] != "none":
        store = RedisDedupStore(settings["url"], prefix=f"{settings['prefix']}-dedup")
    handled = [0]

    async def handle(message: Message) -> None:
        handled[0] += 1

    subscriber = Subscriber(adapter, dedup=store)
    for group in settings["groups"]:
        subscriber.handler(group)(handle)
    await adapter.client.ping()  # connected (and, on a cluster, the slots mapped) before GO
    if store is not None:
        await store.clients.get().ping()
    loop = asyncio.get_running_loop()
    print("READY", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # GO
    sent = count_round_trips()
    cpu = time.process_time()
    task = asyncio.create_task(subscriber.serve())
    await loop.run_in_executor(None, sys.stdin.readline)  # STOP
    trips, cpu = sent[0], time.process_time() - cpu
    await subscriber.shutdown(5.0)
    await task
    await adapter.close()
    if store is not None:
        await store.close()
    result = {"handled": handled[0], "round_trips": trips, "cpu": cpu}
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent ----------------------------------------------------------------------------------


class Deployments:
    """The private single server and cluster, and the names that place the streams."""

    def __init__(self, directory: Path) -> None:
        from tests.redis_processes import RedisClusterProcesses, RedisServer

        (directory / "single").mkdir()
        self.single = RedisServer(directory / "single", appendonly=False)
        self.cluster = RedisClusterProcesses(directory / "cluster")

    def start(self) -> None:
        self.single.start()
        self.cluster.start()

    def stop(self) -> None:
        self.single.kill()
        self.cluster.kill()

    def url(self, deployment: str) -> str:
        return self.single.url if deployment == "single" else self.cluster.url

    def client(self, deployment: str) -> Any:
        if deployment == "single":
            return redis.Redis.from_url(self.single.url)
        port = self.cluster.servers[0].port
        return redis.RedisCluster(host="127.0.0.1", port=port)

    def masters(self) -> list[tuple[int, int, int]]:
        """(first slot, last slot, port) of each master."""
        client = self.client("cluster")
        try:
            slots = client.cluster_slots()
        finally:
            client.close()
        return sorted((start, end, node["primary"][1]) for (start, end), node in slots.items())

    def cpu(self, deployment: str) -> tuple[float, float]:
        """CPU seconds the servers of ``deployment`` have used so far: (masters, replicas)."""
        servers = [self.single] if deployment == "single" else self.cluster.servers
        used = {"master": 0.0, "slave": 0.0}
        for server in servers:
            client = redis.Redis(host="127.0.0.1", port=server.port)
            try:
                info = client.info("cpu")
            finally:
                client.close()
            used[server.role()] += info["used_cpu_sys"] + info["used_cpu_user"]
        return used["master"], used["slave"]

    def flush(self) -> None:
        for server in [self.single, *self.cluster.servers]:
            client = redis.Redis(host="127.0.0.1", port=server.port)
            try:
                if server.role() == "master":
                    client.flushall()
            finally:
                client.close()


def stream_tags(masters: list[tuple[int, int, int]]) -> list[str]:
    """One hash tag per master: ``s<n>`` for the first n whose slot the master holds."""
    tags: list[str] = []
    for first, last, _ in masters[:STREAMS]:
        tags.append(next(f"s{n}" for n in range(100_000)
                         if first <= key_slot(f"s{n}".encode()) <= last))
    return tags


def master_of(slot: int, masters: list[tuple[int, int, int]]) -> int:
    return next(index for index, (first, last, _) in enumerate(masters) if first <= slot <= last)


class Bench:
    def __init__(self, deployments: Deployments, messages: int) -> None:
        self.deployments = deployments
        self.per_stream = messages // STREAMS
        self.messages = self.per_stream * STREAMS
        self.masters = deployments.masters()
        self.tags = stream_tags(self.masters)
        self.groups = [f"group-{n}" for n in range(STREAMS)]

    def streams(self, prefix: str) -> list[str]:
        return [f"{prefix}:{{{tag}}}" for tag in self.tags]

    def prepare(self, variant: Variant, prefix: str) -> None:
        from reliable_sub.adapters.redis_streams import RedisStreamsAdapter

        self.deployments.flush()
        client = self.deployments.client(variant.deployment)
        try:
            for stream in self.streams(prefix):
                for start in range(0, self.per_stream, PUBLISH_CHUNK):
                    pipe = client.pipeline(transaction=False)
                    for _ in range(min(PUBLISH_CHUNK, self.per_stream - start)):
                        pipe.xadd(stream, {"data": PAYLOAD})
                    pipe.execute()
        finally:
            client.close()
        adapter = RedisStreamsAdapter(self.deployments.url(variant.deployment), key_prefix=prefix)
        for stream, group in zip(self.streams(prefix), self.groups, strict=True):
            adapter.ensure_subscription_sync(stream, group, ack_deadline=ACK_DEADLINE, start="0")
        adapter.close_sync()

    def drained(self, client: Any, prefix: str) -> bool:
        for stream, group in zip(self.streams(prefix), self.groups, strict=True):
            [info] = [g for g in client.xinfo_groups(stream) if g["name"] == group.encode()]
            if info["entries-read"] != self.per_stream or info["pending"] != 0:
                return False
        return True

    def run(self, variant: Variant) -> Run:
        prefix = KEY_PREFIX  # every run starts from flushed servers: the same slots each time
        self.prepare(variant, prefix)
        settings = {"url": self.deployments.url(variant.deployment), "prefix": prefix,
                    "groups": self.groups, "dedup": variant.dedup}
        children = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.redis_cluster", "--child",
                 json.dumps({**settings, "consumer": f"consumer-{n}"})],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                cwd=Path(__file__).resolve().parent.parent,
            )
            for n in range(variant.processes)
        ]
        client = self.deployments.client(variant.deployment)
        try:
            for child in children:
                line = read_line(child)
                if line != "READY":
                    raise RuntimeError(f"a consumer did not start: {line!r}")
            masters_before, replicas_before = self.deployments.cpu(variant.deployment)
            started = time.perf_counter()
            for child in children:
                send_line(child, "GO")
            give_up = started + RUN_DEADLINE
            while not self.drained(client, prefix):
                if time.perf_counter() > give_up:
                    raise RuntimeError(f"{variant.label}: not drained in {RUN_DEADLINE}s")
                if any(child.poll() is not None for child in children):
                    raise RuntimeError(f"{variant.label}: a consumer exited early")
                time.sleep(POLL_INTERVAL)
            seconds = time.perf_counter() - started
            masters_after, replicas_after = self.deployments.cpu(variant.deployment)
            results = []
            for child in children:
                send_line(child, "STOP")
                line = read_line(child)
                if not line.startswith("RESULT "):
                    raise RuntimeError(f"a consumer ended without a result: {line!r}")
                results.append(json.loads(line.removeprefix("RESULT ")))
                child.wait(timeout=CHILD_TIMEOUT)
        finally:
            client.close()
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        handled = sum(result["handled"] for result in results)
        if handled != self.messages:
            raise RuntimeError(f"{variant.label}: handled {handled}, expected {self.messages}")
        return Run(seconds, handled, sum(result["round_trips"] for result in results),
                   client_cpu=sum(result["cpu"] for result in results),
                   master_cpu=masters_after - masters_before,
                   replica_cpu=replicas_after - replicas_before)


def read_line(child: subprocess.Popen[str]) -> str:
    assert child.stdout is not None
    return child.stdout.readline().strip()


def send_line(child: subprocess.Popen[str], line: str) -> None:
    assert child.stdin is not None
    child.stdin.write(line + "\n")
    child.stdin.flush()


def measure(bench: Bench, repetitions: int) -> dict[Variant, list[Run]]:
    runs: dict[Variant, list[Run]] = {variant: [] for variant in VARIANTS}
    bench.run(Variant("cluster", "dedup", 1))  # warm-up: imports, page cache, server memory
    for repetition in range(repetitions):
        for variant in VARIANTS:
            runs[variant].append(bench.run(variant))
            print(f"  repetition {repetition + 1}/{repetitions}: {variant.label}: "
                  f"{bench.messages / runs[variant][-1].seconds:,.0f} msgs/s", flush=True)
    return runs


# -- the report ----------------------------------------------------------------------------------


def rate(run: Run, processes: int = 1) -> float:
    return run.handled / run.seconds / processes


def micros(seconds_per_message: Iterable[float]) -> float:
    """The median of per-run seconds per message, in µs."""
    return statistics.median(seconds_per_message) * 1e6


def median_rate(runs: list[Run], processes: int = 1) -> float:
    return statistics.median(rate(run, processes) for run in runs)


def single_counterpart(variant: Variant) -> Variant:
    return dataclasses.replace(variant, deployment="single")


def report(bench: Bench, runs: dict[Variant, list[Run]], repetitions: int) -> str:
    server = redis.Redis.from_url(bench.deployments.single.url)
    try:
        version = server.info("server")["redis_version"]
    finally:
        server.close()
    stream_masters = [master_of(key_slot(tag.encode()), bench.masters) + 1 for tag in bench.tags]
    namespace_masters = [
        master_of(key_slot(f"redis:{KEY_PREFIX}:{group}".encode()), bench.masters) + 1
        for group in bench.groups
    ]

    def ratio(variant: Variant) -> str:
        per_process = median_rate(runs[variant], variant.processes)
        if variant.dedup == "apart":
            combined = median_rate(runs[dataclasses.replace(variant, dedup="dedup")])
            return f"{per_process / combined:.2f}× the combined call"
        if variant.deployment == "cluster":
            single = median_rate(runs[single_counterpart(variant)], variant.processes)
            return f"{per_process / single:.2f}×"
        return "1.00×"

    def cpu(variant: Variant, seconds: Callable[[Run], float]) -> float:
        return micros(seconds(run) / run.handled for run in runs[variant])

    results = table(VARIANTS, [
        ("median msgs/s", lambda v: f"{median_rate(runs[v]):,.0f}"),
        ("min – max msgs/s", lambda v: f"{min(rate(r) for r in runs[v]):,.0f} – "
                                       f"{max(rate(r) for r in runs[v]):,.0f}"),
        ("msgs/s per process", lambda v: f"{median_rate(runs[v], v.processes):,.0f}"),
        ("round trips / msg",
         lambda v: f"{statistics.median(r.round_trips / r.handled for r in runs[v]):.3f}"),
        ("client CPU µs/msg", lambda v: f"{cpu(v, lambda r: r.client_cpu):.1f}"),
        ("Redis CPU µs/msg: masters + replicas",
         lambda v: f"{cpu(v, lambda r: r.master_cpu):.1f} + "
                   f"{cpu(v, lambda r: r.replica_cpu):.1f}"),
        ("ratio to one node (per process)", ratio),
    ], label=lambda v: v.label)
    goals = []
    for processes in (1, 3):
        cluster = runs[Variant("cluster", "dedup", processes)]
        single = runs[Variant("single", "dedup", processes)]
        value = median_rate(cluster) / median_rate(single)
        _, spread = paired([rate(r) for r in cluster], [rate(r) for r in single],
                           lambda r: r >= CLUSTER_DEDUP_MIN_RATIO)
        met = "yes" if value >= CLUSTER_DEDUP_MIN_RATIO else "**no**"
        goals.append(f"- {met}: {processes} process{'es' * (processes > 1)} — {value:.2f}× "
                     f"({spread})")
    return render(
        "redis_cluster", measured_on=measured_on(COMMAND), version=version,
        redis_version=redis.__version__, messages=bench.messages, STREAMS=STREAMS,
        repetitions=repetitions, table=results, goals=goals,
        CLUSTER_DEDUP_MIN_RATIO=CLUSTER_DEDUP_MIN_RATIO,
        streams="`<prefix>:{" + "}`, `<prefix>:{".join(bench.tags) + "}`",
        stream_masters=", ".join(map(str, stream_masters)),
        namespace_masters=", ".join(map(str, namespace_masters)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_runs(parser, DEFAULT_MESSAGES, DEFAULT_REPETITIONS)
    parser.add_argument("--write", action="store_true", help="rewrite the README section")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        asyncio.run(consume(json.loads(args.child)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-redis-cluster-") as directory:
        deployments = Deployments(Path(directory))
        deployments.start()
        try:
            bench = Bench(deployments, args.messages)
            runs = measure(bench, args.repetitions)
            section = report(bench, runs, args.repetitions)
        finally:
            deployments.stop()
    publish(SECTION_NAME, section, write=args.write, append=True)


if __name__ == "__main__":
    main()
