"""The Pub/Sub benchmark's emulator, its topics and subscriptions, and what both workloads share.

:class:`Emulator` starts ``cloud-pubsub-emulator`` (or uses ``--host``) and reads its processes'
CPU time from ``/proc``; :class:`Bench` publishes a fresh backlog per run (not timed), checks
that nothing is left and deletes it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.api_core import exceptions as google_errors
from google.cloud import pubsub_v1
from google.pubsub_v1.services.subscriber import SubscriberAsyncClient
from google.pubsub_v1.services.subscriber.transports import (
    SubscriberGrpcAsyncIOTransport,
)

from reliable_sub.testing.services import EmulatorProcess

# The emulator accepts any project id of 6+ characters.
PROJECT = "bench-project"

PAYLOAD = b"x" * 64
# The subscription's ack deadline in workload 1 (the Pub/Sub default); no run needs extensions.
ACK_DEADLINE = 10
# google-cloud-pubsub's FlowControl.max_messages for (a) (its default) and (b)'s pull size; the
# emulator returns at most 100 messages per pull or streamed response anyway.
GOOGLE_MAX_MESSAGES = 1000
# (b)'s RPC deadline for one pull; it never waits in a run (all published).
FINAL_PULL_TIMEOUT = 1.0
# Deadlines of the empty pulls that show how long the emulator holds an empty pull.
EMPTY_PULL_DEADLINES = (1.0, 5.0)
# The publisher batches this many messages per publish call (publishing is not timed).
PUBLISH_BATCH = 1_000
PUBLISH_LATENCY = 0.01
# A run that has not drained after this many seconds is a hang, not a slow result.
# Seconds the consumers get to stop; nothing is in flight when they are asked to.
SHUTDOWN_TIMEOUT = 10.0

STREAMING = "(a) google-cloud-pubsub streaming pull, subscribe() with FlowControl(1000)"
UNARY = "(b) google-cloud-pubsub unary pull(1000) + acknowledge per batch"
SUB = "(c) Subscriber(PubSubAdapter), default policies, no dedup"

# Every topic and subscription this process creates starts with this.
NAME_PREFIX = f"bench-{uuid.uuid4().hex[:8]}"


# -- the emulator --------------------------------------------------------------------------------


class Emulator:
    """An emulator this process started (``host``), or one given with ``--host``."""

    def __init__(self, host: str | None) -> None:
        self.host = host or ""
        self.process: subprocess.Popen[bytes] | None = None
        self._started: EmulatorProcess | None = None
        self.log_path = ""
        self._pids: list[int] = []
        self._ticks = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> Emulator:
        if not self.host:
            self._start()
        os.environ["PUBSUB_EMULATOR_HOST"] = self.host
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._started is not None:
            self._started.stop()

    def _start(self) -> None:
        self._started = EmulatorProcess()
        try:
            self._started.start()
        except RuntimeError as error:
            raise SystemExit(str(error)) from None
        self.process = self._started.process
        self.log_path = self._started.log_path
        self.host = self._started.host
        self._pids = self._group_pids()

    def _group_pids(self) -> list[int]:
        """The processes of the emulator's process group (the launcher script and its JVM)."""
        assert self.process is not None
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[2]) == self.process.pid:
                        pids.append(int(entry))
        return pids

    def cpu_seconds(self) -> float | None:
        """User + sys seconds the emulator's processes have used (None: not ours to read)."""
        if not self._pids:
            return None
        total = 0
        for pid in self._pids:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / self._ticks


# -- topics, subscriptions, backlogs -------------------------------------------------------------


@dataclass(frozen=True)
class Names:
    """One run's topic and subscription (short names and full paths)."""

    topic_id: str
    subscription_id: str

    @property
    def topic(self) -> str:
        return f"projects/{PROJECT}/topics/{self.topic_id}"

    @property
    def subscription(self) -> str:
        return f"projects/{PROJECT}/subscriptions/{self.subscription_id}"


class Bench:
    """The emulator, a publisher and an admin client shared by every run."""

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator
        self.publisher = pubsub_v1.PublisherClient(
            batch_settings=pubsub_v1.types.BatchSettings(
                max_messages=PUBLISH_BATCH, max_latency=PUBLISH_LATENCY
            )
        )
        self.admin = pubsub_v1.SubscriberClient()
        self._runs: Counter[str] = Counter()

    def close(self) -> None:
        self.publisher.stop()
        self.admin.close()

    def backlog(
        self, slug: str, payloads: Sequence[bytes], ack_deadline: int = ACK_DEADLINE
    ) -> Names:
        """A fresh topic and subscription with ``payloads`` published (not timed)."""
        self._runs[slug] += 1
        base = f"{NAME_PREFIX}-{slug}-{self._runs[slug]}"
        names = Names(f"{base}-topic", f"{base}-sub")
        self.publisher.create_topic(name=names.topic)
        self.admin.create_subscription(
            name=names.subscription, topic=names.topic, ack_deadline_seconds=ack_deadline
        )
        futures = [self.publisher.publish(names.topic, payload) for payload in payloads]
        ids = {future.result() for future in futures}
        if len(ids) != len(payloads):
            raise RuntimeError(f"published {len(ids)} distinct messages, not {len(payloads)}")
        return names

    def left_over(self, names: Names) -> int:
        """How many messages a pull with a short deadline still gets (should be none)."""
        try:
            response = self.admin.pull(
                subscription=names.subscription,
                max_messages=GOOGLE_MAX_MESSAGES,
                timeout=FINAL_PULL_TIMEOUT,
                retry=None,
            )
        except google_errors.DeadlineExceeded:
            return 0
        return len(response.received_messages)

    def empty_pull_waits(self) -> dict[float, float]:
        """Seconds an empty pull takes, by its deadline, on a fresh subscription."""
        names = self.backlog("empty", [])
        waits = {}
        try:
            for deadline in EMPTY_PULL_DEADLINES:
                started = time.perf_counter()
                with contextlib.suppress(google_errors.DeadlineExceeded):
                    self.admin.pull(
                        subscription=names.subscription, max_messages=1, timeout=deadline,
                        retry=None,
                    )
                waits[deadline] = time.perf_counter() - started
        finally:
            self.delete(names)
        return waits

    def delete(self, names: Names) -> None:
        with contextlib.suppress(google_errors.NotFound):
            self.admin.delete_subscription(subscription=names.subscription)
        with contextlib.suppress(google_errors.NotFound):
            self.publisher.delete_topic(topic=names.topic)



def aio_client(host: str, interceptors: Sequence[Any] = ()) -> SubscriberAsyncClient:
    """The async GAPIC client on a plain-text ``grpc.aio`` channel (as the adapter makes it)."""
    channel = grpc.aio.insecure_channel(host, interceptors=list(interceptors) or None)
    return SubscriberAsyncClient(transport=SubscriberGrpcAsyncIOTransport(channel=channel))

