"""In-process retries: a transient error is tried again before the message counts as failed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_result,
    stop_after_attempt,
    wait_exponential,
)

from ..clock import Clock
from ..policy import RetryPolicy
from . import CallNext, Context, Decision, Verdict

_FAILED = Verdict.FAILED  # read for every message: see reliable_sub/_runtime/members.py


class InProcessRetry:
    """Calls the rest of the chain again while it fails with an exception in
    ``RetryPolicy.retry_on`` (and not a permanent one), up to ``in_process_attempts`` calls,
    waiting ``in_process_wait`` seconds (doubled each time) on ``clock``; then passes the last
    decision on.

    ``on_retry`` is called before each retry with the number of the attempt that failed and its
    error (telemetry's span event).
    """

    def __init__(
        self, policy: RetryPolicy, clock: Clock,
        on_retry: Callable[[int, BaseException | None], None] | None = None,
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._on_retry = on_retry

    def _transient(self, decision: Decision) -> bool:
        error = decision.error
        policy = self._policy
        return (decision.verdict is _FAILED and isinstance(error, policy.retry_on)
                and not policy.is_permanent(error))

    async def __call__(self, context: Context, call_next: CallNext) -> Decision:
        return await self.run(call_next, context)

    async def run(self, call: Callable[..., Awaitable[Decision]], *arguments: Any) -> Decision:
        """``call(*arguments)``, again while its decision is a transient failure (a batch
        handler's call, outside any chain, as well as the rest of a chain)."""
        policy = self._policy
        retrying = AsyncRetrying(
            stop=stop_after_attempt(policy.in_process_attempts),
            wait=wait_exponential(multiplier=policy.in_process_wait),
            retry=retry_if_result(self._transient),
            retry_error_callback=_last_decision,
            sleep=self._clock.sleep,
            before_sleep=self._before_retry if self._on_retry is not None else None,
        )
        decision: Decision = await retrying(call, *arguments)
        return decision


    def _before_retry(self, state: RetryCallState) -> None:
        assert self._on_retry is not None and state.outcome is not None
        decision: Decision = state.outcome.result()
        self._on_retry(state.attempt_number, decision.error)


def _last_decision(state: RetryCallState) -> Any:
    """When the attempts run out, the last failure goes on (not tenacity's RetryError)."""
    assert state.outcome is not None
    return state.outcome.result()


__all__ = ["InProcessRetry"]
