"""``@idempotent``: any function, sync or async, runs once per idempotency key.

::

    store = RedisDedupStore("redis://127.0.0.1:6379/0")

    @idempotent(store, key="request_id")
    async def charge(request_id: str, amount: int) -> dict[str, int]:
        ...  # charge the card
        return {"charged": amount}

    await charge("req-1", 10)                      # runs; stores {"charged": 10}
    await charge("req-1", 10)                      # returns the stored result; does not run
    info = await charge.call_with_info("req-1", 10)
    info.value, info.replayed, info.key            # ({'charged': 10}, True, 'req-1')
    await charge("req-1", 99)                      # IdempotencyKeyReuseError: other arguments

A call claims its key in the dedup store (``DedupKey(namespace, key)``; the namespace defaults
to ``idempotent:<module>.<qualname>``, so two functions never share records), then:

* **claimed** -- the function runs. Its result is stored as JSON for ``ttl`` seconds and
  returned. While it runs, its claim (a lease of ``lease_ttl`` seconds) is renewed every
  ``lease_ttl / 3``; a process that crashes mid-call stops renewing, and ``lease_ttl`` later
  the key is free for a retry. An exception releases the claim (a retry runs the function
  again) and is re-raised as it was. A result JSON cannot hold raises
  :class:`ResultNotSerializableError` at this first call, and the claim is released too.
* **completed** -- the stored result is returned without running the function (a *replay*):
  JSON-decoded, so tuples come back as lists and dict keys as str; the first call returned
  the function's own value.
* **in progress** (another call holds the key) -- ``on_in_progress="raise"`` raises
  :class:`IdempotencyInProgressError` at once; ``"wait"`` polls (10 ms, doubling to 200 ms)
  until the other call completes (its result is replayed), or releases or crashes (this call
  then runs the function itself), or ``wait_timeout`` passes (:class:`IdempotencyInProgressError`).

**A caller that gives up** -- an ``asyncio.wait_for`` around the call (an HTTP client's timeout),
a cancelled task, or in a sync caller a signal handler's exception -- stops waiting, not the store
calls: a function that returned still has its result stored, one that raised or was cancelled
still has its claim released, and a claim made by a claim call the caller left is released
too. The store call the cancellation interrupted is made again in a task of its own (async; a
call that is not cancelled costs nothing more) or on the background loop (sync), and a later
call with the key in the same process waits for it first (up to ``wait_timeout``), so the
natural client retry replays the result instead of finding the key in progress or running the
function again (see :mod:`~reliable_sub.idempotency._settling`). A store whose calls must not be
cut short in flight says so with a ``cancel_safe_calls = False`` attribute (SqlDedupStore: a
SQLite database would stay locked): async calls then await its calls in a task of their own,
through ``asyncio.shield``, and leave them to finish.

Completions are owner-fenced: if the claim was lost while the function ran (a lease that lapsed
and a peer that took the key), the completion is refused, the peer's record is left alone, a
warning is logged and the function's result is still returned -- the function did run. The same
goes for a store that fails at completion: the result is returned and the error logged, and a
later call with the key may run the function again.

**Payload validation** (``validate_payload=True``): the stored record also holds a fingerprint
of the call's arguments (SHA-256 of their canonical JSON; values JSON cannot hold by their type
and ``repr``, memory addresses dropped; a bound method's ``self`` left out). A later call with
the same key and other arguments raises :class:`IdempotencyKeyReuseError` rather than replaying
another request's result. It is checked against completed records only: an in-progress record
holds no fingerprint, so a waiting caller is checked when the call it waits for completes. The
record's JSON is ``{"p": <fingerprint hex or null>, "r": <result>}``.

**Sync functions** run on the calling thread, and so do their store calls when the store has
blocking twins (a :class:`~reliable_sub.ports.SyncDedupStore`: MemoryDedupStore,
RedisDedupStore) and the clock is the system clock: one round trip for a replay, two for a first
call, no thread hop, no event loop. Their claims are renewed by one shared daemon thread (see
:mod:`~reliable_sub.idempotency._renewer`), which a call joins when its function starts and leaves
when it returns; a ``"wait"`` caller sleeps with ``time.sleep``. With another store (SqlDedupStore)
or clock (a ManualClock: its sleeps are async only), the store calls, renewals and waits run on
one background event loop (a daemon thread shared by every sync ``@idempotent`` function of the
process), so the store's connections are reused from call to call. Either way a sync function
may be called from inside a running event loop (it blocks that loop, as any sync call does), and
one store serves sync and async functions alike: the records are the same.
:func:`close_sync_connections` closes the connections sync calls use (the background loop's and
the store's blocking client).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, ParamSpec, TypeVar, cast, overload

from .._bodies import result_decoder
from .._callables import is_async_callable
from .._results import encode_result
from .._text import describe_error, safe_repr
from ..clock import Clock, SystemClock, sleep_or_event
from ..dedup import TokenSource, check_owner
from ..errors import (
    ConfigurationError,
    IdempotencyInProgressError,
    IdempotencyKeyReuseError,
    ResultNotSerializableError,
    StoredResultError,
)
from ..policy import check_seconds
from ..ports import (
    Claimed,
    ClaimResult,
    Completed,
    Completion,
    DedupKey,
    DedupStore,
    InProgress,
    SyncDedupStore,
)
from ._background_loop import BACKGROUND
from ._renewer import RENEWALS_PER_LEASE, RENEWER
from ._settling import Settling
from .fingerprint import fingerprint

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

# A waiting caller polls the store this often at first, doubling up to MAX_POLL.
INITIAL_POLL = 0.01
MAX_POLL = 0.2
_IN_PROGRESS_MODES = ("raise", "wait")


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


def idempotent(
    store: DedupStore,
    *,
    key: str | Callable[..., str],
    ttl: float = 3600.0,
    lease_ttl: float = 30.0,
    on_in_progress: Literal["raise", "wait"] = "raise",
    wait_timeout: float = 30.0,
    validate_payload: bool = True,
    namespace: str | None = None,
    clock: Clock | None = None,
) -> Idempotent:
    """Make a sync or async function run once per idempotency key (see the module docstring).

    Args:
        store: the dedup store that keeps the records (any :class:`DedupStore`).
        key: the name of the parameter whose value (a non-empty str) is the idempotency key,
            or a callable given the call's ``(*args, **kwargs)`` (a method's ``self``
            included) that returns it -- :func:`idempotency_key` makes one from several values.
        ttl: seconds a completed call's result is kept (and replayed).
        lease_ttl: seconds a running call's claim lasts unless renewed (it is, every
            ``lease_ttl / 3``): how long after a crash a retry can run.
        on_in_progress: ``"raise"`` (:class:`IdempotencyInProgressError` at once) or
            ``"wait"`` (for the running call's result, up to ``wait_timeout`` seconds).
        wait_timeout: the longest a ``"wait"`` caller waits.
        validate_payload: refuse a key reused with other arguments
            (:class:`IdempotencyKeyReuseError`).
        namespace: the records' namespace (default ``idempotent:<module>.<qualname>``);
            functions given the same one share records.
        clock: the clock of renewals and waits (default: the system clock). Sync functions
            with another clock make their store calls on the background loop, which can sleep
            on it.

    Raises:
        ConfigurationError: an argument outside its allowed values (the message names it).
    """
    if store is None:
        raise ConfigurationError(
            "idempotent: store is required (a DedupStore: MemoryDedupStore, RedisDedupStore, "
            "SqlDedupStore)"
        )
    if not isinstance(store, DedupStore):
        raise ConfigurationError(
            f"idempotent: store must be a DedupStore (claim_many, renew, complete_many, "
            f"release_many, ...), got {type(store).__name__}"
        )
    if not (isinstance(key, str) and key) and not callable(key):
        raise ConfigurationError(
            "idempotent: key must be a parameter name (a non-empty str) or a callable that "
            f"returns the key from the call's arguments, got {key!r}"
        )
    check_seconds("idempotent", "ttl", ttl)
    check_seconds("idempotent", "lease_ttl", lease_ttl)
    check_seconds("idempotent", "wait_timeout", wait_timeout)
    if on_in_progress not in _IN_PROGRESS_MODES:
        raise ConfigurationError(
            f"idempotent: on_in_progress must be 'raise' or 'wait', got {on_in_progress!r}"
        )
    if not isinstance(validate_payload, bool):
        raise ConfigurationError(
            f"idempotent: validate_payload must be a bool, got {validate_payload!r}"
        )
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise ConfigurationError(
            f"idempotent: namespace must be a non-empty str or None, got {namespace!r}"
        )
    if clock is not None and not isinstance(clock, Clock):
        raise ConfigurationError(
            f"idempotent: clock must be a Clock (now, wall, sleep), got {type(clock).__name__}"
        )
    return Idempotent(
        _Settings(store, key, float(ttl), float(lease_ttl), on_in_progress,
                  float(wait_timeout), validate_payload, namespace, clock or SystemClock())
    )


@dataclass(frozen=True)
class _Settings:
    store: DedupStore
    key: str | Callable[..., str]
    ttl: float
    lease_ttl: float
    on_in_progress: str
    wait_timeout: float
    validate_payload: bool
    namespace: str | None
    clock: Clock


class Idempotent:
    """The decorator :func:`idempotent` returns; apply it to a sync or an async function."""

    def __init__(self, settings: _Settings) -> None:
        self._settings = settings

    @overload
    def __call__(  # type: ignore[overload-overlap]
        self, function: Callable[P, Coroutine[Any, Any, T]]
    ) -> AsyncIdempotentFunction[P, T]: ...

    @overload
    def __call__(self, function: Callable[P, T]) -> IdempotentFunction[P, T]: ...

    def __call__(self, function: Callable[..., Any]) -> Any:
        if not callable(function):
            raise ConfigurationError(
                f"@idempotent applies to a function, got {type(function).__name__}"
            )
        core = _Core(function, self._settings)
        if is_async_callable(function):
            return AsyncIdempotentFunction(core)
        return IdempotentFunction(core)


class _Bindable:
    """What both wrappers share: the core, ``functools.wraps`` attributes, method binding."""

    __wrapped__: Callable[..., Any]  # the decorated function; its __name__, __doc__ ... too
    __name__: str

    def __init__(self, core: _Core) -> None:
        self._core = core
        self._bound: tuple[object, ...] = ()
        functools.update_wrapper(cast(Any, self), core.function)

    @property
    def namespace(self) -> str:
        """The namespace of this function's records."""
        return self._core.namespace

    @property
    def store(self) -> DedupStore:
        """The dedup store that keeps this function's records."""
        return self._core.settings.store

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        """Bind a decorated method to ``instance`` (left out of the payload fingerprint)."""
        if instance is None:
            return self
        bound = copy.copy(self)
        bound._bound = (instance,)
        return bound

    def __repr__(self) -> str:
        return f"<idempotent {self._core.name} namespace={self._core.namespace!r}>"


class IdempotentFunction(_Bindable, Generic[P, T]):
    """A sync function made idempotent: calling it returns the value;
    :meth:`call_with_info` also says whether it was a replay."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.call_with_info(*args, **kwargs).value

    def call_with_info(self, *args: P.args, **kwargs: P.kwargs) -> IdempotentResult[T]:
        """Call the function (or replay its stored result) and say which it was."""
        core = self._core
        call_args = (*self._bound, *args)
        key, fingerprint = core.prepare(call_args, kwargs, len(self._bound))
        if core.settling.has(key):
            core.settling.wait_sync(key, core.settings.wait_timeout)
        store = core.sync_store
        if store is None:
            return self._on_background_loop(call_args, kwargs, key, fingerprint)
        started = core.begin_sync(store, key, fingerprint)
        if isinstance(started, IdempotentResult):
            return started
        ticket = None
        try:
            ticket = RENEWER.register(store, started, core.settings.lease_ttl, key,
                                      core.claim_lost)
            value = core.function(*call_args, **kwargs)
            record = core.record(value, fingerprint)
        except BaseException:
            if ticket is not None:
                RENEWER.unregister(ticket)
            core.finish_sync(store, started, key, None)
            raise
        RENEWER.unregister(ticket)
        core.finish_sync(store, started, key, record)
        return IdempotentResult(value, False, key)

    def _on_background_loop(
        self, call_args: tuple[Any, ...], kwargs: dict[str, Any], key: str,
        fingerprint: str | None,
    ) -> IdempotentResult[T]:
        """A call whose store calls and renewals run on the background loop."""
        core = self._core
        started = core.settling.ask_on_background(
            key, core.begin(key, fingerprint), functools.partial(core.release_unused, key=key),
            core.settings.store,
        )
        if isinstance(started, IdempotentResult):
            return started
        try:
            beat = BACKGROUND.run(core.start_heartbeat(started, key))
        except BaseException:
            core.hand_over(key, core.settle_claim(started, key, None))
            raise
        try:
            value = core.function(*call_args, **kwargs)
            record = core.record(value, fingerprint)
        except BaseException:
            core.finish_on_background(beat, started, key, None)
            raise
        core.finish_on_background(beat, started, key, record)
        return IdempotentResult(value, False, key)


class AsyncIdempotentFunction(_Bindable, Generic[P, T]):
    """An async function made idempotent: awaiting a call returns the value;
    :meth:`call_with_info` also says whether it was a replay."""

    def __init__(self, core: _Core) -> None:
        super().__init__(core)
        mark = getattr(inspect, "markcoroutinefunction", None)  # Python 3.12+
        if mark is not None:
            mark(self)  # inspect.iscoroutinefunction(self) is True, as for the function

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> T:
        return (await self.call_with_info(*args, **kwargs)).value

    async def call_with_info(self, *args: P.args, **kwargs: P.kwargs) -> IdempotentResult[T]:
        """Call the function (or replay its stored result) and say which it was."""
        core = self._core
        call_args = (*self._bound, *args)
        key, fingerprint = core.prepare(call_args, kwargs, len(self._bound))
        if core.settling.has(key):
            await core.settling.wait(key, core.settings.wait_timeout)
        started = await core.begin(key, fingerprint)
        if isinstance(started, IdempotentResult):
            return started
        beat = await core.start_heartbeat(started, key)
        try:
            value = await core.function(*call_args, **kwargs)
            record = core.record(value, fingerprint)
        except BaseException:
            await core.settle(beat, started, key, None)
            raise
        await core.settle(beat, started, key, record)
        return IdempotentResult(value, False, key)


@dataclass
class _Heartbeat:
    stop: asyncio.Event
    task: asyncio.Future[None]


class _Core:
    """One decorated function's settings and the steps of a call, on the store's side."""

    def __init__(self, function: Callable[..., Any], settings: _Settings) -> None:
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
        self.tokens = TokenSource(_owner_of(settings.store))
        # A store whose calls must not be cut short in flight has async calls await them in a
        # task of their own, through asyncio.shield (see the module docstring).
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
        waiting = _Waiting()
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
        waiting: _Waiting | None = None
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
            waiting = waiting or _Waiting()
            answer = self.after_claim(key, found, fingerprint, waiting, "claim_many_sync")
            if not isinstance(answer, float):
                return answer
            time.sleep(answer)

    def after_claim(
        self, key: str, found: ClaimResult, fingerprint: str | None, waiting: _Waiting,
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

    # -- while and after the call -----------------------------------------------------------

    async def start_heartbeat(self, claim: Claimed, key: str) -> _Heartbeat:
        """Renew ``claim`` every ``lease_ttl / 3`` until stopped (in the running loop)."""
        stop = asyncio.Event()
        return _Heartbeat(stop, asyncio.ensure_future(self._renew(claim, key, stop)))

    async def _renew(self, claim: Claimed, key: str, stop: asyncio.Event) -> None:
        settings = self.settings
        interval = settings.lease_ttl / RENEWALS_PER_LEASE
        while True:
            await sleep_or_event(settings.clock, stop, interval)
            if stop.is_set():
                return
            try:
                lost = await settings.store.renew([claim], settings.lease_ttl)
            except Exception:
                logger.warning(
                    "@idempotent %s: renewing the claim of idempotency key %r failed; retrying "
                    "in %.3gs", self.name, key, interval, exc_info=True,
                )
                continue
            if lost:
                self.claim_lost(key)
                return

    def claim_lost(self, key: str) -> None:
        """Log that the claim of ``key`` was lost while the call ran (renewals found it)."""
        logger.warning(
            "@idempotent %s: the claim of idempotency key %r lapsed or was taken over "
            "while the call runs; another call may run it too, and this call's result "
            "will not be stored if a peer holds the key", self.name, key,
        )

    def record(self, value: Any, fingerprint: str | None) -> str:
        """The JSON text to store: ``{"p": fingerprint, "r": value}``."""
        if inspect.isawaitable(value):  # a sync function that handed back its work unrun
            if inspect.iscoroutine(value):
                value.close()
            raise ResultNotSerializableError(
                f"@idempotent {self.name}: the function returned an awaitable, so its work did "
                "not run; declare it 'async def' (a plain decorator around an 'async def' "
                "should keep functools.wraps); nothing was stored and the key was released"
            )
        try:
            result_json = encode_result(value)
        except ResultNotSerializableError as error:
            raise ResultNotSerializableError(
                f"@idempotent {self.name}: {error}; nothing was stored and the key was "
                "released"
            ) from error
        stamp = "null" if fingerprint is None else f'"{fingerprint}"'  # hex: no escapes
        return f'{{"p":{stamp},"r":{result_json}}}'

    async def settle(
        self, beat: _Heartbeat, claim: Claimed, key: str, record: str | None
    ) -> None:
        """:meth:`finish`; a caller cancelled meanwhile leaves it to be done in a task of its
        own, which later calls with ``key`` wait for (see :mod:`._settling`)."""
        if self.shield:
            finishing = asyncio.ensure_future(self.finish(beat, claim, key, record))
            try:
                await asyncio.shield(finishing)
            except asyncio.CancelledError:
                self.settling.track(key, finishing)
                raise
            return
        try:
            await self.finish(beat, claim, key, record)
        except asyncio.CancelledError:  # the store call with it, maybe in flight: again
            self.settling.redo(key, self.finish_again(beat, claim, key, record))
            raise

    def finish_on_background(
        self, beat: _Heartbeat, claim: Claimed, key: str, record: str | None
    ) -> None:
        """:meth:`finish` on the background loop; a caller interrupted while it waits leaves
        it running there, and later calls with ``key`` wait for it."""
        self.settling.on_background(
            key, self.finish(beat, claim, key, record), self.settings.store
        ).result()

    async def finish(
        self, beat: _Heartbeat, claim: Claimed, key: str, record: str | None
    ) -> None:
        """Stop renewing; store ``record`` (or, without one, release the claim)."""
        beat.stop.set()
        await beat.task
        await self.settle_claim(claim, key, record)

    async def finish_again(
        self, beat: _Heartbeat, claim: Claimed, key: str, record: str | None
    ) -> None:
        """:meth:`finish` after a cancelled one: completing or releasing the same claim twice
        is harmless, and the heartbeat may have been cancelled with its caller."""
        beat.stop.set()
        await asyncio.wait([beat.task])
        await self.settle_claim(claim, key, record)

    async def settle_claim(self, claim: Claimed, key: str, record: str | None) -> None:
        """Store ``record`` for ``claim`` (or, without one, release it)."""
        store = self.settings.store
        if record is None:
            try:
                await store.release_many([claim], 0.0)
            except Exception:
                self.release_failed(key)
            return
        try:
            refused = await store.complete_many([Completion(claim, record)], self.settings.ttl)
        except Exception:
            self.completion_failed(key)
            return
        if refused:
            self.completion_refused(key)

    def finish_sync(
        self, store: SyncDedupStore, claim: Claimed, key: str, record: str | None
    ) -> None:
        """:meth:`finish` with the store's blocking twins (the caller stopped renewing); a
        caller interrupted in the store call hands it over to the background loop."""
        try:
            if record is None:
                try:
                    store.release_many_sync([claim], 0.0)
                except Exception:
                    self.release_failed(key)
                return
            try:
                refused = store.complete_many_sync([Completion(claim, record)],
                                                   self.settings.ttl)
            except Exception:
                self.completion_failed(key)
                return
        except BaseException:  # interrupted (a signal handler's exception, KeyboardInterrupt)
            self.hand_over(key, self.settle_claim(claim, key, record))
            raise
        if refused:
            self.completion_refused(key)

    def hand_over(self, key: str, settle: Coroutine[Any, Any, None]) -> None:
        """Run ``settle`` on the background loop, for a sync caller interrupted in it (the same
        store call again: completing and releasing a claim twice is harmless)."""
        try:
            self.settling.on_background(key, settle, self.settings.store)
        except Exception:  # e.g. at interpreter exit: no thread can start
            logger.warning(
                "@idempotent %s: the call with idempotency key %r was interrupted while it "
                "settled its claim, which could not be finished in the background; a retry "
                "can run once the claim lapses (lease_ttl)", self.name, key, exc_info=True,
            )

    def release_failed(self, key: str) -> None:
        logger.warning(
            "@idempotent %s: releasing idempotency key %r failed; a retry can run "
            "once its claim lapses (lease_ttl)", self.name, key, exc_info=True,
        )

    def completion_failed(self, key: str) -> None:
        logger.error(
            "@idempotent %s: storing the result of idempotency key %r failed; the result "
            "is returned, but a later call with this key may run the function again",
            self.name, key, exc_info=True,
        )

    def completion_refused(self, key: str) -> None:
        logger.warning(
            "@idempotent %s: the claim of idempotency key %r was lost to another call "
            "before this one finished; its result is returned but not stored (the other "
            "call's record stands)", self.name, key,
        )


@dataclass
class _Waiting:
    """A ``"wait"`` caller's progress: when it gives up, and its next pause."""

    deadline: float | None = None
    delay: float = INITIAL_POLL


def _owner_of(store: DedupStore) -> str:
    """The store's owner when it has a valid one (a readable token prefix), else a random one."""
    owner = getattr(store, "owner", None)
    try:
        return check_owner(owner if isinstance(owner, str) else None, "store")
    except ConfigurationError:
        return check_owner(None, "store")


def close_sync_connections(store: DedupStore) -> None:
    """Close the connections sync ``@idempotent`` functions use: ``store``'s on the background
    loop, and its blocking client (``close_sync``, if it has one). They reopen on next use. For
    tests and orderly shutdowns; at exit it happens by itself. Call it outside that loop's
    thread (anywhere but inside a store call)."""
    BACKGROUND.close_store(store)
    close_sync = getattr(store, "close_sync", None)
    if callable(close_sync):
        close_sync()


__all__ = [
    "AsyncIdempotentFunction",
    "Idempotent",
    "IdempotentFunction",
    "IdempotentResult",
    "close_sync_connections",
    "idempotent",
]
