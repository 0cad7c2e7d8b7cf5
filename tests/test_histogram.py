from __future__ import annotations

import pytest

from reliable_sub._runtime.histogram import SlidingHistogram
from reliable_sub.clock import ManualClock
from reliable_sub.errors import ConfigurationError


def test_percentile_is_nearest_rank() -> None:
    histogram = SlidingHistogram(ManualClock())
    assert histogram.percentile(99) is None
    for value in range(1, 101):
        histogram.add(float(value))
    assert histogram.percentile(99) == 99.0
    assert histogram.percentile(50) == 50.0
    assert histogram.percentile(100) == 100.0


def test_old_samples_are_forgotten_by_age() -> None:
    clock = ManualClock()
    histogram = SlidingHistogram(clock, window=60)
    for _ in range(100):
        histogram.add(60.0)
    clock.advance(30)
    for _ in range(100):
        histogram.add(2.0)
    assert histogram.percentile(99) == 60.0
    clock.advance(31)
    assert histogram.percentile(99) == 2.0
    assert len(histogram) == 100


def test_old_samples_are_forgotten_by_count() -> None:
    histogram = SlidingHistogram(ManualClock(), max_samples=10)
    for value in [100.0] * 10 + [1.0] * 10:
        histogram.add(value)
    assert histogram.percentile(99) == 1.0
    assert len(histogram) == 10


def test_bad_samples_are_ignored_and_bad_settings_refused() -> None:
    histogram = SlidingHistogram(ManualClock())
    histogram.add(float("nan"))
    histogram.add(-1.0)
    histogram.add(float("inf"))
    assert len(histogram) == 0
    with pytest.raises(ConfigurationError, match="window"):
        SlidingHistogram(ManualClock(), window=0)
    with pytest.raises(ConfigurationError, match="max_samples"):
        SlidingHistogram(ManualClock(), max_samples=0)
