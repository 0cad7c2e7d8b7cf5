"""Dedup-store contract tests about owners: instances given one owner fence each other, and
every owner a store accepts fits its records. :class:`~reliable_sub.testing.DedupStoreSuite`
runs them with the rest; they need the harness's ``another`` (skipped without it)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from reliable_sub import Claimed, Completed, Completion, ConfigurationError, DedupKey, InProgress
from reliable_sub.dedup._store_base import OWNER_LIMIT
from reliable_sub.ports import DedupStore
from reliable_sub.testing.dedup_harness import StoreHarness

K = DedupKey("owners", "order-1")
# A token is the owner, a random instance part of 11 characters and a counter: short, as it is
# stored with each claimed record and sent with each claim.
TOKEN_BEYOND_OWNER = 24


def _another(stores: StoreHarness) -> Callable[[str], DedupStore]:
    if stores.another is None:
        pytest.skip(f"{stores.name}: the harness makes no other instances (StoreHarness.another)")
    return stores.another


async def test_two_instances_given_one_owner_fence_each_other(stores: StoreHarness) -> None:
    """Two processes of one service, both told owner="me": the lapsed holder's calls are
    refused and its twin's claim stands."""
    twin = _another(stores)("me")
    stale = await stores.store.claim(K, stores.short_ttl)  # a process that then stalls
    assert isinstance(stale, Claimed)
    await stores.wait_until_gone(K)
    fresh = await twin.claim(K, 30)
    assert isinstance(fresh, Claimed) and fresh.token != stale.token, (stale, fresh)
    for token in (stale.token, fresh.token):
        assert token.startswith("me."), "the owner stays a readable prefix"
        assert len(token) <= len("me") + TOKEN_BEYOND_OWNER, token

    assert await stores.store.renew([stale], 30) == [stale], "a stale renew must not extend"
    assert await stores.store.complete_many([Completion(stale, '"stale"')], 60) == [stale]
    await stores.store.release_many([stale], 60)
    busy = await stores.peer.claim(K, 30)
    assert isinstance(busy, InProgress), "the twin's claim is intact"

    assert await twin.renew([fresh], 30) == [], "the twin still holds its claim"
    assert await twin.complete(fresh, "fresh", 60) is True
    done = await stores.store.claim(K, 30)
    assert isinstance(done, Completed) and done.result == "fresh"


async def test_instances_given_one_owner_never_make_the_same_token(stores: StoreHarness) -> None:
    twin = _another(stores)("me")
    keys = [DedupKey("owners", f"k{i}") for i in range(40)]
    mine = await stores.store.claim_many(keys[:20], 30)
    theirs = await twin.claim_many(keys[20:], 30)
    tokens = [c.token for c in [*mine, *theirs] if isinstance(c, Claimed)]
    assert len(tokens) == 40 and len(set(tokens)) == 40, tokens


async def test_every_owner_accepted_fits_the_records(stores: StoreHarness) -> None:
    another = _another(stores)
    longest = another("o" * OWNER_LIMIT)
    claim = await longest.claim(K, 30)
    assert isinstance(claim, Claimed) and claim.token.startswith("o" * OWNER_LIMIT + ".")
    assert await longest.renew([claim], 30) == []
    assert await longest.complete(claim, "done", 60) is True
    done = await stores.peer.claim(K, 30)
    assert isinstance(done, Completed) and done.result == "done"

    with pytest.raises(ConfigurationError, match=f"at most {OWNER_LIMIT} characters") as refused:
        another("o" * 300)
    assert "got 300" in str(refused.value)


__all__ = [
    "test_every_owner_accepted_fits_the_records",
    "test_instances_given_one_owner_never_make_the_same_token",
    "test_two_instances_given_one_owner_fence_each_other",
]
