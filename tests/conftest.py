"""Test-wide settings: hypothesis profiles (``--hypothesis-profile=nightly`` for a long hunt)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# fixtures shared by the outbox tests: outbox (PostgreSQL and SQLite), pg_outbox
pytest_plugins = ["tests.outbox_support"]

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large]

# CI: a bounded search that runs in seconds.
settings.register_profile("ci", max_examples=20, stateful_step_count=25, deadline=None,
                          suppress_health_check=_SLOW_IS_FINE)
# A long search, for a nightly job or before a release.
settings.register_profile("nightly", max_examples=1000, stateful_step_count=60, deadline=None,
                          suppress_health_check=_SLOW_IS_FINE)
# Longer than CI, shorter than nightly: for checking a fix or a revert by hand.
settings.register_profile("hunt", max_examples=300, stateful_step_count=40, deadline=None,
                          suppress_health_check=_SLOW_IS_FINE)
settings.load_profile("ci")
