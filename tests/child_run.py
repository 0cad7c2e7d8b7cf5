"""The main of a test's consumer process (tests/kafka_*_consumer.py): run a Subscriber until
SIGTERM or SIGKILL, printing ``READY`` once it receives (``NOT STARTED`` after 60 s without),
the line the test waits for (tests/redis_processes.Child)."""

from __future__ import annotations

import threading
import time

from reliable_sub import Subscriber


def run_announcing_ready(sub: Subscriber) -> None:
    def announce() -> None:
        give_up = time.monotonic() + 60
        while not sub.running and time.monotonic() < give_up:
            time.sleep(0.01)
        print("READY" if sub.running else "NOT STARTED", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    sub.run()
