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

import copy
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Literal, ParamSpec, TypeVar, cast, overload

from .._callables import is_async_callable
from ..clock import Clock, SystemClock
from ..errors import ConfigurationError
from ..policy import check_seconds
from ..ports import DedupStore
from ._after_call import Settings
from ._background_loop import BACKGROUND
from ._core import Core, IdempotentResult
from ._renewer import RENEWER

P = ParamSpec("P")
T = TypeVar("T")

_IN_PROGRESS_MODES = ("raise", "wait")


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
        Settings(store, key, float(ttl), float(lease_ttl), on_in_progress,
                  float(wait_timeout), validate_payload, namespace, clock or SystemClock())
    )


class Idempotent:
    """The decorator :func:`idempotent` returns; apply it to a sync or an async function."""

    def __init__(self, settings: Settings) -> None:
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
        core = Core(function, self._settings)
        if is_async_callable(function):
            return AsyncIdempotentFunction(core)
        return IdempotentFunction(core)


class _Bindable:
    """What both wrappers share: the core, ``functools.wraps`` attributes, method binding."""

    __wrapped__: Callable[..., Any]  # the decorated function; its __name__, __doc__ ... too
    __name__: str

    def __init__(self, core: Core) -> None:
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

    def __init__(self, core: Core) -> None:
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
