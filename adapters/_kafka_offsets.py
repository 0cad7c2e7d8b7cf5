"""Per-partition settle tracking for the Kafka adapter, and the commit metadata that carries it.

Kafka keeps one number per partition and group: the committed offset, "everything below is
done". Messages here are settled out of order (many run at once, one waits for its retry while
its neighbours are acked), so the adapter commits the *mark* -- the lowest offset not yet settled
-- and writes what it knows above the mark into the commit's metadata string: which offsets in
``[mark, end)`` are settled, and how often each unsettled one was delivered. A consumer that gets
the partition next (after a restart or a rebalance) reads it back, skips what was settled and
counts on from the deliveries recorded. It is the idea of Confluent's parallel-consumer, with an
encoding of our own:

``rs1:`` + URL-safe base64 (unpadded) of a sequence of varints, pairs of *(length, code)* that
cover ``[mark, end)`` from the mark up, one run each of offsets alike: code 0 is settled, code
``k >= 1`` unsettled and delivered ``k - 1`` times. Offsets at ``end`` and above are unknown:
delivered as new. Offsets a fetch never returned (transaction markers, compacted records) count as
settled: nothing there needs running.

The metadata has a size limit (the broker's ``offset.metadata.max.bytes``, 4096 by default). When
the runs do not fit, the later ones are left out: the offsets they covered become unknown, so a
settled one among them may run again (a duplicate, which a dedup store turns into a no-op) but
no unsettled one is ever skipped, and the committed offset itself never passes an unsettled one.
Metadata this module did not write (another client's) is ignored.

Nothing here does I/O: the consumer thread and the event loop call it under the consumer's lock.
"""

from __future__ import annotations

import base64
import binascii
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

PREFIX = "rs1:"
# The broker's default offset.metadata.max.bytes: a commit with longer metadata is refused.
DEFAULT_METADATA_LIMIT = 4096
SETTLED = 0

Run = tuple[int, int]  # (length, code): code 0 settled, k >= 1 unsettled after k - 1 deliveries


def _varint(value: int, out: bytearray) -> None:
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _varints(data: bytes) -> Iterator[int]:
    value = shift = 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            if shift > 63:
                raise ValueError("a varint longer than 9 bytes")
            continue
        yield value
        value = shift = 0
    if shift:
        raise ValueError("the metadata ends inside a varint")


def encode(runs: Iterable[Run], limit: int = DEFAULT_METADATA_LIMIT) -> str:
    """The metadata string for ``runs`` (from the mark up), at most ``limit`` characters: the
    longest prefix of the runs that fits (empty when not even the prefix fits)."""
    body = bytearray()
    cut = [0]  # body lengths after each run, to cut back to
    for length, code in runs:
        if length <= 0:
            continue
        _varint(length, body)
        _varint(code, body)
        cut.append(len(body))
    for kept in reversed(cut):
        text = PREFIX + base64.urlsafe_b64encode(bytes(body[:kept])).decode().rstrip("=")
        if len(text) <= limit:
            return text if kept else ""
    return ""


def decode(metadata: str | None) -> list[Run]:
    """The runs of metadata :func:`encode` wrote; [] for none, for another client's, and for
    any that cannot be read (nothing known above the mark: everything from it is delivered)."""
    if not metadata or not metadata.startswith(PREFIX):
        return []
    text = metadata[len(PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        numbers = list(_varints(raw))
    except (ValueError, binascii.Error):
        return []
    if len(numbers) % 2:
        return []
    runs = [(numbers[i], numbers[i + 1]) for i in range(0, len(numbers), 2)]
    return runs if all(length > 0 for length, _ in runs) else []


def merged(runs: Iterable[Run]) -> list[Run]:
    """``runs`` with neighbours of one code joined (the form :meth:`PartitionOffsets.runs`
    gives)."""
    out: list[Run] = []
    for length, code in runs:
        if length <= 0:
            continue
        if out and out[-1][1] == code:
            out[-1] = (out[-1][0] + length, code)
        else:
            out.append((length, code))
    return out


@dataclass
class Fetched:
    """What the tracker says of a fetched offset: settled before (skip it), or to deliver,
    delivered ``attempts`` times before."""

    settled: bool
    attempts: int = 0


class PartitionOffsets:
    """Which offsets of one partition are settled, from the committed offset and its metadata
    on, as records are fetched, delivered and settled.

    Args:
        committed: the group's committed offset (where fetching starts).
        runs: the runs its metadata carried (:func:`decode`).
    """

    def __init__(self, committed: int, runs: Iterable[Run] = ()) -> None:
        self.fetched_to = committed  # one past the highest offset fetched
        # fetched and not settled: offset -> times delivered; in fetch order, which is offset
        # order (only offsets past fetched_to are added), so the first is the mark
        self._unsettled: dict[int, int] = {}
        # what the metadata says of [fetched_to, its end): runs not yet reached by the fetch,
        # as [start, end, code]
        self._ahead: deque[list[int]] = deque()
        start = committed
        for length, code in merged(runs):
            self._ahead.append([start, start + length, code])
            start += length
        self.changed = bool(self._ahead)  # since the last commit taken

    # -- the consumer's events ---------------------------------------------------------------

    def fetched(self, offset: int) -> Fetched:
        """A fetch returned ``offset`` (offsets come in increasing order). Offsets between the
        last one fetched and this one that the metadata called unsettled are gone (compacted or
        deleted): settled."""
        if offset < self.fetched_to:
            # a second fetch of it (a seek back): as it stands
            attempts = self._unsettled.get(offset)
            return Fetched(attempts is None, attempts or 0)
        ahead = self._ahead
        while ahead and ahead[0][1] <= offset:
            ahead.popleft()
            self.changed = True
        found = Fetched(False)
        if ahead:  # the runs are contiguous from fetched_to: the first holds this offset
            start, _, code = ahead[0]
            if start < offset:
                self.changed = True  # offsets skipped inside the run: known gone now
            found = Fetched(code == SETTLED, max(0, code - 1))
            ahead[0][0] = offset + 1
            if ahead[0][0] >= ahead[0][1]:
                ahead.popleft()
        self.fetched_to = offset + 1
        if not found.settled:
            self._unsettled[offset] = found.attempts
        return found

    def delivered(self, offset: int, attempts: int) -> None:
        """``offset`` was handed out: delivered ``attempts`` times so far."""
        if offset in self._unsettled:
            self._unsettled[offset] = attempts
            self.changed = True

    def settle(self, offset: int) -> bool:
        """``offset`` is done (acked, or dead-lettered and acked); False if it was not pending."""
        if self._unsettled.pop(offset, None) is None:
            return False
        self.changed = True
        return True

    # -- what to commit ----------------------------------------------------------------------

    @property
    def mark(self) -> int:
        """The offset to commit: the lowest not settled (or the next to fetch)."""
        return next(iter(self._unsettled), self.fetched_to)

    @property
    def pending(self) -> int:
        """Fetched offsets not yet settled."""
        return len(self._unsettled)

    def runs(self) -> list[Run]:
        """What is known above the mark, as runs (see the module's docstring); a trailing run
        of offsets never delivered is left out (unknown is the same as new)."""
        runs: list[Run] = []
        at = self.mark
        for offset, attempts in self._unsettled.items():  # what is pending, not all fetched
            if offset > at:
                runs.append((offset - at, SETTLED))
            runs.append((1, attempts + 1))
            at = offset + 1
        if self.fetched_to > at:
            runs.append((self.fetched_to - at, SETTLED))
        for start, end, code in self._ahead:
            runs.append((end - start, code))
        runs = merged(runs)
        while runs and runs[-1][1] == 1:  # never delivered: the same as unknown
            runs.pop()
        return runs

    def commit(self, limit: int = DEFAULT_METADATA_LIMIT) -> tuple[int, str]:
        """The offset and metadata to commit now; the change flag is cleared."""
        self.changed = False
        return self.mark, encode(self.runs(), limit)


def settled_between(mark: int, runs: Iterable[Run], end: int) -> int:
    """How many offsets from ``mark`` up to ``end`` the ``runs`` call settled."""
    count, at = 0, mark
    for length, code in runs:
        if at >= end:
            break
        if code == SETTLED:
            count += min(length, end - at)
        at += length
    return count


__all__ = ["DEFAULT_METADATA_LIMIT", "PREFIX", "Fetched", "PartitionOffsets", "decode",
           "encode", "merged", "settled_between"]
