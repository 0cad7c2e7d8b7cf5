"""The fault-injection scenarios (see conftest.py). They run in two lanes, one scenario at a
time in each: the Pub/Sub emulator's (its scenarios mostly wait out 10 s ack deadlines) and
everyone else's."""

from __future__ import annotations

PUBSUB_LANE, OTHER_LANE = "chaos-pubsub", "chaos"


def lane_of(nodeid: str) -> str:
    """The lane of the chaos scenario ``nodeid``."""
    _, _, name = nodeid.partition("::")
    return PUBSUB_LANE if "pubsub" in name or "emulator" in name else OTHER_LANE
