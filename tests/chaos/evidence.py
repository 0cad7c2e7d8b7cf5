"""Reading what a scenario's consumers left behind, beyond the count of effects: their health
samples, the effect log (which doubled effect a kill explains), and the log of handler calls
(whether delivery attempts were counted right). Each check returns its figures for the report
and fails with every finding named.

Times are ``time.monotonic()`` of the consumer processes and of the test, one clock on Linux
(CLOCK_MONOTONIC is the machine's, not the process's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# A kill is taken to have landed at or after an effect or call stamped up to this long after
# it: the test stamps its kill just before sending SIGKILL.
KILL_SLACK = 0.05


@dataclass
class Health:
    """How the consumers' health samples went through a scenario."""

    samples: int
    unhealthy: int
    told_after: float | None = None  # the slowest consumer's: fault start -> first False
    back_after: float | None = None  # the slowest consumer's: fault end -> first True after

    def text(self) -> str:
        said = f"healthy() {self.samples - self.unhealthy}/{self.samples} samples True"
        if self.told_after is not None and self.back_after is not None:
            said += (f"; False from {self.told_after:.1f} s into the fault to its end, True "
                     f"again {self.back_after:.1f} s after")
        return said


Samples = dict[str, list[tuple[float, bool, str]]]


def check_health(samples: Samples, faults: Sequence[tuple[float, float]] = (), *,
                 unhealthy_after: float = 0.0, tell_within: float = 0.0,
                 recover_within: float = 0.0) -> Health:
    """``healthy()`` truthful: True in every sample outside the faults (and ``recover_within``
    after each); for a consumer that ran through a fault, False in every sample from
    ``unhealthy_after + tell_within`` into it until it ended, and True again within
    ``recover_within`` after it."""
    findings: list[str] = []
    total = unhealthy = 0
    told_after: list[float] = []
    back_after: list[float] = []
    for name, mine in samples.items():
        total += len(mine)
        unhealthy += sum(1 for _, ok, _ in mine if not ok)
        for at, ok, why in mine:
            if not ok and not any(start <= at <= end + recover_within for start, end in faults):
                findings.append(f"{name} unhealthy with no fault at {at:.2f}: {why}")
        for start, end in faults:
            if not mine or mine[0][0] > start or mine[-1][0] < end:
                continue  # started or stopped during the fault
            must_tell = start + unhealthy_after + tell_within
            lies = [at for at, ok, _ in mine if must_tell <= at <= end and ok]
            if lies:
                findings.append(f"{name} healthy {len(lies)} times {lies[0] - start:.1f}-"
                                f"{lies[-1] - start:.1f} s into a fault of {end - start:.1f} s "
                                f"(must be unhealthy from {must_tell - start:.1f} s)")
            if not any(must_tell <= at <= end for at, _, _ in mine):
                findings.append(f"{name} took no health sample from {must_tell - start:.1f} s "
                                f"into the fault to its end ({end - start:.1f} s)")
            first_false = next((at for at, ok, _ in mine if start <= at <= end and not ok), None)
            if first_false is not None:
                told_after.append(first_false - start)
            back = next((at for at, ok, _ in mine if at > end and ok), None)
            if back is None or back - end > recover_within:
                findings.append(f"{name} not healthy again within {recover_within:g} s after "
                                f"the fault ended")
            else:
                back_after.append(back - end)
    assert not findings, "healthy() untruthful:\n" + "\n".join(findings[:20])
    return Health(total, unhealthy, max(told_after, default=None),
                  max(back_after, default=None))


@dataclass
class Doubles:
    """Doubled effects, and how many of them the crash window explains."""

    doubled: int
    in_window: int
    outside: list[str]
    lags: list[float]  # of those in a window: from the effect's stamp to the kill (s)

    def text(self) -> str:
        said = f"{self.doubled} doubled, {self.in_window} of them in a kill's crash window"
        if self.lags:
            said += f" (effect to kill: {1000 * max(self.lags):.0f} ms at most)"
        return said


def attribute_doubles(log: list[str], killed_at: dict[str, float], window: float) -> Doubles:
    """Each effect of a doubled message but its last must be explained by a kill of the
    consumer that made it, landing within ``window`` seconds after the effect was stamped (the
    effect written, its completion not yet: the documented crash window). Log lines: ``n
    consumer time attempt``."""
    effects: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for line in log:
        n, consumer, at, _ = line.split(" ")
        effects[int(n)].append((float(at), consumer))
    doubled = in_window = 0
    outside: list[str] = []
    lags: list[float] = []
    for n, made in sorted(effects.items()):
        made.sort()
        for at, consumer in made[:-1]:
            doubled += 1
            killed = killed_at.get(consumer)
            if killed is not None and at - KILL_SLACK <= killed <= at + window:
                in_window += 1
                lags.append(killed - at)
            else:
                when = "never killed" if killed is None else f"killed {killed - at:+.3f} s after"
                outside.append(f"message {n}: effect by {consumer} ({when}), then again by "
                               f"{made[-1][1]}")
    return Doubles(doubled, in_window, outside, sorted(lags))


@dataclass
class Attempts:
    """Delivery attempts as the handlers saw them."""

    calls: int
    untouched: int  # messages no kill came near (from their first call to their last)
    highest: int

    def text(self) -> str:
        return (f"{self.calls} handler calls, attempts up to {self.highest}; the "
                f"{self.untouched} messages no kill came near called at consecutive attempts, "
                "every skip of the others explained by a kill")


def check_attempts(calls: list[str], killed_at: dict[str, float], messages: int,
                   effect_attempt: int) -> Attempts:
    """Attempts counted right (call lines: ``n attempt consumer time``; the handler fails every
    attempt before ``effect_attempt``).

    * A message's first call is attempt 1, unless a kill came before it (a delivery the dead
      process held is taken back by the broker, and counted).
    * A message no kill came near, from its first call to its last, was called at consecutive
      attempts up to ``effect_attempt``: each failed attempt's copy came back from its delay
      queue counted as the next.
    * Otherwise every attempt the handler saw first at ``a`` follows a call at ``a - 1``, or a
      kill since the message's first call explains the skip: a delivery the dead process held,
      one deferred while a dead consumer's claim lapsed, or while a second copy ran (a kill
      between a delayed copy's confirm and the original's ack leaves both; they may run side
      by side, so attempts need not rise call after call).
    """
    kills = sorted(killed_at.values())
    by_message: dict[int, list[tuple[float, int, str]]] = defaultdict(list)
    for line in calls:
        n, attempt, consumer, at = line.split(" ")
        by_message[int(n)].append((float(at), int(attempt), consumer))
    findings: list[str] = []
    untouched = highest = 0
    for n in range(messages):
        seen = sorted(by_message.get(n, []))
        if not seen:
            findings.append(f"message {n}: its handler was never called")
            continue
        attempts = [a for _, a, _ in seen]
        highest = max(highest, *attempts)
        first_at, first, _ = seen[0]
        story = ", ".join(f"{a} by {c} at {at:.2f}" for at, a, c in seen)
        if first != 1 and not any(k <= first_at + KILL_SLACK for k in kills):
            findings.append(f"message {n}: first called as attempt {first}, before any kill")
        since_first = [k for k in kills if first_at - KILL_SLACK <= k]
        if not any(k <= seen[-1][0] + KILL_SLACK for k in since_first):
            untouched += 1
            expected = list(range(first, max(first, effect_attempt) + 1))
            if attempts != expected:
                findings.append(f"message {n}: called at attempts {attempts}, no kill since its "
                                f"first call ({story})")
            continue
        called: set[int] = set()
        for at, attempt, _ in seen:
            explained = attempt == first or attempt - 1 in called or any(
                k <= at + KILL_SLACK for k in since_first)
            if attempt not in called and not explained:
                findings.append(f"message {n}: attempt {attempt} {at - first_at:.2f} s after "
                                f"its first call, with no call at {attempt - 1} and no kill "
                                f"between ({story})")
            called.add(attempt)
    assert not findings, (f"delivery attempts miscounted (kills at "
                          f"{', '.join(f'{k:.2f}' for k in kills)}):\n" + "\n".join(findings[:20]))
    return Attempts(len(calls), untouched, highest)


def consumers_said(started: Sequence[tuple[str, Any]], killed_at: dict[str, float],
                   lines: int = 12) -> str:
    """What every consumer process of a scenario logged (its health samples, tracebacks and the
    handler's designed failures left out): for a failure's message."""
    told: list[str] = []
    for name, child in started:
        said = [line for line in child.output.splitlines()
                if line and not line.startswith(("HEALTH ", " ", "Traceback", "HandlerFailure"))
                and "fails by design" not in line]
        end = f"killed at {killed_at[name]:.2f}" if name in killed_at else "not killed"
        told.append(f"== {name} ({end}):")
        told += [f"   {line[:300]}" for line in said[-lines:]]
    return "\n".join(told)


__all__ = ["Attempts", "Doubles", "Health", "attribute_doubles", "check_attempts",
           "check_health", "consumers_said"]
