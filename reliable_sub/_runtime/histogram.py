"""A sliding-window histogram of processing times, from which the lease length is read.

Pub/Sub's own client keeps a lifetime histogram of whole seconds, so a workload that gets faster
keeps paying for its slow past. This one forgets: a sample counts only while it is among the last
``max_samples`` and younger than ``window`` seconds, so the percentile follows the workload.
"""

from __future__ import annotations

import math
from collections import deque

from ..clock import Clock
from ..errors import ConfigurationError

# Ten minutes of history: long enough for a stable p99 at a few messages a second, short enough
# that a shift in the workload shows within minutes.
DEFAULT_WINDOW = 600.0
# Bounds memory, and the sort a percentile costs (it is asked for once per lease tick).
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
            raise ConfigurationError(f"SlidingHistogram.window must be in (0, inf), got {window!r}")
        if max_samples < 1:
            raise ConfigurationError(
                f"SlidingHistogram.max_samples must be in [1, inf), got {max_samples!r}"
            )
        self._clock = clock
        self._window = window
        self._max_samples = max_samples
        self._samples: deque[tuple[float, float]] = deque()
        self._sorted: list[float] | None = None  # built on demand; None when samples changed

    def __len__(self) -> int:
        self._forget(self._clock.now())
        return len(self._samples)

    def add(self, seconds: float, now: float | None = None) -> None:
        """Record one observed duration, at ``now`` (default: the clock's reading).

        Cheap by design: percentiles are computed when asked for.
        """
        if not seconds >= 0 or math.isinf(seconds):
            return
        samples = self._samples
        samples.append((self._clock.now() if now is None else now, seconds))
        if len(samples) > self._max_samples:
            samples.popleft()
        self._sorted = None

    def percentile(self, percent: float) -> float | None:
        """The ``percent``-th percentile (nearest rank) of counted samples; None when empty."""
        self._forget(self._clock.now())
        if not self._samples:
            return None
        if self._sorted is None:
            self._sorted = sorted(value for _, value in self._samples)
        ordered = self._sorted
        rank = math.ceil(percent / 100.0 * len(ordered))
        return ordered[min(len(ordered), max(1, rank)) - 1]

    def _forget(self, now: float) -> None:
        oldest_allowed = now - self._window
        samples = self._samples
        while samples and samples[0][0] < oldest_allowed:
            samples.popleft()
            self._sorted = None
