"""What every dedup store shares: fencing tokens, owner checks, and the single-key methods
over the batch ones. No store imports another; each imports this."""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Sequence
from typing import Any

from .._results import encode_result
from ..errors import ConfigurationError
from ..ports import Claimed, ClaimResult, Completion, DedupKey

# Separates the parts of a fencing token (owner, instance, counter); owners may not contain it,
# nor the "|" that stores use after the token.
_TOKEN_SEPARATOR = "."
# An owner is a readable prefix of every token, which is stored with each claimed record and
# sent with each claim: short, and within the SQL store's owner column (200 characters) with
# the instance part and the counter added.
OWNER_LIMIT = 64
# Random bytes naming one token source in one process: 64 bits, 11 characters of base64url.
# Two instances given the same owner (a service's name, in every one of its processes) then
# never make the same token.
_INSTANCE_BYTES = 8


def check_owner(owner: str | None, where: str) -> str:
    """The owner token prefix to use: ``owner`` once checked, or a fresh random one.

    An owner is at most ``OWNER_LIMIT`` characters, without ``|``, ``.`` or braces. It is only
    a readable prefix: every store instance adds a random part of its own to its tokens, so
    instances (the processes of one service) may all be given the same owner.
    """
    if owner is None:
        return secrets.token_urlsafe(6)
    if not isinstance(owner, str) or not owner or any(c in owner for c in "|.{}"):
        raise ConfigurationError(
            f"{where}.owner must be a non-empty str without '|', '.', '{{' or '}}', got {owner!r}"
        )
    if len(owner) > OWNER_LIMIT:
        raise ConfigurationError(
            f"{where}.owner must be at most {OWNER_LIMIT} characters (it prefixes every fencing "
            f"token, stored with each claim), got {len(owner)}: {owner[:20]!r}...; give a short "
            "name such as the service's (each instance adds a random part of its own)"
        )
    return owner


class TokenSource:
    """Fencing tokens unique to one store instance: ``<owner>.<instance>.<counter>``.

    The owner is a readable prefix only; the instance part is random, made afresh in a forked
    child, so instances given the same owner (or a process forked after making one) never
    hand out the same token.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._fresh_instance()

    def _fresh_instance(self) -> None:
        self._pid = os.getpid()
        instance = secrets.token_urlsafe(_INSTANCE_BYTES)
        self._prefix = f"{self.owner}{_TOKEN_SEPARATOR}{instance}{_TOKEN_SEPARATOR}"
        self._counter = itertools.count(1)

    def next(self) -> str:
        if self._pid != os.getpid():  # a forked child: the parent goes on with the same counter
            self._fresh_instance()
        return f"{self._prefix}{next(self._counter)}"


class SingleKeyMethods:
    """``claim``, ``complete`` and ``release`` of one key, over a store's batch methods."""

    async def claim_many(
        self, keys: Sequence[DedupKey], lease_ttl: float, tokens: Sequence[str] | None = None
    ) -> list[ClaimResult]:
        raise NotImplementedError

    async def complete_many(self, completions: Sequence[Completion], ttl: float) -> list[Claimed]:
        raise NotImplementedError

    async def release_many(self, claims: Sequence[Claimed], retention: float) -> None:
        raise NotImplementedError

    async def claim(self, key: DedupKey, lease_ttl: float) -> ClaimResult:
        """:meth:`claim_many` for one key."""
        return (await self.claim_many([key], lease_ttl))[0]

    async def complete(self, claim: Claimed, result: Any, ttl: float) -> bool:
        """Record ``claim`` as handled with a JSON-serialisable ``result``; False if refused.

        Raises :class:`ResultNotSerializableError` (and stores nothing) for a result JSON
        cannot hold.
        """
        refused = await self.complete_many([Completion(claim, encode_result(result))], ttl)
        return not refused

    async def release(self, claim: Claimed, retention: float = 0.0) -> None:
        """:meth:`release_many` for one claim."""
        await self.release_many([claim], retention)


__all__ = ["OWNER_LIMIT", "SingleKeyMethods", "TokenSource", "check_owner"]
