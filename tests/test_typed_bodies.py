"""Typed bodies: a handler annotated with a pydantic model, a dataclass or a TypedDict gets the
decoded, validated body; a body that does not validate is dead-lettered at its first attempt.
(The shipped adapter suite runs a dataclass body on every adapter.) This module's annotations
are strings (``from __future__ import annotations``), as they are in much user code."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, TypedDict

import msgspec
import pydantic
import pytest

from reliable_sub import (
    ConfigurationError,
    DeadLetterPolicy,
    MemoryDedupStore,
    Message,
    Outcome,
    Subscriber,
)
from reliable_sub import _bodies as bodies
from reliable_sub.adapters.memory import MemoryAdapter
from reliable_sub.dead_letters import DeadLetter
from tests.memory_world import serve_until, setup


class Order(pydantic.BaseModel):
    sku: str
    quantity: int = pydantic.Field(gt=0)


@dataclasses.dataclass
class Refund:
    order_id: str
    cents: int


class Parcel(msgspec.Struct):
    parcel_id: str
    grams: int


class Shipment(TypedDict):
    address: str
    express: bool


async def run(sub: Subscriber, broker: MemoryAdapter, clock: Any, payloads: list[bytes],
              done: int) -> None:
    for payload in payloads:
        broker.publish_sync("orders", payload)
    settled = (Outcome.ACKED, Outcome.DEAD_LETTERED)
    await serve_until(sub, lambda: sum(sub.stats[o] for o in settled) >= done,
                      "the messages to settle", 60, clock)


async def dead_letters(broker: MemoryAdapter) -> list[DeadLetter]:
    return [DeadLetter.of(d) for d in await broker.receive("dlq", 100, 0)]


async def test_a_pydantic_body_is_validated_and_a_bad_one_rejected_at_once() -> None:
    clock, broker, sub = setup(dead_letter=DeadLetterPolicy("orders-dlq", 5))
    broker.ensure_subscription_sync("orders-dlq", "dlq")
    seen: list[Order] = []

    @sub.handler("billing")
    async def charge(order: Order) -> None:
        seen.append(order)

    await run(sub, broker, clock, [b'{"sku": "a-1", "quantity": 2}', b'{"sku": "a-2", '
                                   b'"quantity": 0}', b"not json"], done=3)
    assert seen == [Order(sku="a-1", quantity=2)]
    assert sub.stats["rejected"] == 2 and sub.stats[Outcome.RETRY] == 0
    letters = await dead_letters(broker)
    assert sorted(letter.data for letter in letters) == [b"not json",
                                                         b'{"sku": "a-2", "quantity": 0}']
    for letter in letters:
        assert letter.reason == "rejected" and letter.handler_failures == 1
        assert letter.error_type == "reliable_sub.errors.BodyValidationError"
        assert "is not a valid Order" in letter.error_message


async def test_a_dataclass_body_and_the_message_in_a_sync_handler() -> None:
    clock, broker, sub = setup()
    seen: list[tuple[Refund, str]] = []

    @sub.handler("billing")
    def refund(body: Refund, message: Message) -> None:
        seen.append((body, message.id))

    await run(sub, broker, clock, [b'{"order_id": "o-1", "cents": "250"}'], done=1)
    assert seen == [(Refund("o-1", 250), "1")], "pydantic coerced the str to an int"


async def test_a_typed_dict_body_through_a_plain_decorator() -> None:
    clock, broker, sub = setup()
    seen: list[Shipment] = []

    def logged(function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any) -> Any:
            return function(*args)
        return wrapper

    @sub.handler("billing")
    @logged
    async def ship(shipment: Shipment) -> None:
        seen.append(shipment)

    await run(sub, broker, clock, [b'{"address": "1 Main St", "express": true}'], done=1)
    assert seen == [{"address": "1 Main St", "express": True}]


async def test_a_model_returned_is_stored_as_its_json() -> None:
    store = MemoryDedupStore()
    clock, broker, sub = setup(dedup=store)

    @sub.handler("billing")
    async def charge(order: Order) -> Order:
        return order.model_copy(update={"quantity": order.quantity + 1})

    await run(sub, broker, clock, [b'{"sku": "a-1", "quantity": 2}'], done=1)
    [record] = store._records.values()
    assert json.loads(record[2]) == {"sku": "a-1", "quantity": 3}


def test_untyped_handlers_are_registered_as_they_are() -> None:
    _, _, sub = setup()

    def plain(message): ...  # type: ignore[no-untyped-def]
    def annotated(message: Message) -> None: ...
    def as_dict(payload: dict[str, Any]) -> None: ...

    for subscription, handler in [("a", plain), ("b", annotated), ("c", as_dict)]:
        sub.handler(subscription)(handler)
        assert sub._routes[subscription].handler is handler


def test_an_unresolvable_body_type_is_refused_at_registration() -> None:
    _, _, sub = setup()

    async def later(order: NotYetDefined) -> None: ...  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(ConfigurationError, match=r"'NotYetDefined' of parameter 'order'.*define"):
        sub.handler("billing")(later)


def test_message_named_only_for_type_checkers_counts_as_message() -> None:
    _, _, sub = setup()

    def handle(message: reliable_sub_typing.Message) -> None: ...  # type: ignore[name-defined]  # noqa: F821

    sub.handler("billing")(handle)
    assert sub._routes["billing"].handler is handle


def test_a_typed_handler_must_take_what_it_is_called_with() -> None:
    _, _, sub = setup()

    def two(order: Order, message: Message, extra: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"handler\(body, message\)"):
        sub.handler("billing")(two)


async def test_without_pydantic_a_dataclass_is_built_from_the_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bodies, "_pydantic_decoder", lambda annotation: None)
    typed = bodies.typed_handler(lambda refund: refund, "test")
    assert typed is None, "an unannotated lambda is untyped"

    def refund(body: Refund) -> Refund:
        return body

    typed = bodies.typed_handler(refund, "test")
    assert typed is not None
    message = Message(id="m", data=b'{"order_id": "o", "cents": 5}', attributes={},
                      subscription="s")
    assert typed.call(message) == Refund("o", 5)
    for bad in (b"[1]", b'{"order_id": "o"}', b"{"):
        with pytest.raises(bodies.BodyValidationError, match="is not a valid Refund"):
            typed.call(Message(id="m", data=bad, attributes={}, subscription="s"))


async def test_a_msgspec_struct_body_and_result() -> None:
    store = MemoryDedupStore()
    clock, broker, sub = setup(dedup=store, dead_letter=DeadLetterPolicy("orders-dlq", 5))
    broker.ensure_subscription_sync("orders-dlq", "dlq")
    seen: list[Parcel] = []

    @sub.handler("billing")
    def weigh(parcel: Parcel) -> Parcel:
        seen.append(parcel)
        return Parcel(parcel.parcel_id, parcel.grams * 2)

    await run(sub, broker, clock, [b'{"parcel_id": "p-1", "grams": 500}',
                                   b'{"parcel_id": "p-2", "grams": "heavy"}'], done=2)
    assert seen == [Parcel("p-1", 500)]
    [record] = store._records.values()
    assert json.loads(record[2]) == {"parcel_id": "p-1", "grams": 1000}
    [letter] = await dead_letters(broker)
    assert letter.reason == "rejected" and "is not a valid Parcel" in letter.error_message
