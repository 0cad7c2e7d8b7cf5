"""@idempotent with a return type that is a pydantic model, a dataclass or a msgspec Struct: the
first call's result is stored as its JSON form, and a replay returns the type again, not a
dict."""

from __future__ import annotations

import dataclasses

import msgspec
import pydantic
import pytest

from reliable_sub import MemoryDedupStore, StoredResultError
from reliable_sub.dedup import Completion, DedupKey
from reliable_sub.idempotency import idempotent


class Receipt(pydantic.BaseModel):
    order: int
    cents: int


class Parcel(msgspec.Struct):
    parcel_id: str
    grams: int


@dataclasses.dataclass
class Refund:
    order: int
    cents: int


async def test_an_async_function_s_model_comes_back_as_the_model() -> None:
    calls: list[int] = []

    @idempotent(MemoryDedupStore(), key="key")
    async def charge(key: str, cents: int) -> Receipt:
        calls.append(cents)
        return Receipt(order=1, cents=cents)

    first = await charge("k-1", 250)
    again = await charge.call_with_info("k-1", 250)
    assert again.replayed and calls == [250]
    assert isinstance(again.value, Receipt) and again.value == first


def test_a_sync_function_s_dataclass_comes_back_as_the_dataclass() -> None:
    @idempotent(MemoryDedupStore(), key="key")
    def refund(key: str, cents: int) -> Refund:
        return Refund(order=7, cents=cents)

    assert refund("k-1", 90) == Refund(order=7, cents=90)
    again = refund.call_with_info("k-1", 90)
    assert again.replayed and again.value == Refund(order=7, cents=90)


async def test_a_record_that_does_not_fit_the_type_is_a_stored_result_error() -> None:
    store = MemoryDedupStore()

    @idempotent(store, key="key", namespace="charges", validate_payload=False)
    async def charge(key: str) -> Receipt:
        return Receipt(order=1, cents=1)

    claim = await store.claim(DedupKey("charges", "k-old"), 30.0)
    await store.complete_many([Completion(claim, '{"p":null,"r":{"order":"one"}}')], 60.0)
    with pytest.raises(StoredResultError, match="does not fit the return type"):
        await charge("k-old")


async def test_a_msgspec_struct_comes_back_as_the_struct() -> None:
    @idempotent(MemoryDedupStore(), key="key")
    async def weigh(key: str) -> Parcel:
        return Parcel(parcel_id="p-1", grams=5)

    first = await weigh("k-1")
    again = await weigh.call_with_info("k-1")
    assert again.replayed and again.value == first and isinstance(again.value, msgspec.Struct)
