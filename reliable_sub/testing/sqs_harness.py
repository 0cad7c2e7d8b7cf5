"""The SQS adapter's harness for the shipped suite (a module of its own: ``harness`` is long)."""

from __future__ import annotations

import uuid
from typing import Any

from reliable_sub.clock import SystemClock
from reliable_sub.ports import Adapter
from reliable_sub.testing.cleanup import delete_sqs_queues
from reliable_sub.testing.harness import Features, Harness


def sqs_harness(client_options: dict[str, str], ack_deadline: float = 2.0,
                tick: float = 0.5) -> Harness:
    """An SQS server (ElasticMQ in the tests) at ``client_options`` (boto3's client arguments:
    ``endpoint_url``, ``region_name``, credentials). Real time. SQS counts visibility timeouts
    and long polls in whole seconds (a receive's timeout and a nack's delay are rounded up), so
    the tick is half a second: a nack of three ticks is still hidden from a receive of one. The
    run's queues (their names start with the run's prefix) are deleted afterwards. Figures are
    SQS's approximate counts, exact on ElasticMQ; it tells no oldest message's age."""
    from reliable_sub.adapters.sqs import SqsAdapter

    prefix = f"conf-{uuid.uuid4().hex[:10]}"
    options: dict[str, Any] = {k: v for k, v in client_options.items() if k != "endpoint_url"}
    url = client_options["endpoint_url"]

    async def new_adapter_for(at: str) -> Adapter:
        return SqsAdapter(endpoint_url=at, **options)

    async def cleanup() -> None:
        await delete_sqs_queues(client_options, prefix)

    # The Subscriber's own logic (hostile handlers, settling under failure, hung handlers) runs
    # on memory, Redis, NATS and RabbitMQ, on the same code path: here it would add a minute to
    # CI's run for nothing SQS-specific.
    features = Features(ordering=True, fan_out=False, oldest_age=False, subscriber_logic=False)
    return Harness(name="sqs", clock=SystemClock(), ack_deadline=ack_deadline, tick=tick,
                   new_adapter=lambda: new_adapter_for(url), prefix=prefix, cleanup=cleanup,
                   features=features, url=url, new_adapter_for=new_adapter_for)


__all__ = ["sqs_harness"]
