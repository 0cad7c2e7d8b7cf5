"""Testing your own handler against duplicates and faults: an example test file to copy.

The handler under test, ``charge``, calls a payment API for each order message. Payment APIs
(Stripe, Adyen...) take an idempotency key with each request and charge once per key; the
handler passes the message's ``idempotency_key``. The tests replay recorded orders
(``examples/recorded/orders.jsonl``: one of them published twice, one cut short) and check, per
order, that it was charged exactly once, under:

* duplicate delivery: every message handed to the handler twice, with no dedup store at all;
* random faults: lost acks, repeats, crashes between the charge and its record, a failing store;
* and, to show the tools catch what they are for, a careless handler without the key, which a
  crash after its charge makes charge twice.

Run it with ``python -m pytest examples/test_handler_under_faults.py -n 0`` (needs
``pip install "reliable-sub[testing]"``; no services: it runs on the in-memory broker).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from reliable_sub import DeadLetterPolicy, Message, RetryPolicy
from reliable_sub.testing.faults import DUPLICATE_DELIVERY, FaultInjector, Faults
from reliable_sub.testing.recorded import load_recorded, run_recorded

pytestmark = pytest.mark.asyncio

RECORDED = Path(__file__).parent / "recorded" / "orders.jsonl"
RETRY = RetryPolicy(min_backoff=1.0, max_backoff=30.0)  # clock seconds: they cost no real time
DEAD_LETTER = DeadLetterPolicy("orders-dead-letter", max_delivery_attempts=5)


class PaymentApi:
    """A stand-in for a payment API: one charge per idempotency key, as real ones promise."""

    def __init__(self) -> None:
        self.charged: Counter[str] = Counter()  # order -> charges
        self._charge_by_key: dict[str, str] = {}

    async def charge(self, order: str, amount: int, idempotency_key: str | None) -> str:
        if idempotency_key is not None and idempotency_key in self._charge_by_key:
            return self._charge_by_key[idempotency_key]  # the first charge's answer, again
        self.charged[order] += 1
        charge_id = f"ch_{order}_{self.charged[order]}"
        if idempotency_key is not None:
            self._charge_by_key[idempotency_key] = charge_id
        return charge_id


def charge_handler(
    api: PaymentApi, *, with_key: bool = True
) -> Callable[[Message], Awaitable[dict[str, str]]]:
    """The handler under test (in your service: the function you register with @sub.handler)."""

    async def charge(message: Message) -> dict[str, str]:
        order = json.loads(message.data)  # a cut-short order raises: retried, then dead-lettered
        key = message.idempotency_key if with_key else None
        charge_id = await api.charge(order["order"], order["amount"], key)
        return {"charge": charge_id}

    return charge


def charges_of(api: PaymentApi) -> Callable[[Message], int]:
    """What the report counts as a message's effects: the charges of its order."""

    def count(message: Message) -> int:
        try:
            return api.charged[json.loads(message.data)["order"]]
        except ValueError:
            return 0  # the cut-short order names none

    return count


async def test_every_order_is_charged_once_when_each_message_comes_twice() -> None:
    api = PaymentApi()
    report = await run_recorded(charge_handler(api), load_recorded(RECORDED),
                                faults=DUPLICATE_DELIVERY, dedup=None,  # the handler alone
                                retry=RETRY, dead_letter=DEAD_LETTER, effects=charges_of(api))
    assert report.doubled() == [], report.table()
    assert report.lost() == [], report.table()
    assert [entry.message.id for entry in report.dead_lettered()] == ["7d1c-005"]


@pytest.mark.parametrize("seed", range(5))
async def test_every_order_is_charged_once_under_random_faults(seed: int) -> None:
    api = PaymentApi()
    faults = FaultInjector(
        Faults(duplicate=0.3, lose_ack=0.2, repeat=0.2, interrupt=0.3, fail_store=0.1), seed=seed
    )
    report = await run_recorded(charge_handler(api), load_recorded(RECORDED), faults=faults,
                                retry=RETRY, dead_letter=DEAD_LETTER, effects=charges_of(api))
    assert report.doubled() == [], report.table()
    assert report.lost() == [], report.table()


async def test_a_handler_without_the_key_is_caught_charging_twice() -> None:
    api = PaymentApi()
    faults = FaultInjector(Faults(interrupt=0.5), seed=1)
    report = await run_recorded(charge_handler(api, with_key=False), load_recorded(RECORDED),
                                faults=faults, retry=RETRY, dead_letter=DEAD_LETTER,
                                effects=charges_of(api))
    # A crash between a charge and its record: the redelivery charges again. The dedup store
    # cannot help (nothing was recorded), only the payment API's idempotency key could.
    assert faults.injected["interrupt"] > 0
    assert report.doubled(), report.table()
