"""A middleware is one function plus one registration: this one logs slow handlers.

Run from the repository root::

    python examples/slow_handler_middleware.py

It publishes three reports to the in-memory broker; the handler takes 0.05 s for two of them and
0.4 s for the third, and the middleware logs that one. A middleware is
``async (context, call_next) -> Decision``: it may look at the message, time or wrap the rest of
the chain, and must pass the decision on (here unchanged).
"""

from __future__ import annotations

import logging
import sys
import time

from reliable_sub import Message, Subscriber
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.middleware import CallNext, Context, Decision

logger = logging.getLogger("example.slow_handlers")


class LogSlowHandlers:
    """Log a WARNING for every handler call that takes longer than ``threshold`` seconds."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    async def __call__(self, context: Context, call_next: CallNext) -> Decision:
        started = time.monotonic()
        decision = await call_next(context)
        elapsed = time.monotonic() - started
        if elapsed > self.threshold:
            logger.warning("slow handler %s: %.2fs for message %s (%s)", context.handler,
                           elapsed, context.message.id, context.message.data.decode())
        return decision


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    broker = MemoryAdapter()
    broker.ensure_subscription_sync("reports", "renderer")
    done: list[str] = []
    sub = Subscriber(broker, middleware=[LogSlowHandlers(threshold=0.2)])  # the registration

    @sub.handler("renderer")
    def render(message: Message) -> None:
        time.sleep(0.4 if message.data == b"report-2" else 0.05)  # the work being timed
        done.append(message.data.decode())

    with sub:
        for number in (1, 2, 3):
            broker.publish_sync("reports", f"report-{number}".encode())
        deadline = time.monotonic() + 10
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # waiting for the output of a demo, polled with a deadline
    print("rendered:", ", ".join(sorted(done)))
    return 0 if len(done) == 3 else 1


if __name__ == "__main__":
    sys.exit(main())
