"""The steps of an ``@idempotent`` call before its function runs: its key and payload
fingerprint from the arguments, claiming the key, replaying a stored result, waiting for a call
in progress (see :mod:`~reliable_sub.idempotency.decorator` for the behaviour)."""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._bodies import result_decoder
from .._text import describe_error, safe_repr
from ..clock import SystemClock
from ..dedup import TokenSource, check_owner
from ..errors import (
    ConfigurationError,
    IdempotencyInProgressError,
    IdempotencyKeyReuseError,
    StoredResultError,
)
from ..ports import (
    Claimed,
    ClaimResult,
    Completed,
    DedupKey,
    DedupStore,
    InProgress,
    SyncDedupStore,
)
from ._after_call import AfterCall, Settings
from ._settling import Settling
from .fingerprint import fingerprint

T = TypeVar("T")

# A waiting caller polls the store this often at first, doubling up to MAX_POLL.
INITIAL_POLL = 0.01
MAX_POLL = 0.2


@dataclass(frozen=True)
class IdempotentResult(Generic[T]):
    """What ``call_with_info`` returns.

    Attributes:
        value: the function's result (when ``replayed``: the stored one, JSON-decoded).
        replayed: True when the function did not run because the key had completed before.
        key: the idempotency key of the call (within the function's namespace).
    """

    value: T
    replayed: bool
    key: str


class Core(AfterCall):
    """One decorated function's settings and the steps of a call, on the store's side."""

    def __init__(self, function: Callable[..., Any], settings: Settings) -> None:
        self.function = function
        self.settings = settings
        # The store whose blocking twins sync calls make on the calling thread (None: they run
        # on the background loop, which follows any clock; time.sleep follows the system one).
        self.sync_store: SyncDedupStore | None = (
            settings.store
            if isinstance(settings.store, SyncDedupStore) and type(settings.clock) is SystemClock
            else None
        )
        qualname = getattr(function, "__qualname__", None)
        module = getattr(function, "__module__", None)
        self.name = f"{module}.{qualname}" if qualname and module else repr(function)
        # a return type that is a pydantic model or a dataclass: a replay returns one, too
        self.decode_result = result_decoder(function)
        self.settling = Settling(self.name)
        # Calls claim under tokens of their own making, so a call interrupted in its claim
        # knows which claim to release.
        self.tokens = TokenSource(owner_of(settings.store))
        # A store whose calls must not be cut short in flight has async calls await them in a
        # task of their own, through asyncio.shield (see the decorator module's docstring).
        self.shield = getattr(settings.store, "cancel_safe_calls", True) is False
        if settings.namespace is not None:
            self.namespace = settings.namespace
        elif not qualname or not module or "<lambda>" in qualname:
            raise ConfigurationError(
                f"@idempotent {self.name}: give a namespace= (the default, "
                "'idempotent:<module>.<qualname>', would not be unique to this function)"
            )
        else:
            self.namespace = f"idempotent:{module}.{qualname}"
        try:
            self.signature: inspect.Signature | None = inspect.signature(function)
        except (TypeError, ValueError):  # some builtins and C callables have none
            self.signature = None
        # A signature of positional-or-keyword parameters only (most are) is bound here without
        # Signature.bind, which costs more than the rest of a replay's own work: its names in
        # order, and its defaults.
        self.plain: tuple[tuple[str, ...], dict[str, Any]] | None = None
        if self.signature is not None and all(
            p.kind is p.POSITIONAL_OR_KEYWORD for p in self.signature.parameters.values()
        ):
            self.plain = (
                tuple(self.signature.parameters),
                {name: p.default for name, p in self.signature.parameters.items()
                 if p.default is not p.empty},
            )
        self.key_parameter: str | None = None
        if isinstance(settings.key, str):
            self.key_parameter = settings.key
            parameters = self.signature.parameters if self.signature is not None else {}
            parameter = parameters.get(settings.key)
            if parameter is None or parameter.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD
            ):
                named = [
                    name for name, p in parameters.items()
                    if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                ]
                raise ConfigurationError(
                    f"@idempotent {self.name}: key={settings.key!r} names no parameter of the "
                    f"function; its parameters are {named}, or pass a callable as key"
                )

    # -- before the call --------------------------------------------------------------------

    def prepare(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], skip: int
    ) -> tuple[str, str | None]:
        """The call's idempotency key and, with payload validation, its fingerprint."""
        arguments: dict[str, Any] | None = None
        if self.signature is not None and (
            self.key_parameter is not None or self.settings.validate_payload
        ):
            arguments = self.arguments(self.signature, args, kwargs)
        if self.key_parameter is not None:
            assert arguments is not None
            key = arguments[self.key_parameter]
            where = f"parameter {self.key_parameter!r}"
        else:
            assert callable(self.settings.key)
            key = self.settings.key(*args, **kwargs)
            where = "the key function"
        if not isinstance(key, str) or not key:
            raise ConfigurationError(
                f"@idempotent {self.name}: the idempotency key ({where}) must be a non-empty "
                f"str, got {key!r}; idempotency_key(...) makes one from other values"
            )
        if not self.settings.validate_payload:
            return key, None
        if arguments is None:
            payload: Mapping[str, Any] = {"args": list(args[skip:]), "kwargs": kwargs}
        else:
            for name in list(arguments)[:skip]:  # a bound method's self
                del arguments[name]
            payload = arguments
        return key, fingerprint(payload)

    def arguments(
        self, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """The call's arguments by name in the signature's order, defaults applied: what
        ``signature.bind(...)`` and ``apply_defaults()`` give, or the TypeError the call
        would raise."""
        if self.plain is not None:
            names, defaults = self.plain
            if len(args) <= len(names):
                arguments = dict(zip(names, args, strict=False))  # the first ones
                used = 0
                for name in names[len(args):]:
                    if name in kwargs:
                        arguments[name] = kwargs[name]
                        used += 1
                    elif name in defaults:
                        arguments[name] = defaults[name]
                    else:
                        break  # missing: bind raises the TypeError
                else:
                    if used == len(kwargs):  # else one is unknown or given twice: bind raises
                        return arguments
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    async def begin(self, key: str, fingerprint: str | None) -> Claimed | IdempotentResult[Any]:
        """Claim the key: the claim to run under, or the stored result to replay."""
        settings = self.settings
        record = DedupKey(self.namespace, key)
        waiting = Waiting()
        token = self.tokens.next()
        store = settings.store
        while True:
            claiming = None
            try:
                if self.shield:
                    claiming = asyncio.ensure_future(
                        store.claim_many([record], settings.lease_ttl, [token])
                    )
                    [found] = await asyncio.shield(claiming)
                else:
                    [found] = await store.claim_many([record], settings.lease_ttl, [token])
            except asyncio.CancelledError:  # the store may hold a claim under the token
                self.settling.redo(key, self.unclaim(Claimed(record, token), key, claiming))
                raise
            answer = self.after_claim(key, found, fingerprint, waiting, "claim_many")
            if not isinstance(answer, float):
                return answer
            await settings.clock.sleep(answer)

    async def unclaim(
        self, claim: Claimed, key: str, claiming: asyncio.Future[Any] | None
    ) -> None:
        """Release ``claim``, which a claim call its caller left may have made (once that
        call, if it still runs, has ended)."""
        if claiming is not None:
            await asyncio.wait([claiming])
        await self.settle_claim(claim, key, None)

    async def release_unused(self, started: object, key: str) -> None:
        """Release ``started`` if it is a claim (one its caller left without using)."""
        if isinstance(started, Claimed):
            await self.settle_claim(started, key, None)

    def begin_sync(
        self, store: SyncDedupStore, key: str, fingerprint: str | None
    ) -> Claimed | IdempotentResult[Any]:
        """:meth:`begin` with the store's blocking twins, on the calling thread (the system
        clock: waits sleep with ``time.sleep``)."""
        settings = self.settings
        record = DedupKey(self.namespace, key)
        waiting: Waiting | None = None
        token = self.tokens.next()
        while True:
            try:
                [found] = store.claim_many_sync([record], settings.lease_ttl, [token])
            except BaseException as error:
                if not isinstance(error, Exception):  # interrupted: the store may hold a claim
                    self.hand_over(key, self.settle_claim(Claimed(record, token), key, None))
                raise
            if type(found) is Claimed:  # the common answers first, without the waiting state
                return found
            if type(found) is Completed:
                return self.replay(key, found, fingerprint)
            waiting = waiting or Waiting()
            answer = self.after_claim(key, found, fingerprint, waiting, "claim_many_sync")
            if not isinstance(answer, float):
                return answer
            time.sleep(answer)

    def after_claim(
        self, key: str, found: ClaimResult, fingerprint: str | None, waiting: Waiting,
        method: str,
    ) -> Claimed | IdempotentResult[Any] | float:
        """What a claim's answer means: the claim to run under, the stored result to replay,
        or (waiting for a call in progress) the seconds to sleep before claiming again."""
        settings = self.settings
        if isinstance(found, Claimed):
            return found
        if isinstance(found, Completed):
            return self.replay(key, found, fingerprint)
        if not isinstance(found, InProgress):
            raise TypeError(f"{settings.store!r}.{method} answered {found!r}")
        if settings.on_in_progress == "raise":
            raise self.in_progress(key, found, waited=None)
        now = settings.clock.now()
        if waiting.deadline is None:
            waiting.deadline = now + settings.wait_timeout
        elif now >= waiting.deadline:
            raise self.in_progress(key, found, waited=settings.wait_timeout)
        pause = min(waiting.delay, waiting.deadline - now)
        waiting.delay = min(2 * waiting.delay, MAX_POLL)
        return float(pause)

    def replay(
        self, key: str, completed: Completed, fingerprint: str | None
    ) -> IdempotentResult[Any]:
        stored = completed.result  # StoredResultError if the record is not JSON
        if not isinstance(stored, dict) or "r" not in stored:
            raise StoredResultError(
                f"@idempotent {self.name}: the record of key {key!r} in namespace "
                f"{self.namespace!r} was not written by @idempotent (no 'r' field): "
                f"{(completed.result_json or '')[:80]!r}"
            )
        stored_fingerprint = stored.get("p")
        if (
            fingerprint is not None
            and isinstance(stored_fingerprint, str)
            and stored_fingerprint != fingerprint
        ):
            raise IdempotencyKeyReuseError(
                f"@idempotent {self.name}: idempotency key {key!r} was used before with other "
                "arguments; a key stands for one request -- use a new key for a new request",
                key=key,
            )
        value = stored["r"]
        if self.decode_result is not None and value is not None:
            try:
                value = self.decode_result(value)
            except Exception as error:  # a record written by another version of the type
                raise StoredResultError(
                    f"@idempotent {self.name}: the stored result of key {key!r} does not fit "
                    f"the return type ({describe_error(error, 300)}): {safe_repr(value, 80)}"
                ) from error
        return IdempotentResult(value, True, key)

    def in_progress(
        self, key: str, found: InProgress, waited: float | None
    ) -> IdempotencyInProgressError:
        lapse = (
            f"its claim lapses in {found.expires_in:.3g}s unless renewed"
            if math.isfinite(found.expires_in)
            else "its claim has no expiry"
        )
        if waited is None:
            message = (
                f"@idempotent {self.name}: idempotency key {key!r} is in progress in another "
                f"call ({lapse}); retry later with the same key"
            )
        else:
            message = (
                f"@idempotent {self.name}: idempotency key {key!r} was still in progress in "
                f"another call after waiting {waited:g}s ({lapse}); retry later with the same key"
            )
        return IdempotencyInProgressError(message, key=key, expires_in=found.expires_in)


@dataclass
class Waiting:
    """A ``"wait"`` caller's progress: when it gives up, and its next pause."""

    deadline: float | None = None
    delay: float = INITIAL_POLL


def owner_of(store: DedupStore) -> str:
    """The store's owner when it has a valid one (a readable token prefix), else a random one."""
    owner = getattr(store, "owner", None)
    try:
        return check_owner(owner if isinstance(owner, str) else None, "store")
    except ConfigurationError:
        return check_owner(None, "store")
