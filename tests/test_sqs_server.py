"""The private SQS-compatible server the SQS adapter's tests will use (groundwork): ElasticMQ
sends, redelivers and deletes, keeps a FIFO group in order and drops a duplicate, keeps its
queues and messages across a SIGKILL, and says why when it cannot start. Also the cache of its
jars: one Maven run for concurrent callers, nothing marked complete after a failed one."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.maven_jars import HERE, MARKER, JarsUnavailable, ensure, version
from tests.sqs_processes import SqsServer

boto3 = pytest.importorskip("boto3", reason='the SQS tests need boto3 ("reliable-sub[bench]")')


@pytest.fixture
def sqs(sqs_server: SqsServer) -> Iterator[Any]:
    client = boto3.client("sqs", **sqs_server.client_options)
    yield client
    client.close()


def _queue(sqs: Any, fifo: bool = False) -> str:
    name = f"groundwork-{uuid.uuid4().hex[:8]}" + (".fifo" if fifo else "")
    attributes = {"FifoQueue": "true"} if fifo else {}
    return str(sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"])


def test_a_message_not_deleted_comes_back_counted_then_is_deleted(sqs: Any) -> None:
    url = _queue(sqs)
    sqs.send_message(QueueUrl=url, MessageBody="pay 10 EUR", MessageAttributes={
        "idempotency-key": {"DataType": "String", "StringValue": "order-1"}})
    [first] = sqs.receive_message(QueueUrl=url, MessageAttributeNames=["All"],
                                  MessageSystemAttributeNames=["All"])["Messages"]
    assert first["MessageAttributes"]["idempotency-key"]["StringValue"] == "order-1"
    assert first["Attributes"]["ApproximateReceiveCount"] == "1"
    # a nack: visible again at once, received again with a new handle and a higher count
    sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=first["ReceiptHandle"],
                                  VisibilityTimeout=0)
    [second] = sqs.receive_message(QueueUrl=url, MessageSystemAttributeNames=["All"])["Messages"]
    assert second["Attributes"]["ApproximateReceiveCount"] == "2"
    assert second["ReceiptHandle"] != first["ReceiptHandle"]
    done = sqs.delete_message_batch(QueueUrl=url, Entries=[
        {"Id": "0", "ReceiptHandle": second["ReceiptHandle"]}])
    assert [entry["Id"] for entry in done["Successful"]] == ["0"]
    # AWS leaves the list out of an empty reply; ElasticMQ sends an empty one
    assert not sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0).get("Messages")
    sqs.delete_queue(QueueUrl=url)


def test_a_fifo_queue_holds_a_group_back_and_drops_a_duplicate(sqs: Any) -> None:
    url = _queue(sqs, fifo=True)
    for body, group in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("a1", "a")):  # a1 twice
        sqs.send_message(QueueUrl=url, MessageBody=body, MessageGroupId=group,
                         MessageDeduplicationId=body)
    [a1] = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=1)["Messages"]
    during = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
    assert (a1["Body"], [m["Body"] for m in during]) == ("a1", ["b1"]), "a2 waits for a1"
    for message in (a1, *during):
        sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    rest = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
    assert [m["Body"] for m in rest] == ["a2"], "the second a1 was a duplicate"
    sqs.delete_queue(QueueUrl=url)


def test_queues_and_messages_survive_a_kill(private_sqs_server: SqsServer) -> None:
    sqs = boto3.client("sqs", **private_sqs_server.client_options)
    url = _queue(sqs)
    sqs.send_message_batch(QueueUrl=url, Entries=[
        {"Id": str(n), "MessageBody": f"m{n}"} for n in range(2)])
    sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=1, VisibilityTimeout=60)
    sqs.close()

    private_sqs_server.kill()
    private_sqs_server.start()
    sqs = boto3.client("sqs", **private_sqs_server.client_options)
    counts = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=[
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    assert counts == {"ApproximateNumberOfMessages": "1",
                      "ApproximateNumberOfMessagesNotVisible": "1"}, "the one in flight stays so"
    sqs.delete_queue(QueueUrl=url)
    sqs.close()


def test_a_failed_start_says_why(tmp_path: Path) -> None:
    server = SqsServer(tmp_path, jvm_options=("-Xmx1k",))  # the JVM refuses so small a heap
    with pytest.raises(AssertionError, match="exited with 1") as failure:
        server.start()
    assert "heap" in str(failure.value), "the log's tail is in the message"


def test_a_taken_port_is_given_up_for_another(tmp_path: Path) -> None:
    server = SqsServer(tmp_path)
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            server.start()
            assert server.port != taken
            sqs = boto3.client("sqs", **server.client_options)
            assert not sqs.list_queues().get("QueueUrls")
            sqs.close()
        finally:
            server.stop()
    assert server.process is None


# -- the cache of jars ---------------------------------------------------------------------------

_FAKE_MAVEN = """#!{python}
import pathlib, sys
with open({log!r}, "a") as log:
    log.write("mvn ran\\n")
if {fail!r}:
    print("[ERROR] no network", flush=True)
    sys.exit(1)
out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("-DoutputDirectory="))
pathlib.Path(out).mkdir(parents=True)
(pathlib.Path(out) / "elasticmq-server_2.13-{version}.jar").write_bytes(b"")
"""


def _fake_maven(directory: Path, *, fail: bool = False) -> tuple[dict[str, str], Path]:
    """An environment whose ``mvn`` writes one jar (or fails), and the log of its runs."""
    bin_dir, log = directory / "bin", directory / "mvn.log"
    bin_dir.mkdir()
    maven = bin_dir / "mvn"
    maven.write_text(_FAKE_MAVEN.format(python=sys.executable, log=str(log), fail=fail,
                                        version=version("elasticmq")))
    maven.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "RELIABLE_SUB_CACHE": str(directory / "cache")}, log


def test_concurrent_resolutions_run_maven_once(tmp_path: Path) -> None:
    env, log = _fake_maven(tmp_path)
    resolvers = [subprocess.Popen([sys.executable, str(HERE / "maven_jars.py"), "elasticmq"],
                                  env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(3)]
    printed = [resolver.communicate(timeout=60)[0].strip() for resolver in resolvers]
    assert [resolver.returncode for resolver in resolvers] == [0, 0, 0]
    directory = tmp_path / "cache" / f"elasticmq-{version('elasticmq')}"
    assert all(line.startswith(f"elasticmq jars: {directory} (") for line in printed), printed
    assert log.read_text() == "mvn ran\n", "the others waited on the lock, then found it done"
    pom_digest = hashlib.sha256((HERE / "sqs" / "pom.xml").read_bytes()).hexdigest()
    assert (directory / MARKER).read_text() == pom_digest + "\n"
    assert [jar.name for jar in directory.glob("*.jar")] == [
        f"elasticmq-server_2.13-{version('elasticmq')}.jar"]


def test_a_failed_resolution_leaves_nothing_marked(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    env, _ = _fake_maven(tmp_path, fail=True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(JarsUnavailable, match="no network"):
        ensure("elasticmq")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [
        f"elasticmq-{version('elasticmq')}.lock"]
