"""A fidelity probe of local SQS-compatible servers against what AWS documents.

    python -m tests.sqs_fidelity                      # every server, print the table
    python -m tests.sqs_fidelity --server moto        # one server (elasticmq, elasticmq-memory)
    python -m tests.sqs_fidelity --write              # ... and rewrite tests/sqs/FIDELITY.md

Each check (``tests/sqs_fidelity_checks.py``) drives a server through boto3 the way the SQS
adapter will, and compares what it does with what AWS's API reference documents (botocore's
bundled service model, the developer guide): "matches", "differs" (and how), or "AWS leaves it
open" (and what the server does). It is a probe, not a test: a difference is a fact to design
around, not a failure. It starts its own servers (``tests/sqs_processes.py``) in a temporary
directory; the few checks of timeouts wait real time, 1-2 s each, as the thing under test.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.maven_jars import version as jar_version
from tests.sqs_processes import ElasticMqServer, MotoServer, _HttpSqsServer

REPORT = Path(__file__).resolve().parent / "sqs" / "FIDELITY.md"
# One attempt per call: a probe wants to see each refusal, not botocore's retry of it.
PROBE_CLIENT_CONFIG = Config(retries={"mode": "standard", "max_attempts": 1},
                             read_timeout=30, connect_timeout=5)
# Short visibility timeouts for the checks that watch one expire (seconds).
SHORT_VISIBILITY = 1

MATCHES, DIFFERS, OPEN = "matches", "differs", "AWS leaves it open"


@dataclass(frozen=True)
class Outcome:
    verdict: str  # MATCHES, DIFFERS or OPEN
    observed: str


def judged(matches: bool, observed: str) -> Outcome:
    return Outcome(MATCHES if matches else DIFFERS, observed)


@dataclass(frozen=True)
class Check:
    title: str
    aws: str  # what AWS documents, in a line
    run: Callable[[Probe], Outcome]


CHECKS: list[Check] = []


def check(title: str, aws: str) -> Callable[[Callable[[Probe], Outcome]],
                                            Callable[[Probe], Outcome]]:
    """Register a check, in the order of the table's rows."""
    def register(run: Callable[[Probe], Outcome]) -> Callable[[Probe], Outcome]:
        CHECKS.append(Check(title, aws, run))
        return run
    return register


@dataclass(frozen=True)
class Reply:
    """A call's response, or what it was refused with: ``Error.Code`` as botocore parsed it,
    the error shape's name (botocore's ``QueryErrorCode``, else the code) and the exception
    class botocore raised."""

    response: dict[str, Any]
    code: str | None = None
    shape: str | None = None
    exception: str = ""

    @property
    def ok(self) -> bool:
        return self.code is None

    def refused_with(self, shape: str) -> bool:
        return self.shape == shape

    def __str__(self) -> str:
        if self.ok:
            return "ok"
        return f"{self.code}" if self.shape == self.code else f"{self.code} [{self.shape}]"


class Probe:
    """A server under probe: a client, unique queue names, calls that return refusals."""

    def __init__(self, kind: str, server: _HttpSqsServer, directory: Path) -> None:
        self.kind = kind
        self.server = server
        self.directory = directory
        self.sqs = self.client("sqs")
        self.run_id = uuid.uuid4().hex[:6]
        self._queues = 0

    def client(self, service: str) -> Any:
        return boto3.client(service, config=PROBE_CLIENT_CONFIG, **self.server.client_options)

    def queue(self, fifo: bool = False, **attributes: Any) -> str:
        """A new queue's URL (attributes given as keywords, values as strings)."""
        self._queues += 1
        name = f"probe-{self.run_id}-{self._queues}" + (".fifo" if fifo else "")
        if fifo:
            attributes["FifoQueue"] = "true"
        text = {key: str(value) for key, value in attributes.items()}
        return str(self.sqs.create_queue(QueueName=name, Attributes=text)["QueueUrl"])

    def call(self, operation: str, **params: Any) -> Reply:
        try:
            return Reply(getattr(self.sqs, operation)(**params))
        except ClientError as error:
            info = error.response.get("Error", {})
            code = str(info.get("Code"))
            return Reply(error.response, code, str(info.get("QueryErrorCode", code)),
                         type(error).__name__)

    def receive(self, url: str, count: int = 10, **params: Any) -> list[dict[str, Any]]:
        reply = self.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=count,
                                         MessageSystemAttributeNames=["All"],
                                         MessageAttributeNames=["All"], **params)
        return list(reply.get("Messages", []))

    def counts(self, url: str) -> tuple[int, int]:
        """(ApproximateNumberOfMessages, ApproximateNumberOfMessagesNotVisible)."""
        attributes = self.sqs.get_queue_attributes(
            QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages",
                                          "ApproximateNumberOfMessagesNotVisible"]
        )["Attributes"]
        return (int(attributes["ApproximateNumberOfMessages"]),
                int(attributes["ApproximateNumberOfMessagesNotVisible"]))

    def arn(self, url: str) -> str:
        return str(self.sqs.get_queue_attributes(
            QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"])

    def receive_until(self, url: str, within: float, **params: Any) -> tuple[list[Any], float]:
        """Poll (no long poll) until a receive returns messages, or ``within`` s pass; returns
        them and how long it took."""
        started = time.monotonic()
        while True:
            messages = self.receive(url, WaitTimeSeconds=0, **params)
            elapsed = time.monotonic() - started
            if messages or elapsed > within:
                return messages, elapsed
            time.sleep(0.05)  # polling with a deadline


SERVERS: dict[str, Callable[[Path], _HttpSqsServer]] = {
    "elasticmq": lambda directory: ElasticMqServer(directory, persistent=True),
    "elasticmq-memory": lambda directory: ElasticMqServer(directory),
    "moto": lambda directory: MotoServer(directory),
}


@contextlib.contextmanager
def probing(kind: str, directory: Path) -> Iterator[Probe]:
    directory.mkdir(parents=True, exist_ok=True)
    server = SERVERS[kind](directory)
    server.start()
    try:
        yield Probe(kind, server, directory)
    finally:
        server.stop()


def run(kind: str, directory: Path) -> dict[str, Outcome]:
    from tests import sqs_fidelity_checks  # noqa: F401  (registers the checks)

    results: dict[str, Outcome] = {}
    with probing(kind, directory / kind) as probe:
        for item in CHECKS:
            started = time.monotonic()
            try:
                results[item.title] = item.run(probe)
            except Exception as error:  # a check that broke says so in its cell
                results[item.title] = Outcome(DIFFERS, f"probe error: {type(error).__name__}: "
                                                       f"{error}")
            print(f"  {kind}: {item.title}: {results[item.title].verdict} "
                  f"({time.monotonic() - started:.1f}s)", file=sys.stderr)
    return results


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"elasticmq": f"ElasticMQ {jar_version('elasticmq')}, H2 store (as CI runs it)",
            "elasticmq-memory": f"ElasticMQ {jar_version('elasticmq')}, in memory",
            "moto": f"moto {version('moto')} (server mode)"}


def table(results: dict[str, dict[str, Outcome]]) -> str:
    kinds = list(results)
    names = versions()
    lines = ["| check | AWS documents | " + " | ".join(names[k] for k in kinds) + " |",
             "|---|---|" + "---|" * len(kinds)]
    for item in CHECKS:
        cells = []
        for kind in kinds:
            outcome = results[kind].get(item.title)
            cells.append("–" if outcome is None
                         else f"**{outcome.verdict}**: {outcome.observed}".replace("|", "\\|"))
        lines.append(f"| {item.title} | {item.aws} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=sorted(SERVERS), action="append")
    parser.add_argument("--write", action="store_true", help=f"rewrite {REPORT.name}'s table")
    args = parser.parse_args(argv)
    kinds = args.server or list(SERVERS)
    with tempfile.TemporaryDirectory(prefix="sqs-fidelity-") as directory:
        results = {kind: run(kind, Path(directory)) for kind in kinds}
    text = table(results)
    print(text)
    if args.write:
        _write(text)
    return 0


TABLE_START, TABLE_END = "<!-- table:start -->", "<!-- table:end -->"


def _write(text: str) -> None:
    report = REPORT.read_text()
    head, rest = report.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    REPORT.write_text(f"{head}{TABLE_START}\n{text}\n{TABLE_END}{tail}")


if __name__ == "__main__":
    # run the module's importable copy: the checks register themselves in it, not in __main__
    from tests.sqs_fidelity import main as imported_main

    sys.exit(imported_main())
