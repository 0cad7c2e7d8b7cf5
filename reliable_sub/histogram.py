"""A sliding-window histogram of processing times, from which the lease length is read.

Pub/Sub's own client keeps a lifetime histogram of whole seconds, so a workload that gets faster
keeps paying for its slow past. This one forgets: a sample counts only while it is among the last
``max_samples`` and younger than ``window`` seconds, so the percentile follows the workload.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from .clock import Clock

# Ten minutes of history: long enough for a stable p99 at a few messages a second, short enough
# that a shift in the workload shows within minutes.
DEFAULT_WINDOW = 600.0
# Bounds memory and the cost of an insert (a memmove over at most this many floats).
DEFAULT_MAX_SAMPLES = 2000


class SlidingHistogram:
    """Percentiles over the recent samples only.

    Args:
        clock: the time source that ages samples.
        window: seconds a sample stays counted (> 0).
        max_samples: at most this many of the newest samples are counted (>= 1).
    """

    def __init__(
        self,
        clock: Clock,
        window: float = DEFAULT_WINDOW,
        max_samples: int = DEFAULT_MAX_SAMPLES,
    ) -> None:
        if not window > 0:
            raise ValueError(f"SlidingHistogram.window must be in (0, inf), got {window!r}")
        if max_samples < 1:
            raise ValueError(
                f"SlidingHistogram.max_samples must be in [1, inf), got {max_samples!r}"
            )
        self._clock = clock
        self._window = window
        self._max_samples = max_samples
        self._arrivals: deque[tuple[float, float]] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        self._forget(self._clock.now())
        return len(self._sorted)

    def add(self, seconds: float) -> None:
        """Record one observed duration."""
        if not seconds >= 0 or math.isinf(seconds):
            return
        now = self._clock.now()
        self._arrivals.append((now, seconds))
        bisect.insort(self._sorted, seconds)
        self._forget(now)

    def percentile(self, percent: float) -> float | None:
        """The ``percent``-th percentile (nearest rank) of counted samples; None when empty."""
        self._forget(self._clock.now())
        if not self._sorted:
            return None
        rank = math.ceil(percent / 100.0 * len(self._sorted))
        return self._sorted[min(len(self._sorted), max(1, rank)) - 1]

    def _forget(self, now: float) -> None:
        oldest_allowed = now - self._window
        arrivals = self._arrivals
        while arrivals and (
            len(arrivals) > self._max_samples or arrivals[0][0] < oldest_allowed
        ):
            _, value = arrivals.popleft()
            index = bisect.bisect_left(self._sorted, value)
            del self._sorted[index]
