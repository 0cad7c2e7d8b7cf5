"""Three Kafka requests over a plain socket, for the test brokers (:mod:`tests.kafka_processes`).

* Metadata: which brokers serve (a broker lists only those registered and unfenced, so "every
  node listed" means the cluster serves), and who leads a partition (for "kill the leader").
* FindCoordinator and InitProducerId: asked until they succeed, they make a new broker create
  and load its group and transaction coordinators' topics, and get its first block of producer
  ids from the controller. A client's first group join or idempotent producer would otherwise
  find them loading and back off: the first consumer of a test waited 3 s, now 0.2 s.

Asking without a Kafka client keeps the test brokers independent of the client the adapter uses
(and of whether one is installed). Each request is at a version before the flexible
(tagged-field) encoding that every broker from 2.x to 4.x answers.
"""

from __future__ import annotations

import itertools
import socket
import struct
from dataclasses import dataclass

METADATA = (3, 4)  # (API key, version)
FIND_COORDINATOR = (10, 1)
INIT_PRODUCER_ID = (22, 0)
# FindCoordinator's key types
GROUP, TRANSACTION = 0, 1
CLIENT_ID = b"reliable-sub-tests"
# A loopback broker answers in milliseconds; this bounds one that accepted but hangs.
REQUEST_TIMEOUT = 2.0
_correlation = itertools.count(1)


@dataclass(frozen=True)
class PartitionMetadata:
    partition: int
    leader: int  # -1 while none is elected
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


@dataclass(frozen=True)
class Metadata:
    brokers: dict[int, tuple[str, int]]  # node id -> (host, port), unfenced brokers only
    cluster_id: str | None
    controller: int
    topics: dict[str, tuple[int, dict[int, PartitionMetadata]]]  # name -> (error, partitions)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str | None:
        length = self.take(">h")
        if length < 0:
            return None
        text = self.data[self.offset:self.offset + length].decode()
        self.offset += length
        return text

    def int32s(self) -> tuple[int, ...]:
        return tuple(self.take(">i") for _ in range(self.take(">i")))


def _request(port: int, api: tuple[int, int], body: bytes, timeout: float) -> _Reader:
    """Send one request to the broker on ``127.0.0.1:port``; its response after the header.
    Raises ``OSError`` when the broker does not answer (not listening yet, or it hung up)."""
    correlation = next(_correlation)
    header = struct.pack(">hhih", *api, correlation, len(CLIENT_ID)) + CLIENT_ID
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(struct.pack(">i", len(header) + len(body)) + header + body)
        size = struct.unpack(">i", _receive(connection, 4))[0]
        reader = _Reader(_receive(connection, size))
    if reader.take(">i") != correlation:
        raise OSError("a response to another request")
    return reader


def _string(text: str) -> bytes:
    encoded = text.encode()
    return struct.pack(">h", len(encoded)) + encoded


def fetch_metadata(port: int, topics: list[str] | None = None,
                   timeout: float = REQUEST_TIMEOUT) -> Metadata:
    """Metadata of ``topics`` (``None``: all of them) from the broker on ``port``."""
    if topics is None:
        body = struct.pack(">i", -1)
    else:
        body = struct.pack(">i", len(topics)) + b"".join(_string(name) for name in topics)
    body += b"\x00"  # allow_auto_topic_creation: false
    reader = _request(port, METADATA, body, timeout)
    reader.take(">i")  # throttle_time_ms
    brokers = {}
    for _ in range(reader.take(">i")):
        node = reader.take(">i")
        host = reader.string() or ""
        brokers[node] = (host, reader.take(">i"))
        reader.string()  # rack
    cluster_id = reader.string()
    controller = reader.take(">i")
    found = {}
    for _ in range(reader.take(">i")):
        error = reader.take(">h")
        name = reader.string() or ""
        reader.take(">b")  # is_internal
        partitions = {}
        for _ in range(reader.take(">i")):
            reader.take(">h")  # the partition's error code
            index = reader.take(">i")
            leader = reader.take(">i")
            partitions[index] = PartitionMetadata(index, leader, reader.int32s(), reader.int32s())
        found[name] = (error, partitions)
    return Metadata(brokers, cluster_id, controller, found)


def find_coordinator(port: int, key: str, key_type: int = GROUP,
                     timeout: float = REQUEST_TIMEOUT) -> int:
    """The error code of a FindCoordinator request (0: found; the first request for a key
    type makes the broker create that coordinator's internal topic)."""
    reader = _request(port, FIND_COORDINATOR, _string(key) + struct.pack(">b", key_type),
                      timeout)
    reader.take(">i")  # throttle_time_ms
    return reader.take(">h")


def init_producer_id(port: int, timeout: float = REQUEST_TIMEOUT) -> int:
    """The error code of an idempotent (not transactional) producer's InitProducerId."""
    reader = _request(port, INIT_PRODUCER_ID, struct.pack(">hi", -1, 60_000), timeout)
    reader.take(">i")  # throttle_time_ms
    return reader.take(">h")


def _receive(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise OSError("the broker closed the connection mid-response")
        data += chunk
    return bytes(data)
