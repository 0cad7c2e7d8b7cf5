"""One Kafka Metadata request over a plain socket: which brokers serve, who leads a partition.

The test brokers' readiness check and their "kill the leader" helper need only this, and asking
it without a Kafka client keeps :mod:`tests.kafka_processes` independent of the client the
adapter uses (and of whether one is installed). Metadata v4 is the version asked: every broker
from 1.0 to 4.x answers it, and it is the last one before the flexible (tagged-field) encoding.
A broker lists only brokers that are registered and unfenced, so "every broker listed" means the
cluster serves.
"""

from __future__ import annotations

import itertools
import socket
import struct
from dataclasses import dataclass

METADATA_API_KEY = 3
METADATA_VERSION = 4
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


def fetch_metadata(port: int, topics: list[str] | None = None,
                   timeout: float = REQUEST_TIMEOUT) -> Metadata:
    """Ask the broker on ``127.0.0.1:port``; ``topics=None`` asks for all. Raises ``OSError``
    when it does not answer (not listening yet, or it closed the connection)."""
    correlation = next(_correlation)
    body = struct.pack(">hhih", METADATA_API_KEY, METADATA_VERSION, correlation,
                       len(CLIENT_ID)) + CLIENT_ID
    if topics is None:
        body += struct.pack(">i", -1)
    else:
        body += struct.pack(">i", len(topics))
        for name in topics:
            encoded = name.encode()
            body += struct.pack(">h", len(encoded)) + encoded
    body += b"\x00"  # allow_auto_topic_creation: false
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _receive(connection, 4))[0]
        reader = _Reader(_receive(connection, size))
    if reader.take(">i") != correlation:
        raise OSError("a Metadata response for another request")
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


def _receive(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise OSError("the broker closed the connection mid-response")
        data += chunk
    return bytes(data)
